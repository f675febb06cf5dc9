"""Backends behind one registry (see :mod:`fastkda.backends.registry`)."""

from .registry import (Backend, BackendUnavailableError, backends, dispatch, explain, get, register, select,
                       use_backend)
from ..platform import HAS_TRITON
from .torch_chunked import TorchBackend

register(TorchBackend())

if HAS_TRITON:
    from .triton import TritonBackend

    register(TritonBackend())

__all__ = ["Backend", "BackendUnavailableError", "backends", "dispatch", "explain", "get", "register", "select",
           "use_backend"]

