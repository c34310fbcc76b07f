"""Sharded checkpoints (``ulysses_cp.integrations.dcp_checkpoint``) of an FSDP2 model: saved on
4 gloo ranks, loaded on 2 and on 4 over another mesh, float64.

The reference decoder is ``fully_shard``ed over 4 ranks and trained 3 AdamW steps under a
LambdaLR schedule, then saved, then stepped once more. Loaded into a model of other
random weights on 2 ranks (1-D mesh) and on 4 ranks (a 2 x 2 mesh: replicated over the
first dim, sharded over the second), every parameter and AdamW moment gathered whole
must equal the saved ones bit for bit, the schedule and ``extra`` must come back, and one
more step on the same global batch must reach the 4-rank run's fourth-step weights."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from tests.support.helpers import TINY, sdpa_attention
from ulysses_cp.integrations.dcp_checkpoint import load_sharded, save_sharded

TOL = dict(rtol=1e-12, atol=1e-12)
ROWS, SEQ, STEPS = 4, 16, 3  # the global batch: ROWS rows, split over the data ranks
_meshes: dict = {}


def _mesh(shape: tuple[int, ...]):
    """One device mesh per shape per pool process (group creation is collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _meshes:
        names = ("replicate", "shard")[-len(shape) :]  # 2-D: HSDP
        _meshes[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _meshes[shape]


def _setup(seed: int, shape: tuple[int, ...]):
    from torch.distributed.fsdp import fully_shard

    from ulysses_cp.models.decoder import Decoder

    torch.manual_seed(seed)
    model = Decoder(TINY, sdpa_attention).double()
    mesh = _mesh(shape)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _step(model, opt, sched, step: int) -> None:
    """One AdamW step on this rank's rows of global batch ``step`` (the mean over ranks)."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    ids = torch.randint(TINY.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(step))
    mine = ids.chunk(world)[rank]
    pos = torch.arange(SEQ).expand_as(mine)
    logits = model(mine, pos)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), mine[:, 1:].flatten()).backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _full(model, opt) -> dict:
    """Every parameter and AdamW moment, gathered whole (collective), by name."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{names[id(p)]}:{k}"] = st[k].full_tensor()
        out[f"{names[id(p)]}:step"] = st["step"].clone()
    return out


def _save(rank, folder: str) -> dict:
    model, opt, sched = _setup(0, (4,))
    for step in range(STEPS):
        _step(model, opt, sched, step)
    save_sharded(model, opt, Path(folder), scheduler=sched, extra={"step": STEPS})
    saved, sched_state = _full(model, opt), sched.state_dict()
    _step(model, opt, sched, STEPS)
    after = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    return dict(saved=saved, sched=sched_state, after=after)


def _load(rank, folder: str, shape: tuple[int, ...]) -> dict:
    model, opt, sched = _setup(1, shape)  # other weights than the save's
    extra = load_sharded(model, opt, Path(folder), scheduler=sched)
    loaded, sched_state = _full(model, opt), sched.state_dict()
    placements = {str(p.placements) for p in model.parameters()}
    _step(model, opt, sched, STEPS)
    after = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    return dict(loaded=loaded, sched=sched_state, after=after, extra=extra, placements=placements)


def test_saved_on_4_ranks_loads_on_2_and_on_another_mesh(pools, tmp_path):
    saved = pools(4).run(_save, str(tmp_path))[0]
    assert len(saved["saved"]) == 4 * len(saved["after"]) > 0  # weights, 2 moments, step
    assert saved["sched"]["last_epoch"] == STEPS
    loads = {
        "2 ranks": pools(2).run(_load, str(tmp_path), (2,)),
        "4 ranks, 2 x 2 mesh": pools(4).run(_load, str(tmp_path), (2, 2)),
    }
    assert loads["4 ranks, 2 x 2 mesh"][0]["placements"] == {"(Replicate(), Shard(dim=0))"}
    for where, results in loads.items():
        for res in results:
            assert res["extra"] == {"step": STEPS}, where
            assert res["sched"] == saved["sched"], where
            assert res["loaded"].keys() == saved["saved"].keys(), where
            for name, want in saved["saved"].items():
                assert torch.equal(res["loaded"][name], want), f"{where}: {name}"
            for name, want in saved["after"].items():  # one more step, the same batch
                torch.testing.assert_close(res["after"][name], want, **TOL, msg=f"{where}: {name}")
