"""The run's choices (layout, backend, input checks, gradient scale): one frozen home,
built once from the config, read by every call that takes the topology. No processes."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch

import ulysses_cp as ucp
from tests.support.helpers import ROOT, run_config
from ulysses_cp.config import SequenceParallelConfig
from ulysses_cp.core.options import CONFIG_KEYS, OPTION_NAMES, RunOptions
from ulysses_cp.core.topology import Topology
from ulysses_cp.training.engine import check_topology, run_options


def test_the_choices_cannot_change_halfway():
    topo = ucp.init_topology(1, 1, layout="contiguous", backend="math")
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.options.layout = "zigzag"
    for name in ("layout", "backend", "check_inputs", "grad_scale"):
        with pytest.raises(AttributeError):
            setattr(topo, name, getattr(topo, name))
    other = topo.with_options(layout="zigzag", check_inputs=False)
    assert (other.layout, other.check_inputs, other.backend) == ("zigzag", False, "math")
    assert (topo.layout, topo.check_inputs) == ("contiguous", True)  # a new value, not a change


@pytest.mark.parametrize(
    "bad, words",
    [
        (dict(layout="zig"), ["'zig'", "zigzag", "contiguous"]),
        (dict(backend="cuda"), ["'cuda'", "flash_attn", "math"]),
        (dict(check_inputs=1), ["check_inputs", "True or False"]),
        (dict(grad_scale=0), ["grad_scale", "positive"]),
        (dict(grad_scale=float("nan")), ["grad_scale", "finite"]),
    ],
)
def test_bad_choices_are_refused_with_the_value(bad, words):
    with pytest.raises(ValueError) as err:
        RunOptions(**bad)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("stage, scale", [(0, 1.0), (1, 1.0), (2, 1.0), (3, 4.0)])
def test_the_config_fixes_every_choice(stage, scale):
    sp = dict(layout="contiguous", check_inputs=False)
    cfg = ucp.RunConfig.load(run_config(2, 2, stage, backend="math", sp=sp))
    assert run_options(cfg) == RunOptions(
        layout="contiguous", backend="math", check_inputs=False, grad_scale=scale
    )


def test_a_topology_that_is_not_the_configs_is_refused():
    """ucp.initialize used to overwrite the gradient scale of the topology it was given (a
    value the loss reads); a hand-built topology under a ZeRO-3 config is now refused."""
    cfg = ucp.RunConfig.load(run_config(2, 1, 3, backend="torch", sp={"layout": "zigzag"}))
    hand_built = Topology(rank=0, world_size=2, ulysses_degree=2, ring_degree=1)
    with pytest.raises(ValueError) as err:
        check_topology(hand_built.with_options(backend="torch"), cfg)
    assert "grad_scale 1.0 vs the config's 2.0" in str(err.value)
    assert "topology_from_config" in str(err.value)
    with pytest.raises(ValueError, match="layout 'contiguous' vs the config's 'zigzag'"):
        check_topology(hand_built.with_options(layout="contiguous", grad_scale=2), cfg)
    with pytest.raises(ValueError, match="degrees u1 r2 vs the config's u2 r1"):
        check_topology(
            Topology(rank=0, world_size=2, ulysses_degree=1, ring_degree=2).with_options(
                backend="torch", grad_scale=2
            ),
            cfg,
        )
    check_topology(hand_built.with_options(backend="torch", grad_scale=2), cfg)  # the same


def test_attention_takes_the_runs_backend():
    """No backend= at the call: the topology's is used (flash_attn cannot run on CPU, so
    the error shows it was chosen); an explicit backend= overrides it."""
    q = torch.randn(1, 8, 2, 4, dtype=torch.float64)
    topo = ucp.init_topology(1, 1, backend="flash_attn")
    with pytest.raises(ValueError, match="flash"):
        ucp.attention(q, q, q, topo)
    out = ucp.attention(q, q, q, topo, backend="math")
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, q, q)), is_causal=True
    ).transpose(1, 2)
    torch.testing.assert_close(out, ref)


def test_the_loss_gradient_takes_the_runs_scale():
    logits = torch.randn(1, 6, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[1, 2, 3, 4, 0, -100]])
    grads = []
    for scale in (1.0, 3.0):
        topo = ucp.init_topology(1, 1, grad_scale=scale)
        loss = ucp.sequence_parallel_cross_entropy(logits, labels, topo)
        grads.append(torch.autograd.grad(loss, logits)[0])
    torch.testing.assert_close(grads[1], 3 * grads[0])


def test_init_topology_names_every_option_with_its_default():
    """The signature's keywords are RunOptions' fields, with the same defaults, so the two
    cannot drift (the keywords are spelt out for type checkers and IDEs)."""
    params = inspect.signature(ucp.init_topology).parameters
    declared = {f.name: f.default for f in dataclasses.fields(RunOptions)}
    keywords = {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == {**declared, "timeout_s": None}
    assert list(params)[:2] == ["ulysses_degree", "ring_degree"]
    with pytest.raises(TypeError, match="kv_exchnage"):
        ucp.init_topology(1, 1, kv_exchnage="ring")  # type: ignore[call-arg]


def test_the_config_block_is_the_options_under_their_keys():
    """Every option but the gradient scale (which follows the ZeRO stage) is a key of the
    "sequence_parallel" block, parsed into one RunOptions; its defaults are RunOptions'."""
    assert SequenceParallelConfig.from_dict(None).options == RunOptions()
    assert set(CONFIG_KEYS.values()) == set(OPTION_NAMES) - {"grad_scale"}
    block = dict(
        layout="contiguous",
        attention_backend="math",
        check_inputs=False,
        kv_exchange="allgather",
        head_chunks=2,
        redo_all_to_all=True,
        packing="row",
    )
    assert set(block) == set(CONFIG_KEYS)
    parsed = SequenceParallelConfig.from_dict({"ulysses_degree": 2, **block})
    assert parsed.ulysses_degree == 2
    assert parsed.options == RunOptions(**{CONFIG_KEYS[k]: v for k, v in block.items()})
    with pytest.raises(ValueError, match="'grad_scale'"):
        SequenceParallelConfig.from_dict({"grad_scale": 2.0})
    with pytest.raises(ValueError, match=r"^sequence_parallel.head_chunks must be an integer >= 0"):
        SequenceParallelConfig.from_dict({"head_chunks": -1})


def test_a_calls_choices_are_the_runs_with_its_overrides():
    run = RunOptions(layout="contiguous", backend="math", head_chunks=2)
    call = run.for_call(layout=None, backend="torch", head_chunks=None, packing="row")
    assert call == dataclasses.replace(run, backend="torch", packing="row")
    unchecked = run.for_call(kv_exchange="broadcast")  # the ranks compare it first
    assert unchecked.kv_exchange == "broadcast"
    with pytest.raises(TypeError, match="'layuot'"):
        run.for_call(layuot="zigzag")


def test_one_gradient_scale_rule():
    """``reduction_grad_scale`` is the rule: sp where the engine's reduction averages over
    the SP ranks too, else 1; no engine computes the scale by hand."""
    from ulysses_cp.core.options import reduction_grad_scale

    assert reduction_grad_scale(4, averages_over_sp=True) == 4.0
    assert reduction_grad_scale(4, averages_over_sp=False) == 1.0
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        reduction_grad_scale(0, averages_over_sp=True)
    by_hand = []
    for path in sorted((ROOT / "ulysses_cp").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"grad_scale\s*=\s*(float\(|\d|[\w.]+\s*\*)", line):
                by_hand.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not by_hand, by_hand
