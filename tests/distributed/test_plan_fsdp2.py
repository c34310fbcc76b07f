"""The planner's FSDP2 bytes per step (``core.zero_comm.fsdp2_wire_bytes``) against what
torch's ``fully_shard`` sends: 4 gloo ranks, float32, a small model wrapped layer by layer
and as a whole, one forward and backward. The collectives FSDP2 calls are wrapped and each
call's ring bytes counted (all-gather: ``(n-1)`` times the input; reduce-scatter: ``(n-1)``
times the output), with ``reshard_after_forward`` True, False and left to torch (the
root then keeps its parameters for the backward). Memory is not measured here: CPU
tensors have no allocator statistics to compare against."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ulysses_cp.core.zero_comm import fsdp2_wire_bytes

VOCAB, DIM, LAYERS = 64, 16, 3  # every first dim a multiple of 4: no padding
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def _sent(rank, reshard) -> dict:
    """This rank's counted bytes for one step, and the model's parameter counts."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Model()
    n = dist.get_world_size()
    numel = sum(p.numel() for p in model.parameters())
    root = model.embed.weight.numel() + model.head.weight.numel()
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    counted = {"all_gather": 0, "reduce_scatter": 0}
    real = {name: getattr(dist, name) for name in (GATHER, SCATTER)}

    def gather(output, input, *args, **kwargs):
        counted["all_gather"] += (n - 1) * input.numel() * input.element_size()
        return real[GATHER](output, input, *args, **kwargs)

    def scatter(output, input, *args, **kwargs):
        counted["reduce_scatter"] += (n - 1) * output.numel() * output.element_size()
        return real[SCATTER](output, input, *args, **kwargs)

    setattr(dist, GATHER, gather)
    setattr(dist, SCATTER, scatter)
    try:
        ids = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
        model(ids).float().pow(2).mean().backward()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return {**counted, "numel": numel, "root": root, "world": n}


@pytest.mark.parametrize("reshard", [True, False, None])
def test_fsdp2_bytes_match_what_torch_sends(pools, reshard):
    results = pools(4).run(_sent, reshard)
    res = results[0]
    assert all(r == res for r in results)  # every rank sends alike
    predicted = fsdp2_wire_bytes(
        reshard_after_forward=reshard is not False,
        params=res["numel"],
        param_bytes=4,
        reduce_bytes=4,
        world=res["world"],
        micro_steps=1,
        kept_params=res["root"] if reshard is None else 0,  # torch keeps the root's
    )
    sent = res["all_gather"] + res["reduce_scatter"]
    assert res["all_gather"] > 0 and res["reduce_scatter"] > 0
    assert abs(sent / predicted - 1) < 0.02, (sent, predicted, res)
