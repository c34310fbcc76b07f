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
"""

from __future__ import annotations

__all__ = ["model_flops"]


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
