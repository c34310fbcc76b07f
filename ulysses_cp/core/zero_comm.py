"""ZeRO's collective bytes per optimizer step, by formula: the one home of the rule that the
planner (``plan.comm.zero_bytes``) predicts with and that ``metrics.jsonl`` logs.

DeepSpeed's own communication is not counted live (its comms logger slows every collective
and records message sizes, not what a rank sends); the formula below was checked against
that logger's message bytes on CPU (``scripts/plan_vs_measured.py``, ``tests/unit/test_plan.py``).

As DeepSpeed issues the collectives with this package's mpu (ZeRO partitions over all
``n`` ranks, data x sequence parallel): ZeRO-1/2 all-reduce the gradients (``S = psi *
B`` bytes; ZeRO-1 once per step, ZeRO-2 every micro batch) and all-gather the updated
parameter partitions after the step (``psi * B / n`` per rank); ZeRO-3 all-gathers the
parameters for the forward (and again for the backward when the model has more than
``stage3_max_live_parameters``) and reduce-scatters the gradients every micro batch.
Bytes on the wire per rank (ring algorithms): all-reduce ``2 (n-1)/n S``, all-gather
``(n-1) p``, reduce-scatter ``(n-1)/n S``. ZeRO 0 (plain data parallel) is counted as
ZeRO-1's all-reduce.

FSDP2 (``torch.distributed.fsdp.fully_shard`` over all ``n`` ranks, data x sequence
parallel, ``ulysses_cp.integrations.fsdp2``), every micro batch: one all-gather of the
parameters for the forward in the unsharded (compute) dtype, another for the backward of
the units resharded after the forward (``reshard_after_forward=True``, the meaning of
ZeRO-3), and one reduce-scatter of the gradients in the reduce dtype (float32 under the
bf16 ``MixedPrecisionPolicy``). Same ring bytes as above; each rank's share is counted
as ``ceil(psi / n)`` (fully_shard pads every parameter's first dim to a multiple of ``n``).
"""

from __future__ import annotations

__all__ = [
    "fsdp2_collectives",
    "fsdp2_wire_bytes",
    "full_numel",
    "zero_collectives",
    "zero_wire_bytes",
]


def full_numel(params) -> int:
    """Elements of ``params`` at full size (a ZeRO-3 partitioned parameter's ``ds_numel``)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in params)


def zero_collectives(
    *,
    params: int,
    element_bytes: int,
    stage: int,
    world: int,
    micro_steps: int = 1,
    max_live_parameters: float = 1e9,
) -> dict[str, dict[str, int]]:
    """``{op: {"logged": message bytes, "wire": bytes this rank sends}}`` per step (empty
    with one rank: nothing to reduce)."""
    n, S = world, params * element_bytes
    if n == 1:
        return {}
    part = -(-params // n) * element_bytes
    if stage == 3:
        gathers = 2 if params > max_live_parameters else 1
        return {
            "all_gather": {
                "logged": gathers * part * micro_steps,
                "wire": gathers * (n - 1) * part * micro_steps,
            },
            "reduce_scatter": {"logged": S * micro_steps, "wire": (n - 1) * S // n * micro_steps},
        }
    reduces = micro_steps if stage == 2 else 1
    return {
        "all_reduce": {"logged": S * reduces, "wire": 2 * (n - 1) * S // n * reduces},
        "all_gather": {"logged": part if stage else 0, "wire": (n - 1) * part if stage else 0},
    }


def zero_wire_bytes(
    *,
    stage: int,
    max_live_parameters: float | None,
    params: int,
    element_bytes: int,
    world: int,
    micro_steps: int,
) -> int:
    """Bytes this rank sends per step in ZeRO's collectives at ZeRO ``stage`` with
    ``stage3_max_live_parameters`` (None: ``"auto"``, DeepSpeed's 1e9), as the config's
    parsed DeepSpeed settings give them (``ulysses_cp.deepspeed_block``)."""
    ops = zero_collectives(
        params=params,
        element_bytes=element_bytes,
        stage=stage,
        world=world,
        micro_steps=micro_steps,
        max_live_parameters=1e9 if max_live_parameters is None else max_live_parameters,
    )
    return sum(v["wire"] for v in ops.values())


def fsdp2_collectives(
    *,
    params: int,
    param_bytes: int,
    reduce_bytes: int,
    world: int,
    reshard_after_forward: bool,
    micro_steps: int = 1,
    kept_params: int = 0,
) -> dict[str, dict[str, int]]:
    """FSDP2's collectives per step, as :func:`zero_collectives` gives ZeRO's (empty with
    one rank). ``param_bytes``: the all-gather's dtype (``param_dtype``, else the model's);
    ``reduce_bytes``: the reduce-scatter's (``reduce_dtype``); ``kept_params``: parameters
    not gathered again in backward although ``reshard_after_forward`` is True (the root
    module's when its ``reshard_after_forward`` is left at ``None``: torch keeps them).
    The parameters are gathered in every micro step; the gradients are reduce-scattered
    once per step, since both engines defer the reduction of the micro steps but the last
    (``set_requires_gradient_sync(False)``)."""
    n = world
    if n == 1:
        return {}
    part = lambda numel: -(-numel // n)  # noqa: E731 (a rank's padded share)
    gathered = part(params)
    if reshard_after_forward:
        gathered += part(params - kept_params)
    return {
        "all_gather": {
            "logged": gathered * param_bytes * micro_steps,
            "wire": (n - 1) * gathered * param_bytes * micro_steps,
        },
        "reduce_scatter": {
            "logged": n * part(params) * reduce_bytes,
            "wire": (n - 1) * part(params) * reduce_bytes,
        },
    }


def fsdp2_wire_bytes(
    *,
    reshard_after_forward: bool,
    params: int,
    param_bytes: int,
    reduce_bytes: int,
    world: int,
    micro_steps: int,
    kept_params: int = 0,
) -> int:
    """Bytes this rank sends per step in FSDP2's collectives (:func:`fsdp2_collectives`):
    the FSDP2 engine's ``comm_bytes_per_step`` beside the attention's, as
    :func:`zero_wire_bytes` is DeepSpeed's."""
    ops = fsdp2_collectives(
        params=params,
        param_bytes=param_bytes,
        reduce_bytes=reduce_bytes,
        world=world,
        reshard_after_forward=reshard_after_forward,
        micro_steps=micro_steps,
        kept_params=kept_params,
    )
    return sum(v["wire"] for v in ops.values())
