"""One training step under SP + DeepSpeed ZeRO equals a single process; SP loss.

The unit-tier tests; the distributed-tier ones and the shared helpers are in
tests/distributed/test_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import (
    ROOT,
    TINY,
)
from ulysses_cp.config import RunConfig, read_config
from ulysses_cp.kernels.dispatch import local_attention
from ulysses_cp.models.decoder import Decoder
from ulysses_cp.training.engine import zero_grad_scale


def test_config_block_validation():
    with pytest.raises(ValueError, match=r"unknown keys.*\['ulysses'\]"):
        ucp.SequenceParallelConfig.from_dict({"ulysses": 2})
    with pytest.raises(ValueError, match="ulysses_degree must be an integer, got '2'"):
        ucp.SequenceParallelConfig.from_dict({"ulysses_degree": "2"})
    with pytest.raises(ValueError, match="positive integer"):
        ucp.SequenceParallelConfig.from_dict({"ulysses_degree": 0})
    with pytest.raises(ValueError, match="layout"):
        ucp.SequenceParallelConfig.from_dict({"layout": "ring"})
    with pytest.raises(ValueError, match="attention_backend"):
        ucp.SequenceParallelConfig.from_dict({"attention_backend": "xformers"})
    for stage, scale in ((3, 4), (2, 1)):
        sp = {"ulysses_degree": 4}
        run = RunConfig.load({"zero_optimization": {"stage": stage}, "sequence_parallel": sp})
        assert zero_grad_scale(run) == scale


def test_a_config_means_what_it_says(tmp_path):
    """A misspelled top-level block is refused (DeepSpeed would drop it silently); a JSON
    syntax error names the file and line; keys starting with '_' are comments."""
    with pytest.raises(ValueError, match=r"'sequence_paralel' \(did you mean 'sequence_parallel'"):
        read_config({"sequence_paralel": {"ulysses_degree": 2}})
    with pytest.raises(ValueError, match=r"'zero_optimisation' \(did you mean 'zero_optimization'"):
        read_config({"zero_optimisation": {"stage": 2}})
    read_config({"_comment": "kept", "train_batch_size": 8, "wandb": {}})
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": 8,\n  "bf16": {"enabled": true,}\n}\n')
    with pytest.raises(ValueError, match=rf"{bad}: invalid JSON at line 3, column"):
        read_config(bad)


def test_output_folder_is_never_silently_reused(tmp_path):
    from ulysses_cp.training.build import check_output_dir as check

    empty = tmp_path / "empty"
    with pytest.raises(ValueError, match="--resume: no checkpoint in"):
        check(empty, "yes", False)
    assert check(empty, "auto", False) is False and check(empty, None, False) is False
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"already holds a run.*--overwrite"):
        check(run, None, False)
    assert check(run, None, True) is False
    (run / "step2").mkdir()
    (run / "latest").write_text("step2")
    assert check(run, "yes", False) is True and check(run, "auto", False) is True


def test_the_skip_path_keeps_the_tiled_loss():
    """A non-finite micro batch is re-run with every label ignored: with tiled_loss the LM
    head still sees one tile at a time (the full logits are never materialised) and the
    loss has no gradient."""
    from ulysses_cp.config import TrainingConfig
    from ulysses_cp.models.memory import LossPlan
    from ulysses_cp.training.trainer import Trainer

    model = Decoder(TINY, lambda q, k, v: local_attention(q, k, v, backend="math"))

    class Engine:  # what the trainer's losses need of a DeepSpeed engine
        module = model
        device = torch.device("cpu")

        def __call__(self, *args, **kwargs):
            return model(*args, **kwargs)

    rows = []
    model.head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[:-1].numel()))
    topo = ucp.init_topology()
    ids = torch.randint(256, (2, 64))
    local = {"input_ids": ids, "position_ids": torch.arange(64).expand(2, -1), "shift_labels": ids}
    tc = TrainingConfig(save_on_signal=False)
    trainer = Trainer(Engine(), topo, None, tc=tc, out=None, loss_plan=LossPlan(4))
    loss = trainer.ignored_loss(local)
    loss.backward()
    assert loss.item() == 0.0 and max(rows) == 2 * 64 // 4, rows
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_relative_paths_resolve_against_the_config_folder(tmp_path):
    folder = tmp_path / "cfgs"
    folder.mkdir()
    cfg = {
        "model": {"hf_config": "hf/x.json", "hf_weights": "/abs/w"},
        "data": {"task": "text", "files": ["a.txt", "/abs/b.txt"]},
    }
    (folder / "run.json").write_text(json.dumps(cfg))
    got = read_config(folder / "run.json")
    assert got["model"] == {"hf_config": str(folder / "hf/x.json"), "hf_weights": "/abs/w"}
    assert got["data"]["files"] == [str(folder / "a.txt"), "/abs/b.txt"]
    shipped = read_config(ROOT / "configs" / "tiny_cpu_hf_llama_u2r2.json")
    assert Path(shipped["model"]["hf_config"]).is_file()
