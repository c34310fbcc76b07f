"""``"engine": "fsdp2"``'s reading of the DeepSpeed part (``training.fsdp2_settings``): the
learning rate of each DeepSpeed scheduler, step by step, against DeepSpeed's own classes;
the optimizer mapping; and each refused key named with its fix."""

from __future__ import annotations

import pytest
import torch

from tests.support.helpers import run_config
from ulysses_cp.config import RunConfig
from ulysses_cp.training import fsdp2_settings as fs

SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 20}),
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 1}),  # DeepSpeed warms up over at least 2
    ("WarmupDecayLR", {"total_num_steps": 40, "warmup_max_lr": 2e-3, "warmup_num_steps": 10}),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 1000, "warmup_num_steps": 50}),
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 25,
            "warmup_num_steps": 6,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.05,
        },
    ),
]


def _optimizer(lr: float = 5e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)


@pytest.mark.parametrize("kind,params", SCHEDULES)
def test_scheduler_gives_deepspeeds_learning_rate_at_every_step(kind, params):
    from deepspeed.runtime import lr_schedules

    theirs = _optimizer()
    ds = getattr(lr_schedules, kind)(theirs, **params)
    ours = _optimizer()
    sched = fs.make_scheduler({"type": kind, "params": params}, ours)
    lrs, want = [], []
    for _ in range(1100 if kind == "WarmupCosineLR" else 60):  # past the end of each
        lrs.append(ours.param_groups[0]["lr"])
        want.append(theirs.param_groups[0]["lr"])
        theirs.step()  # no gradients: nothing moves, but the order is torch's
        ours.step()
        ds.step()
        sched.step()
    assert lrs == want  # exact: the same operations in the same order
    assert len(set(want)) > 1  # the schedule moved


def test_optimizer_types_map_to_torch_optim():
    p = [torch.nn.Parameter(torch.zeros(2))]
    sgd = fs.make_optimizer({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, p)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9
    adam = fs.make_optimizer({"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.1}}, p)
    assert type(adam) is torch.optim.AdamW  # DeepSpeed's Adam decouples weight decay
    coupled = {"lr": 1e-3, "adam_w_mode": False, "torch_adam": True}
    assert type(fs.make_optimizer({"type": "Adam", "params": coupled}, p)) is torch.optim.Adam
    assert (
        type(fs.make_optimizer({"type": "AdamW", "params": {"lr": 1e-3}}, p)) is torch.optim.AdamW
    )


def _fsdp2(**blocks) -> RunConfig:
    base = run_config(**{"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **blocks})
    return RunConfig.load({**base, "engine": "fsdp2", "model": {}})


REFUSED = [
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "offload_optimizer"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "offload_optimizer"),
    ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, "offload_param"),
    ({"zero_optimization": {"stage3_max_live_parameters": 1e8}}, "stage3_max_live_parameters"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": 1e7}}, "stage3_prefetch_bucket_size"),
    ({"zero_optimization": {"zero_hpz_partition_size": 2}}, "zero_hpz_partition_size"),
    ({"fp16": {"enabled": True}}, "bf16 only"),
    ({"bf16": {"enabled": "auto"}}, '"enabled": "auto"'),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bf16.immediate_grad_update"),
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing"),
    ({"amp": {"enabled": True}}, "amp (a DeepSpeed-only key"),
    ({"optimizer": {"type": "Lamb", "params": {}}}, "optimizer.type 'Lamb'"),
    ({"gradient_clipping": "auto"}, "gradient_clipping 'auto'"),
    ({"gradient_clipping": -1.0}, "gradient_clipping -1.0"),
    ({"optimizer": None}, "optimizer missing"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type 'OneCycle'"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "total_num_steps missing"),
    ({"scheduler": {"type": "WarmupLR", "params": {"cycle_min_lr": 0}}}, "cycle_min_lr"),
]


@pytest.mark.parametrize("blocks,named", REFUSED, ids=[n for _, n in REFUSED])
def test_deepspeed_only_keys_are_refused_by_name(blocks, named):
    with pytest.raises(ValueError, match='"engine": "fsdp2" does not take') as err:
        fs.check_fsdp2(_fsdp2(**blocks))
    assert named in str(err.value)
    assert '"engine": "deepspeed"' in str(err.value)  # the other fix


def test_what_fsdp2_honours_passes_and_deepspeed_is_not_checked():
    kept = dict(
        zero_optimization={"stage": 3, "overlap_comm": True, "contiguous_gradients": True},
        bf16={"enabled": True},
        fp16={"enabled": False},
        gradient_clipping=1.0,
        steps_per_print=10,
        scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 10}},
        wandb={"enabled": False},
        _comment="a comment, as the shipped configs have",
    )
    fs.check_fsdp2(_fsdp2(**kept))
    run = _fsdp2(zero_optimization={"offload_optimizer": {"device": "nvme"}})
    from dataclasses import replace

    fs.check_fsdp2(replace(run, engine="deepspeed"))  # DeepSpeed's own business


def test_every_refusal_is_listed_at_once():
    run = _fsdp2(fp16={"enabled": True}, zero_optimization={"offload_param": {"device": "cpu"}})
    with pytest.raises(ValueError) as err:
        fs.check_fsdp2(run)
    assert "offload_param" in str(err.value) and "fp16.enabled" in str(err.value)
