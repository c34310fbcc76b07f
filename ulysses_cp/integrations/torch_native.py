"""A drop-in for PyTorch's experimental ``context_parallel``: PyTorch-native training code
(plain loops, FSDP2, torchtitan) gets Ulysses, the ring and the hybrid by changing one
import, ``from ulysses_cp import context_parallel`` (example: docs/pytorch.md).

Inside the context ``torch.nn.functional.scaled_dot_product_attention`` on ``(b, h, s, d)``
tensors runs :func:`ulysses_cp.attention`; outside it nothing is patched (also after an
exception). Buffers are sharded along their sequence dims in the zigzag layout (PyTorch's
head-tail load balancing: rank i holds chunks i and 2P-1-i of 2P) and restored on exit.

The mode follows the mesh: a 1-D mesh runs Ulysses when the heads split over it and the ring
otherwise (``mode=`` overrides); a 2-D mesh whose dims are named ``"ulysses"`` and
``"ring"`` (or named by ``dims=``) runs the hybrid.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..core.options import Backend, KVExchange, Layout, RunOptions
from ..core.sharding import _shard, layout_indices, sequence_multiple
from ..core.topology import Topology
from ..modes.attention import attention
from ..modes.ulysses import kv_replication

__all__ = [
    "MODES",
    "context_parallel",
    "context_parallel_unshard",
    "sdpa_backend",
    "set_rotate_method",
]

MODES = ("ulysses", "ring", "hybrid")
ROTATE_METHODS = ("alltoall", "allgather")
_rotate_method = "alltoall"
_active: list[_Context] = []  # the entered context (one at a time)


def set_rotate_method(rotate_method: str) -> None:
    """PyTorch's ``set_rotate_method``: how KV moves in a ring group, for later contexts.

    Args:
        rotate_method: ``"alltoall"`` (the default here: our point-to-point ring, PyTorch's
            rotation) or ``"allgather"`` (PyTorch's default: every rank's KV gathered once).

    Raises:
        NotImplementedError: Another method, with PyTorch's message.
    """
    global _rotate_method
    if rotate_method not in ROTATE_METHODS:
        raise NotImplementedError(
            f"Context Parallel does not support using {rotate_method!r} for kv shards "
            f"rotation; use one of {list(ROTATE_METHODS)}"
        )
    _rotate_method = rotate_method


def sdpa_backend(device_type: str, default: str = "auto") -> str:
    """Our backend for the SDPA backends enabled now (``torch.nn.attention.sdpa_kernel``).

    All enabled (no ``sdpa_kernel`` in force): ``default``. Otherwise the first enabled of:
    FLASH_ATTENTION -> ``"auto"`` (flash-attn on a CUDA GPU that runs it, else torch's flash
    kernel; on CPU torch's CPU flash kernel), CUDNN_ATTENTION and EFFICIENT_ATTENTION ->
    ``"torch"`` (torch's fused kernels), MATH -> ``"math"``."""
    cuda = torch.backends.cuda
    enabled = {
        "flash": cuda.flash_sdp_enabled(),
        "cudnn": cuda.cudnn_sdp_enabled(),
        "efficient": cuda.mem_efficient_sdp_enabled(),
        "math": cuda.math_sdp_enabled(),
    }
    if all(enabled.values()):
        return default
    choice = {"flash": "auto", "cudnn": "torch", "efficient": "torch", "math": "math"}
    for name, on in enabled.items():
        if on:
            return choice[name]
    raise RuntimeError(
        "scaled_dot_product_attention: no SDPA backend is enabled (sdpa_kernel with an empty "
        f"list?) for {device_type} tensors; enable at least one"
    )


@dataclass
class _Mesh:
    """The context-parallel groups of a mesh and this rank's place in them."""

    P: int
    sp_rank: int
    sp_group: Any
    ulysses: tuple[Any, int] | None = None  # (group, degree) of a 2-D mesh
    ring: tuple[Any, int] | None = None
    order: list[int] = field(default_factory=list)  # sp rank of each sp-group rank


def _mesh_groups(mesh: Any, dims: Sequence[str] | None) -> _Mesh:
    if mesh.ndim == 1:
        group = mesh.get_group()
        P = dist.get_world_size(group)
        return _Mesh(P, dist.get_rank(group), group, order=list(range(P)))
    if mesh.ndim != 2:
        raise ValueError(
            f"context_parallel takes a 1-D mesh (Ulysses or ring) or a 2-D mesh (hybrid), "
            f"got {mesh.ndim} dims; pass the context-parallel sub-mesh, e.g. mesh['cp']"
        )
    names = mesh.mesh_dim_names
    u_dim, r_dim = dims if dims is not None else ("ulysses", "ring")
    if names is None or u_dim not in names or r_dim not in names:
        raise ValueError(
            f"a 2-D context-parallel mesh needs dims named {u_dim!r} and {r_dim!r}, got "
            f"{names}; name them in init_device_mesh(..., mesh_dim_names=...) or pass "
            f"dims=(ulysses_dim_name, ring_dim_name)"
        )
    ug, rg = mesh.get_group(u_dim), mesh.get_group(r_dim)
    u, r = dist.get_world_size(ug), dist.get_world_size(rg)
    sp_rank = dist.get_rank(rg) * u + dist.get_rank(ug)
    flat = mesh._flatten()  # one group over the whole mesh (for checks and gathers)
    sp_group = flat.get_group()
    # the flat group orders ranks by mesh position; ours puts ring-major: sp = r_i * u + u_i
    u_axis = names.index(u_dim)
    order = []
    for i in range(u * r):
        a, b = divmod(i, mesh.mesh.shape[1])
        u_i, r_i = (a, b) if u_axis == 0 else (b, a)
        order.append(r_i * u + u_i)
    return _Mesh(u * r, sp_rank, sp_group, (ug, u), (rg, r), order)


def _topology(
    m: _Mesh, u: int, r: int, ug: Any, rg: Any, backend: Backend, layout: Layout
) -> Topology:
    # A topology of the context-parallel groups only: rank/world are this rank's place in
    # them (data-parallel or FSDP dims beside them are the caller's business).
    exchange: KVExchange = "allgather" if _rotate_method == "allgather" else "ring"
    options = RunOptions(layout=layout, backend=backend, check_inputs=True, kv_exchange=exchange)
    return Topology(
        rank=m.sp_rank,
        world_size=m.P,
        ulysses_degree=u,
        ring_degree=r,
        ulysses_group=ug,
        ring_group=rg,
        sp_group=m.sp_group,
        options=options,
    )


@dataclass
class _Context:
    mesh: _Mesh
    mode: str | None
    layout: Layout
    backend: Backend
    full_len: int | None
    grad_buffers: list[tuple[torch.Tensor, int]]
    calls: list[tuple[str, str]] = field(default_factory=list)  # (mode, backend) per call

    def topology(self, hq: int, hkv: int) -> Topology:
        m = self.mesh
        if m.ulysses is not None and m.ring is not None:
            (ug, u), (rg, r) = m.ulysses, m.ring
            return _topology(m, u, r, ug, rg, self.backend, self.layout)
        mode = self.mode
        if mode is None:
            try:
                kv_replication(hq, hkv, m.P)
                mode = "ulysses"
            except ValueError:
                mode = "ring"
        if mode == "ulysses":
            return _topology(m, m.P, 1, m.sp_group, None, self.backend, self.layout)
        return _topology(m, 1, m.P, None, m.sp_group, self.backend, self.layout)

    def local(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """``t`` as this rank's tokens: a buffer that requires grad (kept whole) is sharded
        here, differentiably, so its ``.grad`` gets the buffer's full shape."""
        for buf, dim in self.grad_buffers:
            if t is buf:
                if dim != 2:
                    raise ValueError(
                        f"scaled_dot_product_attention's {name} is a context_parallel buffer "
                        f"with buffer_seq_dim {dim}; SDPA's sequence dim is 2 (b, h, s, d)"
                    )
                return _shard(t, self.mesh.P, self.mesh.sp_rank, self.layout, 2)
        if self.full_len is not None and self.mesh.P > 1 and t.shape[2] == self.full_len:
            raise ValueError(
                f"scaled_dot_product_attention got {name} with {t.shape[2]} tokens, the "
                f"full length of the context_parallel buffers; inside the context it takes "
                f"this rank's {self.full_len // self.mesh.P} tokens. Compute it from sharded "
                f"buffers, or pass the tensor itself in buffers= (buffers that require grad "
                f"stay whole and are sharded when SDPA reads them)"
            )
        return t

    def sdpa(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if attn_mask is not None:
            raise ValueError(
                "scaled_dot_product_attention under ulysses_cp.context_parallel takes no "
                f"attn_mask (got a {tuple(attn_mask.shape)} mask): use is_causal=True for "
                "causal attention; packed documents: ulysses_cp.attention(..., cu_seqlens=). "
                "A Hugging Face model: pass attention_mask=torch.ones_like(input_ids), so that "
                "transformers leaves the causal mask to SDPA (a zigzag shard's position ids "
                "look like packed documents to it)"
            )
        if dropout_p != 0.0:
            raise ValueError(
                f"scaled_dot_product_attention under ulysses_cp.context_parallel takes "
                f"dropout_p=0.0, got {dropout_p}"
            )
        if query.dim() != 4:
            raise ValueError(
                f"scaled_dot_product_attention under ulysses_cp.context_parallel takes "
                f"(batch, heads, seq, head_dim) tensors, got query of shape "
                f"{tuple(query.shape)}"
            )
        hq, hkv = query.shape[1], key.shape[1]
        if hq != hkv and not enable_gqa:
            raise ValueError(
                f"query has {hq} heads and key/value {hkv}: pass enable_gqa=True for "
                f"grouped-query attention (as PyTorch's SDPA requires)"
            )
        q, k, v = (self.local(t, n) for t, n in ((query, "query"), (key, "key"), (value, "value")))
        topo = self.topology(hq, hkv)
        backend = sdpa_backend(q.device.type, self.backend)
        self.calls.append((topo.mode, backend))
        out = attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            topo,
            causal=is_causal,
            softmax_scale=scale,
            backend=backend,
        )
        return out.transpose(1, 2)


def _check_buffers(
    buffers: list[torch.Tensor], seq_dims: list[int], no_restore: Sequence[torch.Tensor], P: int
) -> None:
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"buffer_seq_dims must have one entry per buffer: {len(buffers)} buffers, "
            f"{len(seq_dims)} seq dims"
        )
    for b in no_restore:
        if not any(b is x for x in buffers):
            raise ValueError("no_restore_buffers must be a subset of buffers (by identity)")
    multiple = sequence_multiple(P, "zigzag")
    for i, (b, d) in enumerate(zip(buffers, seq_dims)):
        if isinstance(b, torch.nn.Parameter):
            raise ValueError(f"buffers[{i}] is an nn.Parameter; context_parallel takes none")
        if not -b.dim() <= d < b.dim():
            raise ValueError(f"buffer_seq_dims[{i}] = {d} is not a dim of a {b.dim()}-D buffer")
        n = b.shape[d]
        if n % multiple:
            raise ValueError(
                f"buffers[{i}] has {n} tokens at dim {d}: the zigzag layout over {P} ranks "
                f"needs a multiple of {multiple}; pad it (ucp.pad_to_multiple(x, {multiple}, "
                f"dim={d})) to {n + (-n % multiple)}"
            )


@contextmanager
def context_parallel(
    mesh: Any,
    *,
    buffers: Sequence[torch.Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | Sequence[torch.Tensor] | None = None,
    mode: str | None = None,
    dims: Sequence[str] | None = None,
    backend: Backend = "auto",
) -> Iterator[_Context]:
    """PyTorch's ``context_parallel``, with the same arguments and meaning, over our modes.

    Buffers that require grad (q/k/v leaves) stay whole; SDPA shards them when it reads
    them, and their ``.grad`` has the full shape (this rank's contribution).

    Args:
        mesh: A 1-D ``DeviceMesh`` (Ulysses or ring), or a 2-D one with ``"ulysses"`` and
            ``"ring"`` dims (the hybrid).
        buffers: Tensors to shard in place along ``buffer_seq_dims``; restored on exit.
        buffer_seq_dims: The sequence dimension of each buffer.
        no_restore_buffers: Buffers (by identity) that stay sharded after the context.
        mode: ``"ulysses"`` or ``"ring"`` on a 1-D mesh; None chooses by the head counts.
        dims: The names of a 2-D mesh's ulysses and ring dims.
        backend: The local kernel while no ``sdpa_kernel`` narrows it.

    Yields:
        The context; its ``calls`` lists ``(mode, backend)`` of each SDPA call.

    Raises:
        ValueError: An unknown ``mode``, one the mesh cannot run, or buffers that do not fit.
        RuntimeError: A context is already active.
    """
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)} or None, got {mode!r}")
    if _active:
        raise RuntimeError("ulysses_cp.context_parallel is already active: one at a time")
    m = _mesh_groups(mesh, dims)
    two_d = m.ulysses is not None
    if mode is not None and (mode == "hybrid") != two_d:
        raise ValueError(
            f"mode={mode!r} does not fit a {2 if two_d else 1}-D mesh: a 1-D mesh runs "
            f"'ulysses' or 'ring', the hybrid needs a 2-D mesh with 'ulysses' and 'ring' dims"
        )
    bufs, seq_dims = list(buffers or []), list(buffer_seq_dims or [])
    no_restore = list(no_restore_buffers or [])
    _check_buffers(bufs, seq_dims, no_restore, m.P)
    seq_dims = [d % b.dim() for b, d in zip(bufs, seq_dims)]
    ctx = _Context(
        mesh=m,
        mode=mode,
        layout="zigzag",
        backend=backend,
        full_len=bufs[0].shape[seq_dims[0]] if bufs else None,
        grad_buffers=[(b, d) for b, d in zip(bufs, seq_dims) if b.requires_grad],
    )
    restore: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for b, d in zip(bufs, seq_dims):
            if b.requires_grad:
                continue
            if not any(b is x for x in no_restore):
                restore.append((b, b.clone()))
            shard = _shard(b, m.P, m.sp_rank, ctx.layout, d).clone()
            b.resize_(shard.shape)
            b.copy_(shard)
    _active.append(ctx)
    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = ctx.sdpa
    try:
        yield ctx
    finally:
        F.scaled_dot_product_attention = previous
        _active.clear()
        with torch.no_grad():
            for b, original in restore:
                b.resize_(original.shape)
                b.copy_(original)


@torch.no_grad()
def context_parallel_unshard(
    mesh: Any,
    buffers: Sequence[torch.Tensor],
    seq_dims: Sequence[int],
    *,
    dims: Sequence[str] | None = None,
) -> list[torch.Tensor]:
    """PyTorch's ``context_parallel_unshard``: the full tensors from this rank's shards.

    Args:
        mesh: The mesh given to `context_parallel`.
        buffers: This rank's shards.
        seq_dims: The sequence dimension of each shard.
        dims: As for `context_parallel`.

    Returns:
        The full tensors in natural token order, on every rank.

    Raises:
        ValueError: ``seq_dims`` does not have one entry per buffer.
    """
    if len(buffers) != len(seq_dims):
        raise ValueError(
            f"seq_dims must have one entry per buffer: {len(buffers)} buffers, "
            f"{len(seq_dims)} seq dims"
        )
    m = _mesh_groups(mesh, dims)
    out = []
    for b, d in zip(buffers, seq_dims):
        d = d % b.dim()
        parts = [torch.empty_like(b) for _ in range(m.P)]
        dist.all_gather(parts, b.contiguous(), group=m.sp_group)
        by_sp = [parts[m.order.index(s)] for s in range(m.P)]
        n = b.shape[d] * m.P
        held = torch.cat([layout_indices(n, m.P, s, "zigzag") for s in range(m.P)])
        out.append(torch.cat(by_sp, dim=d).index_select(d, held.argsort().to(b.device)))
    return out
