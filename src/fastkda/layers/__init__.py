"""Model layers built on the operators."""

from .kda import GatedRMSNorm, KDACache, KimiDeltaAttention, ShortConvolution

__all__ = ["KimiDeltaAttention", "KDACache", "ShortConvolution", "GatedRMSNorm"]
