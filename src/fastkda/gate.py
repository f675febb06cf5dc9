"""Public gate helpers (docs/math.md section 4): torch references and the fused activations."""

from __future__ import annotations

import torch

from .backends import registry
from .naive import naive_kda_gate, naive_kda_lowerbound_gate
from .options import gate_options

__all__ = ["naive_kda_gate", "naive_kda_lowerbound_gate", "fused_kda_gate", "kda_gate_chunk_cumsum"]


def fused_kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The activated log-space gate of ``g [..., H, K]``, differentiable in g, A_log and dt_bias.

    ``-exp(A_log) * softplus(g + dt_bias)``; with ``lower_bound``,
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (``A_log`` may then be None).
    """
    opts, _ = gate_options(g, A_log, dt_bias, lower_bound, output_dtype)
    return registry.dispatch("kda_gate", opts, (g, A_log, dt_bias))


def kda_gate_chunk_cumsum(
    g: torch.Tensor,
    A_log: torch.Tensor | None,
    chunk_size: int,
    scale: float | None = None,
    dt_bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_dtype: torch.dtype = torch.float32,
    chunk_indices: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """Gate activation and the cumulative sum within every chunk of ``chunk_size`` tokens, in one pass.

    ``g``: ``[B, T, H, K]`` raw gate input (varlen: B = 1 with ``cu_seqlens``; chunks restart at
    every sequence start). ``scale`` multiplies the result (e.g. ``1/ln 2`` for base-2 exponents).
    ``chunk_indices`` is accepted for compatibility and not needed.
    """
    del chunk_indices  # derived from cu_seqlens where a backend needs it
    opts, cu_host = gate_options(
        g, A_log, dt_bias, lower_bound, output_dtype, chunk_size=chunk_size, scale=scale, cu_seqlens=cu_seqlens,
        need_time_axis=True,
    )
    return registry.dispatch("kda_gate_chunk_cumsum", opts, (g, A_log, dt_bias, cu_seqlens, cu_host))
