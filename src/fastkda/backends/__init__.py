"""Backends behind one registry (see :mod:`fastkda.backends.registry`)."""

from .registry import Backend, BackendUnavailableError, backends, dispatch, get, register, select, use_backend
from .torch_chunked import TorchBackend

register(TorchBackend())

__all__ = ["Backend", "BackendUnavailableError", "backends", "dispatch", "get", "register", "select", "use_backend"]
