"""Backend registry: each call goes to the first backend, by priority, whose verifier accepts it.

A verifier returns ``(ok, reason)``; every reason is logged at debug level (logger
``fastkda.backends``). Environment:

- ``FASTKDA_BACKEND=<name>`` forces one backend; a call it cannot serve raises
  :class:`BackendUnavailableError` with the verifier's reason (never a silent fallback).
- ``FASTKDA_DISABLE_BACKENDS=<name>[,<name>...]`` forbids backends.

:func:`use_backend` does the same as ``FASTKDA_BACKEND`` for a ``with`` block (thread-local).
:func:`explain` names the backend a call of a public operator would run, and why.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
from typing import Any, Iterator

import torch

from ..options import autocast_qkv, chunk_options, foreign_keywords, recurrent_options, state_layout

log = logging.getLogger("fastkda.backends")


class BackendUnavailableError(RuntimeError):
    """The forced backend cannot serve this call, or no backend can."""


class Backend:
    """Base of every backend: a name, a priority (higher is tried first) and one method per op."""

    name: str = "?"
    priority: int = 0
    ops: tuple[str, ...] = ()
    differentiable: tuple[str, ...] = ()  # ops whose backward this backend implements

    def verify(self, op: str, opts: Any, inputs: Any) -> tuple[bool, str]:
        """``(ok, reason)``: can this backend run ``op`` with these options and tensors?"""
        raise NotImplementedError

    def run(self, op: str, opts: Any, inputs: Any):
        return getattr(self, op)(opts, inputs)

    def describe_plan(self, op: str, opts: Any, inputs: Any) -> str | None:
        """What this backend would launch for the call, as text (None: nothing to say)."""
        return None

    def take_decode_error(self, device: torch.device) -> str | None:
        """The pool-index error this backend kept for a decode call on ``device`` (a resolved
        torch.device) that did not raise, cleared as it is read; None: none (a backend that raises
        at once keeps none)."""
        return None


class Explanation(tuple):
    """``(backend, reasons)``: the backend a call would run and the ``(backend, reason)`` of every
    backend considered; ``plan``: that backend's plan of the call as text (None if it has none).
    ``str()`` gives all three."""

    def __new__(cls, backend: str, reasons: list, plan: str | None):
        self = super().__new__(cls, (backend, reasons))
        self.plan = plan
        return self

    @property
    def backend(self) -> str:
        return self[0]

    @property
    def reasons(self) -> list:
        return self[1]

    def __str__(self) -> str:
        lines = [f"backend: {self.backend}", *(f"  {name}: {why}" for name, why in self.reasons)]
        return "\n".join(lines + ([self.plan] if self.plan else []))


_BACKENDS: dict[str, Backend] = {}
_local = threading.local()


def register(backend: Backend) -> Backend:
    _BACKENDS[backend.name] = backend
    return backend


def unregister(name: str) -> Backend:
    """Remove the backend ``name`` (a KeyError if none is registered) and return it."""
    return _BACKENDS.pop(name)


def backends() -> list[Backend]:
    """Registered backends, highest priority first."""
    return sorted(_BACKENDS.values(), key=lambda b: -b.priority)


def get(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise BackendUnavailableError(f"unknown fastkda backend {name!r}; registered: {sorted(_BACKENDS)}") from None


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force ``name`` (or lift a forcing with None) inside the block, for this thread."""
    if name is not None:
        get(name)
    prev = getattr(_local, "forced", "unset")
    _local.forced = name
    try:
        yield
    finally:
        if prev == "unset":
            del _local.forced
        else:
            _local.forced = prev


def forced_backend() -> str | None:
    forced = getattr(_local, "forced", "unset")
    if forced != "unset":
        return forced
    return os.environ.get("FASTKDA_BACKEND") or None


def _disabled() -> set[str]:
    names = os.environ.get("FASTKDA_DISABLE_BACKENDS")
    return {s.strip() for s in names.split(",") if s.strip()} if names else set()


def needs_grad(inputs: Any) -> bool:
    """Whether a call with these input tensors (an iterable; other items are ignored) builds a graph."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


def _check(backend: Backend, op: str, opts: Any, inputs: Any, grad: bool) -> tuple[bool, str]:
    if op not in backend.ops:
        return False, f"does not implement {op}"
    if grad and op not in backend.differentiable:
        return False, f"has no backward for {op}, and the call needs gradients"
    return backend.verify(op, opts, inputs)


def select(op: str, opts: Any, inputs: Any) -> tuple[Backend, list[tuple[str, str]]]:
    """The backend for this call and the (name, reason) of every backend considered: the first by
    priority that implements ``op`` (with its backward, when an input requires grad) and whose
    verifier accepts the call."""
    forced = forced_backend()
    reasons: list[tuple[str, str]] = []
    grad = needs_grad(inputs)
    if forced is not None:
        backend = get(forced)
        ok, reason = _check(backend, op, opts, inputs, grad)
        log.debug("%s: forced backend %s: ok=%s (%s)", op, forced, ok, reason)
        if not ok:
            raise BackendUnavailableError(f"FASTKDA_BACKEND={forced} cannot run {op}: {reason}")
        return backend, [(forced, reason)]
    disabled = _disabled()
    for backend in backends():
        if backend.name in disabled:
            reasons.append((backend.name, "disabled by FASTKDA_DISABLE_BACKENDS"))
            continue
        ok, reason = _check(backend, op, opts, inputs, grad)
        reasons.append((backend.name, reason))
        log.debug("%s: backend %s: ok=%s (%s)", op, backend.name, ok, reason)
        if ok:
            return backend, reasons
    detail = "; ".join(f"{n}: {r}" for n, r in reasons)
    raise BackendUnavailableError(f"no fastkda backend can run {op}: {detail}")


def dispatch(op: str, opts: Any, inputs: Any):
    backend, _ = select(op, opts, inputs)
    return backend.run(op, opts, inputs)


_BUILDERS = {"chunk_kda": chunk_options, "fused_recurrent_kda": recurrent_options}  # arguments -> (options, inputs)
_OPERATORS: dict = {}  # public operator function -> its op (fastkda.api registers chunk_kda and fused_recurrent_kda)


def register_operator(fn, op: str) -> None:
    """Make ``fn``, the public function of ``op`` (a key of ``_BUILDERS``), known to :func:`explain`."""
    if op not in _BUILDERS:
        raise ValueError(f"`op` must be one of {sorted(_BUILDERS)}, got {op!r}")
    _OPERATORS[fn] = op


def explain(fn, *args, **kwargs) -> Explanation:
    """Which backend ``fn`` (:func:`fastkda.chunk_kda` or :func:`fastkda.fused_recurrent_kda`) would
    run for these arguments, the ``(backend, reason)`` of every backend considered, and (``.plan``)
    what that backend would launch. Validates like the call; launches nothing."""
    if fn not in _OPERATORS:
        raise TypeError(f"`fn` must be fastkda.chunk_kda or fastkda.fused_recurrent_kda, got {fn!r}")
    op = _OPERATORS[fn]
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    call = dict(bound.arguments)
    extra = call.pop("kwargs", None)
    if extra:
        foreign_keywords(op, extra)
    call["state_v_first"] = state_layout(call["state_v_first"], call.pop("transpose_state_layout"))
    tensors = [call.pop(n) for n in ("q", "k", "v", "g", "beta")]
    q, k, v, _ = autocast_qkv(*tensors[:3])
    opts, inputs = _BUILDERS[op](q, k, v, *tensors[3:], **call)
    backend, reasons = select(op, opts, inputs)
    return Explanation(backend.name, reasons, backend.describe_plan(op, opts, inputs))
