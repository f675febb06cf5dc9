"""Context parallelism over torch.distributed."""

from .cp import CPContext

__all__ = ["CPContext"]
