"""Backends behind one registry (see :mod:`fastkda.backends.registry`)."""

from .registry import Backend, BackendUnavailableError, backends, dispatch, get, register, select, use_backend
from ..platform import HAS_TRITON
from .torch_chunked import TorchBackend

register(TorchBackend())

if HAS_TRITON:
    from .triton import TritonBackend

    register(TritonBackend())

__all__ = ["Backend", "BackendUnavailableError", "backends", "dispatch", "explain", "get", "register", "select",
           "use_backend"]


def explain(fn, *args, **kwargs):
    """:func:`fastkda.explain`: the backend ``fn`` would run for these arguments, and why."""
    from ..api import explain as _explain  # the API module imports this package

    return _explain(fn, *args, **kwargs)
