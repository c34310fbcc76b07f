"""Exact or refused: the guard and the start-up probe of a Hugging Face model.

A model trains under sequence parallelism only if every path by which one token's result
depends on another token's is one this package runs across ranks. Each rank holds a
shard of the sequence, so any other token mixing (a convolution over the sequence, an SSM
scan, linear attention, a token shift, statistics over the sequence) would silently run
on the shard alone. :func:`probe` decides, on a short random sequence of ``n`` tokens (a
multiple of ``2P``), before the first step:

1. **The guard.** The model runs once on the whole sequence (plain local attention). Every
   module that ran inside the base model is then one of:
   - an attention module: it called the attention interface (``ucp.attention`` runs it
     across ranks); its children are checked by the same rules;
   - a module that does its own sequence-parallel work (``ucp_sequence_parallel = True``:
     the package's token-mixer adapters);
   - a per-token torch leaf (``Linear``, ``Embedding``, norms, activations, dropout);
   - a container of one of the above (decoder layers, the base model): its own code is
     checked by step 2;
   - any other module passes the **split test**: called on the first ``k`` tokens and on
     the rest separately (every sequence-shaped argument cut the same way), it must give
     the two halves of its whole-sequence output. Per-token modules (MLPs, MoE blocks,
     norms, rotary tables) pass; a convolution, scan or recurrence changes the first
     tokens of the second half and fails, as does anything that looks at the sequence.
   A module that fails, or cannot be called that way, refuses the model, naming the layer,
   the module's path and class, and the way out.
2. **The probe.** The model runs sharded (this run's layout and degrees) on the same
   tokens; each decoder layer's update (output minus input) is gathered and compared with
   the whole-sequence run's. The first layer that differs beyond the dtype's rounding
   refuses the model. This sees what the guard cannot: a layer's own forward code.
3. **The head.** The logits of :class:`~ulysses_cp.models.hf_head.LMHead` must equal the
   model's own ``forward`` logits; the first of the head
   :func:`~ulysses_cp.models.hf_head.candidates` that does is the head used for training.

What a sequence of ``n`` tokens cannot show is checked from the config where the layer
is called (:mod:`~ulysses_cp.models.hf_attention`: layer types, sliding windows that are
not passed to the attention call, chunk sizes) or fixed (Llama 4's temperature).

Every rank runs the same probe on the same tokens and weights; the verdicts are gathered
over the SP group, so every rank raises the same ``ValueError`` or none does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core.sharding import gather_sequence, sequence_multiple, shard_sequence
from ..core.topology import Topology
from .hf_attention import recording, whole_sequence
from .hf_checks import (
    eager_logits,
    failed,
    head_transform,
    masked_window,
    own_positions,
    same_as_eager,
    temperature_findings,
)
from .hf_head import HeadTransform, head_module
from .hf_split import PER_TOKEN, is_activation, seq_dim, split_test, tolerance, worst_token

__all__ = ["ProbeResult", "decoder_layers", "probe"]

_FIX = (
    "ulysses_cp runs attention (through transformers' attention interface) and the token "
    "mixers of docs/models/mixers.md across ranks; train this model with sequence parallelism "
    "1 (ulysses_degree = ring_degree = 1), or use a family docs/reference/families.md lists "
    "as exact"
)


@dataclass
class ProbeResult:
    """What the probe found: the head to train with, and what it checked."""

    head: HeadTransform
    tokens: int
    attention_modules: int
    split_tested: int
    layer_errors: list[float] = field(default_factory=list)


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The base model's list of decoder layers (``model.layers``, ``h``, ``blocks``...):
    its ModuleList whose length is the config's layer count (else the longest)."""
    base = getattr(model, "base_model", model)
    want = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    lists = [(n, m) for n, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__}: found no list of decoder layers")
    exact = [(n, m) for n, m in lists if len(m) == want]
    name, layers = min(exact or lists, key=lambda nm: (nm[0].count("."), -len(nm[1])))
    return name, layers


# ---------------------------------------------------------------- recording a run


class _Calls:
    """Forward pre-hooks on every module under ``root``: which modules ran, and the
    arguments of each one's first call."""

    def __init__(self, root: nn.Module) -> None:
        self.first: dict[int, tuple[tuple, dict]] = {}
        self.handles = [
            m.register_forward_pre_hook(self._hook(m), with_kwargs=True) for m in root.modules()
        ]

    def _hook(self, module: nn.Module):
        def hook(mod, args, kwargs):
            self.first.setdefault(id(module), (args, dict(kwargs)))

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def _layer_io(layers: nn.ModuleList) -> Iterator[list[list[torch.Tensor]]]:
    """Each decoder layer's hidden-state input and output (first call)."""
    io: list[list[torch.Tensor]] = [[] for _ in layers]

    def hooks(i: int):
        def pre(mod, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            if not io[i] and isinstance(x, torch.Tensor):
                io[i].append(x)

        def post(mod, args, kwargs, out):
            found = out if isinstance(out, torch.Tensor) else _first_tensor(out)
            if len(io[i]) == 1 and found is not None:
                io[i].append(found)

        return pre, post

    handles = []
    for i, layer in enumerate(layers):
        pre, post = hooks(i)
        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    try:
        yield io
    finally:
        for h in handles:
            h.remove()


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for v in out:
            if isinstance(v, torch.Tensor):
                return v
    return getattr(out, "last_hidden_state", None)


# ---------------------------------------------------------------- the guard


def _adapted(m: nn.Module) -> bool:
    """A token mixer the package runs across ranks (``models/hf_mixers.py``)."""
    return bool(getattr(m, "ucp_sequence_parallel", False))


def _guard(
    base: nn.Module, layers: nn.ModuleList, calls: _Calls, attention: set[int], n: int
) -> tuple[list[str], int]:
    """Findings of the module walk (module docstring, step 1) and how many modules were
    split-tested."""
    containing: set[int] = set()  # holds attention or an adapted mixer: a container
    for m in base.modules():
        if any(id(d) in attention or (_adapted(d) and d is not m) for d in m.modules()):
            containing.add(id(m))
    layer_of = {id(m): i for i, layer in enumerate(layers) for m in layer.modules()}
    findings: list[str] = []
    tested = 0

    def visit(path: str, m: nn.Module) -> None:
        nonlocal tested
        ran = id(m) in calls.first  # a ModuleList never runs, its layers do
        if not ran or m is base or id(m) in containing or any(m is x for x in layers):
            for name, child in m.named_children():
                visit(f"{path}.{name}" if path else name, child)
            return
        if _adapted(m):
            return
        if isinstance(m, PER_TOKEN) or is_activation(m):
            return
        args, kwargs = calls.first[id(m)]
        tested += 1
        why = split_test(m, args, kwargs, n)
        if why is not None:
            where = f"layer {layer_of[id(m)]}: " if id(m) in layer_of else ""
            findings.append(f"{where}{path} ({type(m).__name__}) {why}")

    visit("", base)
    return findings, tested


def _agree(findings: list[str], topo: Topology | None) -> list[str]:
    """The findings of every SP rank (each rank's, in rank order, without repeats)."""
    if topo is None or topo.sp_world_size == 1:
        return findings
    every: list[Any] = [None] * topo.sp_world_size
    dist.all_gather_object(every, findings, group=topo.sp_group)
    merged: list[str] = []
    for rank_findings in every:
        merged += [f for f in rank_findings if f not in merged]
    return merged


def _refuse(model: nn.Module, findings: list[str], what: str) -> None:
    if findings:
        lines = "\n  - ".join(findings)
        raise ValueError(
            f"{type(model).__name__} cannot train exactly under sequence parallelism "
            f"({what}):\n  - {lines}\nWay out: {_FIX}."
        )


def _same_weights(model: nn.Module, topo: Topology) -> None:
    """Every SP rank must hold the same weights: each computes its tokens with its own
    copy. One all-gather of a float64 checksum per parameter, one verdict everywhere."""
    with torch.no_grad():
        sums = torch.stack([p.detach().double().sum() for p in model.parameters()]).cpu()
    every = [torch.empty_like(sums) for _ in range(topo.sp_world_size)]
    dist.all_gather(every, sums, group=topo.sp_group)
    differ = [r for r, other in enumerate(every) if not torch.equal(other, every[0])]
    if differ:
        raise ValueError(
            f"{type(model).__name__}: the parameters differ across the sequence-parallel "
            f"ranks (SP ranks {differ} against rank 0): every SP rank computes its tokens "
            f"with its own copy of the weights. Seed every rank the same before building "
            f"the model (torch.manual_seed), or load the same weights (model.hf_weights)"
        )


def _partitioned(model: nn.Module) -> bool:
    """ZeRO-3 parameters (``ds_id``): one copy, partitioned over the ranks, so every SP
    rank gathers the same weights by construction (and holds none whole to compare)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _probe_length(config: Any, P: int, layout: str) -> int:
    """A multiple of the layout's multiple, >= 40, equal to none of the config's sizes and
    not a power of two (so that no weight dimension looks like the sequence)."""
    m = max(sequence_multiple(P, layout), 2)
    sizes = {v for v in vars(config).values() if isinstance(v, int)} if config else set()
    n = m * -(-40 // m)
    while n in sizes or n & (n - 1) == 0:
        n += m
    return n


def probe(wrapper: Any, topo: Topology | None, *, guard: bool | None = None) -> ProbeResult:
    """Run the guard, the probe and the head check (module docstring) for ``wrapper``
    (an :class:`~ulysses_cp.models.hf.HFCausalLM`); raise ``ValueError`` on every SP rank
    if the model is not exact here. Returns the head to train with.

    Without sequence parallelism (``P = 1``) every module sees the whole sequence, so only
    the head is checked; ``guard=True`` runs the guard anyway (it needs no other rank)."""
    model = wrapper.model
    P = 1 if topo is None else topo.sp_world_size
    guard = P > 1 if guard is None else guard
    if P > 1 and not _partitioned(model):
        assert topo is not None
        _same_weights(model, topo)
    n = _probe_length(getattr(model, "config", None), P, wrapper.layout)
    out = model.get_output_embeddings()
    # a ZeRO-3 partitioned weight is empty here; DeepSpeed keeps its shape as ds_shape
    vocab = int(getattr(out.weight, "ds_shape", out.weight.shape)[0])
    device = out.weight.device
    head = head_module(model)
    ids = torch.randint(vocab, (1, n), generator=torch.Generator().manual_seed(1234)).to(device)
    pos = torch.arange(n, device=device)[None]
    base = wrapper.base
    _, layers = decoder_layers(model)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            findings = temperature_findings(model)
            calls = _Calls(base)
            try:
                with whole_sequence(), recording() as record, _layer_io(layers) as whole:
                    hidden = wrapper.run_base(ids, pos, None)
                    logits = model(
                        input_ids=ids,
                        position_ids=pos,
                        use_cache=False,
                        **wrapper.extra_kwargs(pos, None),
                    ).logits
                    natural = model(input_ids=ids, use_cache=False).logits  # its own positions
                    eager = eager_logits(model, ids, pos)  # transformers' own attention
            except ValueError as exc:
                if str(exc).startswith("ulysses_cp"):
                    raise  # a refusal of the attention adapter: the same on every rank
                _refuse(model, [failed(exc)], "its forward")
            except Exception as exc:  # the family cannot run with this attention at all
                _refuse(model, [failed(exc)], "its forward")
            finally:
                calls.close()
            attention = {id(m) for m, _ in record}
            findings += masked_window(base, record)
            findings += own_positions(logits, natural) + same_as_eager(logits, eager)
            chosen = head_transform(model, head, hidden, logits, findings)
            if not guard:
                _refuse(model, _agree(findings, topo), "the head")
                return ProbeResult(chosen, n, len(attention), 0, [])
            adapted = any(getattr(m, "ucp_sequence_parallel", False) for m in base.modules())
            if not attention and not adapted:
                findings.append(
                    "it ran without calling the attention interface: its attention is "
                    "computed outside transformers' AttentionInterface (for example ALiBi "
                    "models such as Bloom or Falcon), so ulysses_cp cannot replace it"
                )
            more, tested = _guard(base, layers, calls, attention, n)
            why = split_test(head, (hidden,), {}, n)
            if why is not None:
                more.append(f"its LM head ({type(head).__name__}) {why}")
            _refuse(model, _agree(findings + more, topo), "the guard")
            errors: list[float] = []
            if P > 1:
                assert topo is not None
                errors = _compare_sharded(wrapper, topo, ids, pos, layers, whole)
    finally:
        model.train(training)
    return ProbeResult(chosen, n, len(attention), tested, errors)


def _compare_sharded(wrapper, topo: Topology, ids, pos, layers, whole) -> list[float]:
    """Run sharded; compare each layer's update with the whole run's (step 2)."""
    local_ids, local_pos = (shard_sequence(t, topo, dim=1) for t in (ids, pos))
    with _layer_io(layers) as sharded:
        wrapper.run_base(local_ids, local_pos, None)
    errors: list[float] = []
    findings: list[str] = []
    tol = tolerance(whole[0][0].dtype) if whole and whole[0] else 1.0
    n = ids.shape[1]
    for i, (w, s) in enumerate(zip(whole, sharded)):
        dim = seq_dim(w[0], n) if len(w) == 2 and len(s) == 2 else None
        if dim is None or w[1].shape != w[0].shape:
            continue  # a layer that did not run, or hidden states of another shape
        s_in, s_out = (gather_sequence(t.contiguous(), topo, dim=dim) for t in s)
        want, got = (w[1] - w[0]).double(), (s_out - s_in).double()
        rms = want.pow(2).mean().sqrt().clamp_min(1e-30)
        err = float((got - want).abs().max() / rms)
        errors.append(err)
        if err > tol and not findings:
            token = worst_token(got - want, dim)
            findings.append(
                f"layer {i} ({type(layers[i]).__name__}): its sharded output differs from the "
                f"whole-sequence output by {err:.2g} (relative to its update; tolerance "
                f"{tol:g} in {w[0].dtype}; first at token {token}): its own code mixes "
                f"tokens, or numbers positions, on each rank's shard alone"
            )
    _refuse(wrapper.model, _agree(findings, topo), "the sharded probe")
    return errors
