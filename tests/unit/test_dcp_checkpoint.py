"""``ulysses_cp.integrations.dcp_checkpoint`` in one process (DCP without a process group):
a round trip, and each folder that cannot be loaded refused by name. Resharding across
world sizes and meshes is tested on gloo ranks in tests/distributed/test_dcp_checkpoint.py."""

from __future__ import annotations

import pytest
import torch

from ulysses_cp.integrations.dcp_checkpoint import is_sharded_checkpoint, load_sharded, save_sharded


def _setup(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model, opt, sched, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_round_trip_restores_model_optimizer_scheduler_and_extra(tmp_path):
    model, opt, sched = _setup(0)
    _train(model, opt, sched, 2)
    assert not is_sharded_checkpoint(tmp_path / "c")
    save_sharded(model, opt, tmp_path / "c", scheduler=sched, extra={"step": 2, "tag": "x"})
    assert is_sharded_checkpoint(tmp_path / "c")
    model2, opt2, sched2 = _setup(1)
    assert load_sharded(model2, opt2, tmp_path / "c", scheduler=sched2) == {"step": 2, "tag": "x"}
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.1 / 3
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], opt2.state[p2][k]), k


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_folder_that_cannot_be_loaded_is_refused_by_name(tmp_path):
    model, opt, sched = _setup(0)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'none'} is not a sharded .*no such folder"):
        load_sharded(model, opt, tmp_path / "none")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "model.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no .metadata file \(it holds \['model.pt'\]\)"):
        load_sharded(model, opt, tmp_path / "plain")
    save_sharded(model, None, tmp_path / "model only")
    with pytest.raises(ValueError, match=r"lacks 12 entries .*'optimizer.state.0.weight.step'"):
        load_sharded(model, opt, tmp_path / "model only")
    assert load_sharded(model, None, tmp_path / "model only") == {}
    with pytest.raises(ValueError, match="holds no scheduler state"):
        load_sharded(model, None, tmp_path / "model only", scheduler=sched)
