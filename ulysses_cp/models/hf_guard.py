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
from .hf_head import HeadTransform, LMHead, candidates, head_module

__all__ = ["PER_TOKEN", "ProbeResult", "decoder_layers", "probe", "split_test", "tolerance"]

PER_TOKEN: tuple[type, ...] = (
    nn.Linear,
    nn.Embedding,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.Dropout,
    nn.Identity,
)
# relative tolerances: rounding of one dtype, far below what a shard-border error gives
# (float64 models still take routers, norms or kernels in float32: ~1e-7 here)
_TOL = {torch.float64: 1e-5, torch.float32: 2e-3, torch.bfloat16: 0.25, torch.float16: 0.25}
_FIX = (
    "ulysses_cp runs attention (through transformers' attention interface) and the token "
    "mixers of docs/models.md across ranks; train this model with sequence parallelism 1 "
    "(ulysses_degree = ring_degree = 1), or use a family the table lists as exact"
)


def tolerance(dtype: torch.dtype) -> float:
    return _TOL.get(dtype, 0.25)


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


def _activation(module: nn.Module) -> bool:
    mod = type(module).__module__
    if isinstance(module, nn.MultiheadAttention):
        return False
    return mod.startswith("torch.nn.modules.activation") or mod.startswith(
        "transformers.activations"
    )


# ---------------------------------------------------------------- the split test


def _seq_dim(t: Any, n: int) -> int | None:
    """The sequence dimension of ``t``: the first of its leading three dimensions of
    length ``n`` (``(b=1, n, ...)``, ``(n, ...)`` flattened tokens, ``(3, b, n, ...)``
    M-RoPE positions); ``n`` equals no size of the model (:func:`_probe_length`)."""
    if not isinstance(t, torch.Tensor):
        return None
    for i, size in enumerate(t.shape[:3]):
        if size == n:
            return i
    return None


def _cut(value: Any, n: int, part: slice) -> Any:
    """``value`` with every sequence-shaped tensor (inside tuples, lists, dicts) cut."""
    dim = _seq_dim(value, n)
    if dim is not None:
        return value[(slice(None),) * dim + (part,)]
    if isinstance(value, (tuple, list)):
        return type(value)(_cut(v, n, part) for v in value)
    if isinstance(value, dict):
        return {k: _cut(v, n, part) for k, v in value.items()}
    return value


def _first_seq(out: Any, n: int) -> tuple[torch.Tensor, int] | None:
    if _seq_dim(out, n) is not None:
        return out, int(_seq_dim(out, n))  # type: ignore[arg-type]
    if isinstance(out, (tuple, list)):
        for v in out:
            found = _first_seq(v, n)
            if found is not None:
                return found
    return None


def _sees_tokens(value: Any, n: int) -> bool:
    if _seq_dim(value, n) is not None:
        return True
    if isinstance(value, (tuple, list)):
        return any(_sees_tokens(v, n) for v in value)
    if isinstance(value, dict):
        return any(_sees_tokens(v, n) for v in value.values())
    return False


@torch.no_grad()
def split_test(module: nn.Module, args: tuple, kwargs: dict, n: int) -> str | None:
    """None if ``module`` is per-token on this call (the whole output equals the outputs
    of the first ``k`` tokens and of the rest, run apart); else why not."""
    if not _sees_tokens((args, kwargs), n):
        return None  # sees no token: mixes none
    k = max(1, (3 * n) // 8)
    try:
        whole = _first_seq(module(*args, **kwargs), n)
        parts = [
            _first_seq(module(*_cut(args, n, s), **_cut(kwargs, n, s)), s.stop - s.start)
            for s in (slice(0, k), slice(k, n))
        ]
    except Exception as exc:  # it cannot run on part of the sequence: not per-token
        return f"cannot run on part of the sequence ({type(exc).__name__}: {exc})"[:300]
    if whole is None or parts[0] is None or parts[1] is None:
        return "returns no tensor with the sequence dimension to check"
    (w, dim), (a, _), (b, _) = whole, parts[0], parts[1]
    try:
        got = torch.cat([a, b], dim=dim)
    except RuntimeError:
        got = a.new_empty(0)  # parts whose shapes do not join along the sequence
    if got.shape != w.shape:
        return (
            f"changes output shape when the sequence is cut: {tuple(got.shape)} vs {tuple(w.shape)}"
        )
    scale = w.abs().max().double().clamp_min(1e-30)
    err = float((got - w).abs().max().double() / scale)
    if err > tolerance(w.dtype):
        where = _worst_token(got - w, dim)
        return (
            f"mixes tokens: run on tokens {k}..{n - 1} apart from tokens 0..{k - 1} its "
            f"output differs by {err:.2g} (relative; first at token {where}), so on one "
            f"rank's shard it would silently compute something else"
        )
    return None


def _worst_token(diff: torch.Tensor, dim: int) -> int:
    """The token (index along ``dim``) with the largest absolute entry of ``diff``."""
    return int(diff.abs().movedim(dim, 0).reshape(diff.shape[dim], -1).amax(1).argmax())


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


def _guard(
    base: nn.Module, layers: nn.ModuleList, calls: _Calls, attention: set[int], n: int
) -> tuple[list[str], int]:
    """Findings of the module walk (module docstring, step 1) and how many modules were
    split-tested."""
    containing: set[int] = set()
    for m in base.modules():
        if any(id(d) in attention for d in m.modules()):
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
        if getattr(m, "ucp_sequence_parallel", False):
            return
        if isinstance(m, PER_TOKEN) or _activation(m):
            return
        args, kwargs = calls.first[id(m)]
        tested += 1
        why = split_test(m, args, kwargs, n)
        if why is not None:
            where = f"layer {layer_of[id(m)]}: " if id(m) in layer_of else ""
            findings.append(f"{where}{path} ({type(m).__name__}) {why}")

    visit("", base)
    return findings, tested


def _temperature_findings(model: nn.Module) -> list[str]:
    """Position-dependent query scaling the short probe cannot see (Llama 4's starts at
    ``floor_scale`` tokens): handled only where the package applies it itself."""
    out = []
    for name, m in model.named_modules():
        tuned = getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", 1)
        if tuned and getattr(m, "_ucp_temperature", None) is None:
            out.append(
                f"{name} ({type(m).__name__}) scales queries by position (attention "
                f"temperature tuning) from its local arange; build the model through "
                f"ucp.models.hf.HFCausalLM, which applies it from the global positions"
            )
    return out


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
    n = _probe_length(getattr(model, "config", None), P, wrapper.layout)
    out = model.get_output_embeddings()
    vocab, device = int(out.weight.shape[0]), out.weight.device
    head = head_module(model)
    ids = torch.randint(vocab, (1, n), generator=torch.Generator().manual_seed(1234)).to(device)
    pos = torch.arange(n, device=device)[None]
    base = wrapper.base
    _, layers = decoder_layers(model)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            findings = _temperature_findings(model)
            calls = _Calls(base)
            try:
                with whole_sequence(), recording() as record, _layer_io(layers) as whole:
                    hidden = wrapper.run_base(ids, pos, None)
                    logits = model(input_ids=ids, position_ids=pos, use_cache=False,
                                   **wrapper.extra_kwargs(pos, None)).logits  # fmt: skip
                    natural = model(input_ids=ids, use_cache=False).logits  # its own positions
                    eager = _eager_logits(model, ids, pos)  # transformers' own attention
            except ValueError as exc:
                if str(exc).startswith("ulysses_cp"):
                    raise  # a refusal of the attention adapter: the same on every rank
                _refuse(model, [_failed(exc)], "its forward")
            except Exception as exc:  # the family cannot run with this attention at all
                _refuse(model, [_failed(exc)], "its forward")
            finally:
                calls.close()
            attention = {id(m) for m, _ in record}
            findings += _masked_window(base, record)
            findings += _own_positions(logits, natural) + _same_as_eager(logits, eager)
            chosen = _head(model, head, hidden, logits, findings)
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


def _failed(exc: Exception) -> str:
    text = " ".join(str(exc).split())[:300]
    return (
        f"it fails to run with ulysses_cp attention on the whole sequence ({type(exc).__name__}: "
        f"{text}): it expects an attention mask or an implementation of its own"
    )


def _masked_window(base: nn.Module, record: list) -> list[str]:
    """A window the family applies through its mask (``create_sliding_window_causal_mask``
    in its forward, no layer types) that the attention calls do not carry: a window wider
    than the probe's sequence would not show in its logits."""
    import inspect

    config = getattr(base, "config", None)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or getattr(config, "layer_types", None):
        return []
    try:
        source = inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return []
    bare = [m for m, options in record if "window" not in options]
    if "create_sliding_window_causal_mask" not in source or not bare:
        return []
    return [
        f"its forward masks a sliding window of {window} tokens, which {type(bare[0]).__name__} "
        f"does not pass to the attention call: set config.sliding_window = None to train with "
        f"full attention, or use a family that passes its window (Mistral, Phi-3, Gemma 2/3)"
    ]


def _eager_logits(model: Any, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
    """The logits with transformers' eager attention and its own masks (None where the model
    cannot switch its attention implementation)."""
    key = model.config._attn_implementation
    try:
        model.set_attn_implementation("eager")
        if model.config._attn_implementation != "eager":
            return None
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits
    except Exception:
        return None
    finally:
        model.set_attn_implementation(key)


def _same_as_eager(logits: torch.Tensor, eager: torch.Tensor | None) -> list[str]:
    """Our attention on the whole sequence must give transformers' eager logits: a mask the
    family builds that the attention call does not carry (a window, chunks, a dynamic
    pattern) shows here."""
    if eager is None:
        return []
    err = float((logits.double() - eager.double()).abs().max())
    scale = float(eager.double().abs().max().clamp_min(1e-30))
    if err <= max(tolerance(logits.dtype), 1e-6) * scale:
        return []
    return [
        f"with ulysses_cp attention its logits differ from its own eager attention by "
        f"{err / scale:.2g} (relative) on the whole sequence: its layers attend with a mask "
        f"the attention call does not carry"
    ]


def _own_positions(logits: torch.Tensor, natural: torch.Tensor) -> list[str]:
    """The model run without ``position_ids`` must number its tokens 0..n-1, as the global
    positions ulysses_cp passes do (RoBERTa-style models count from ``padding_idx + 1``)."""
    err = float((logits.double() - natural.double()).abs().max())
    if err <= tolerance(logits.dtype) * float(natural.double().abs().max().clamp_min(1e-30)):
        return []
    return [
        "without position_ids its forward numbers the tokens otherwise than 0..n-1 (for "
        "example from padding_idx + 1, RoBERTa-style), while ulysses_cp passes each token's "
        "global position: its logits differ by "
        f"{err:.2g}"
    ]


def _head(model, linear, hidden, logits, findings: list[str]) -> HeadTransform:
    tol = tolerance(logits.dtype)
    want = logits.double()
    scale = want.abs().max().clamp_min(1e-30)
    for cand in candidates(model):
        try:
            got = LMHead(linear, cand)(hidden).double()
        except Exception:  # the head module does not map hidden states to logits alone
            break
        if got.shape == want.shape and float((got - want).abs().max() / scale) <= tol:
            return cand
    findings.append(
        f"its logits are not lm_head(hidden states) up to a scale or softcap of its config "
        f"(tried: {', '.join(c.source for c in candidates(model))}); the family "
        f"post-processes its logits in a way ulysses_cp does not know"
    )
    return HeadTransform()


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
        dim = _seq_dim(w[0], n) if len(w) == 2 and len(s) == 2 else None
        if dim is None or w[1].shape != w[0].shape:
            continue  # a layer that did not run, or hidden states of another shape
        s_in, s_out = (gather_sequence(t.contiguous(), topo, dim=dim) for t in s)
        want, got = (w[1] - w[0]).double(), (s_out - s_in).double()
        rms = want.pow(2).mean().sqrt().clamp_min(1e-30)
        err = float((got - want).abs().max() / rms)
        errors.append(err)
        if err > tol and not findings:
            token = _worst_token(got - want, dim)
            findings.append(
                f"layer {i} ({type(layers[i]).__name__}): its sharded output differs from the "
                f"whole-sequence output by {err:.2g} (relative to its update; tolerance "
                f"{tol:g} in {w[0].dtype}; first at token {token}): its own code mixes "
                f"tokens, or numbers positions, on each rank's shard alone"
            )
    _refuse(wrapper.model, _agree(findings, topo), "the sharded probe")
    return errors
