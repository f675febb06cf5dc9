"""The dtypes the operators take and the dtype of the states they keep."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the states (initial, final, carried) for inputs of ``dtype``: float32, or
    float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32
