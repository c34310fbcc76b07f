"""The model FLOPs of a training step: the count behind TFLOP/s, MFU and the planner's
step time.

Model FLOPs count what the model needs, not what the run spends: no recomputation
(activation checkpointing, tiled pieces run again in backward) and no padding.

- matmuls: ``6 * matmul_params * tokens`` (forward 2, backward 4 per parameter and token);
  ``matmul_params`` excludes the input embedding (a lookup), and includes the LM head;
- attention: forward ``4 * N^2 * hq * d`` per sequence and layer (scores and output),
  halved under a causal mask, and backward twice the forward: ``6 * N^2 * hq * d``
  causal, as FlashAttention's and Megatron's benchmarks count it. ``d`` is the mean of
  the q/k and v head dims (MLA's differ).

Per rank under sequence parallelism of degree ``sp``: every count divided by ``sp``.

A training step (:func:`step_flops`, ``train.py``'s ``model_tflops``) counts each causal
span (a row, or a packed row's document) on its own, with its layers' masks as
:class:`FlopShape` holds them: a causal layer ``N^2 / 2`` visible (query, key) pairs, a
sliding window of ``W`` tokens ``W N - W^2 / 2`` once ``N > W``, attention in chunks of
``C`` tokens ``C^2 / 2`` per whole chunk; ``12 * pairs * hq * d`` per layer.

:func:`device_peak_tflops`: a GPU's dense bf16/fp16 peak from its vendor's datasheet (the
figures without sparsity), found by the name ``torch.cuda.get_device_name`` reports.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["PEAK_TFLOPS", "FlopShape", "device_peak_tflops", "model_flops", "step_flops"]

# Dense bf16/fp16 tensor-core TFLOP/s per GPU, without sparsity (the datasheets print the
# 2:4-sparsity figure, twice these, beside them), first match of the device name wins:
# NVIDIA H100 datasheet (SXM 989, PCIe 756, NVL 835), H200 datasheet (SXM 989, NVL 835),
# GH200 datasheet (989), A100 datasheet (312, SXM and PCIe), HGX B200 datasheet (2,250 per
# GPU), L40S datasheet (362), L4 datasheet (121), AMD Instinct MI300X datasheet (1,307).
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bH100\b.*\bPCIe\b", 756.0),
    (r"\bH100\b.*\bNVL\b", 835.0),
    (r"\bH100\b", 989.0),
    (r"\bH200\b.*\bNVL\b", 835.0),
    (r"\bG?H200\b", 989.0),
    (r"\bA100\b", 312.0),
    (r"\bB200\b", 2250.0),
    (r"\bL40S\b", 362.0),
    (r"\bL4\b", 121.0),
    (r"\bMI300X\b", 1307.0),
)
HALF_DTYPES = ("bfloat16", "float16")  # what the table's figures are for


def model_flops(
    *,
    matmul_params: int,
    attention_layers: int,
    hq: int,
    head_dim: float,
    seq_len: int,
    batch: int = 1,
    sp: int = 1,
    causal: bool = True,
) -> float:
    """Model FLOPs of one forward and backward of ``batch`` sequences of ``seq_len``
    tokens, per rank of a sequence-parallel group of ``sp`` ranks (module docstring)."""
    if min(seq_len, batch, sp) < 1:
        raise ValueError(f"seq_len {seq_len}, batch {batch} and sp {sp} must be >= 1")
    tokens = batch * seq_len
    dense = 6 * matmul_params * tokens
    attention = (6 if causal else 12) * batch * seq_len**2 * hq * head_dim * attention_layers
    return (dense + attention) / sp


def device_peak_tflops(name: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of the GPU called ``name`` (``torch.cuda.get_device_name()``)
    for matmuls in ``dtype`` (``"bfloat16"``, ``"torch.float16"``...); None when the table
    has no figure: an unknown device, or float32 (its peak depends on TF32 and the table
    holds the half-precision figures only)."""
    if dtype.removeprefix("torch.") not in HALF_DTYPES:
        return None
    return next((t for pattern, t in PEAK_TFLOPS if re.search(pattern, name, re.I)), None)


@dataclass(frozen=True)
class FlopShape:
    """What a step's model FLOPs depend on (module docstring): ``matmul_params`` a token
    runs through (an MoE layer's routed experts as top-k of them), ``hq`` and ``head_dim``
    (the mean of q/k's and v's), and the attention layers: ``causal`` plainly causal ones,
    ``windows`` one sliding window (tokens) per windowed layer, ``chunks`` one chunk size
    per chunked layer."""

    matmul_params: float
    hq: int
    head_dim: float
    causal: int = 0
    windows: tuple[int, ...] = ()
    chunks: tuple[int, ...] = ()

    @property
    def attention_layers(self) -> int:
        return self.causal + len(self.windows) + len(self.chunks)


def _pairs(n: int, window: int = 0, chunk: int = 0) -> float:
    """Visible (query, key) pairs of a causal span of ``n`` tokens (module docstring)."""
    if window and n > window:
        return window * n - window**2 / 2
    if chunk:
        whole, rest = divmod(n, chunk)
        return whole * chunk**2 / 2 + rest**2 / 2
    return n**2 / 2


def step_flops(shape: FlopShape, spans: Iterable[int], *, sp: int = 1) -> float:
    """Model FLOPs of forward and backward over causal ``spans`` (the lengths of the rows,
    or of a packed row's documents: every token in one), per rank of ``sp``."""
    total = 0.0
    for n in spans:
        total += model_flops(
            matmul_params=0,
            attention_layers=shape.causal,
            hq=shape.hq,
            head_dim=shape.head_dim,
            seq_len=n,
            sp=sp,
        )
        total += 6 * shape.matmul_params * n / sp
        pairs = sum(_pairs(n, window=w) for w in shape.windows)
        pairs += sum(_pairs(n, chunk=c) for c in shape.chunks)
        total += 12 * pairs * shape.hq * shape.head_dim / sp
    return total
