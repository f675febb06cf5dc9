"""fastkda: Kimi Delta Attention for PyTorch."""

from .api import chunk_kda, decode_error, explain, fused_recurrent_kda
from .backends import BackendUnavailableError, use_backend
from .gate import fused_kda_gate, kda_gate_chunk_cumsum, naive_kda_gate, naive_kda_lowerbound_gate
from .naive import naive_chunk_kda, naive_recurrent_kda

__version__ = "0.1.0"

__all__ = [
    "chunk_kda",
    "fused_recurrent_kda",
    "explain",
    "decode_error",
    "fused_kda_gate",
    "kda_gate_chunk_cumsum",
    "naive_kda_gate",
    "naive_kda_lowerbound_gate",
    "naive_chunk_kda",
    "naive_recurrent_kda",
    "use_backend",
    "BackendUnavailableError",
]
