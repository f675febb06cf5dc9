"""Route fla's KDA operators to fastkda's for the whole process: one line in a model that imports
``fla.ops.kda``.

    import fastkda.compat
    fastkda.compat.route_fla_kda()      # before or after fla is imported

Every name of fla's KDA entry points (``chunk_kda``, ``fused_recurrent_kda``, ``fused_kda_gate``,
``kda_gate_chunk_cumsum``) that fla's modules hold, in ``fla.ops.kda`` and wherever it was imported
from there (fla's layers, a model's modules), is replaced by fastkda's; ``unroute_fla_kda`` puts
fla's back. fla's own kernels and references stay as they are.
"""

from __future__ import annotations

import importlib
import sys
import threading

from . import api, gate

# fla module -> names of fastkda's replacements that it defines
_FLA_MODULES = {
    "fla.ops.kda": ("chunk_kda", "fused_recurrent_kda"),
    "fla.ops.kda.chunk": ("chunk_kda",),
    "fla.ops.kda.fused_recurrent": ("fused_recurrent_kda",),
    "fla.ops.kda.gate": ("fused_kda_gate", "kda_gate_chunk_cumsum"),
}
_OURS = {
    "chunk_kda": api.chunk_kda,
    "fused_recurrent_kda": api.fused_recurrent_kda,
    "fused_kda_gate": gate.fused_kda_gate,
    "kda_gate_chunk_cumsum": gate.kda_gate_chunk_cumsum,
}
_lock = threading.Lock()
_originals: dict[str, object] = {}  # name -> fla's function, while routed
_replaced: list[tuple[object, str, object, object]] = []  # (module, attribute, fla's value, fastkda's) replaced


def _route_modules() -> int:
    """Replace, in every loaded module but fastkda's, each attribute that holds one of fla's
    functions in _originals by fastkda's; remember each place; the number replaced."""
    by_id = {id(fla_fn): _OURS[name] for name, fla_fn in _originals.items()}
    count = 0
    for mod_name, module in list(sys.modules.items()):
        if mod_name == "fastkda" or mod_name.startswith("fastkda."):
            continue
        attrs = getattr(module, "__dict__", None)
        if not attrs:
            continue
        for attr, value in list(attrs.items()):
            new = by_id.get(id(value))
            if new is not None and value is not new:
                setattr(module, attr, new)
                _replaced.append((module, attr, value, new))
                count += 1
    return count


def route_fla_kda() -> int:
    """Make fla's KDA entry points fastkda's, in fla's modules and in every loaded module that
    imported them; returns the number of names replaced. Raises ModuleNotFoundError when fla is
    not installed. Calling it again routes what was imported since (modules loaded later that
    import from fla.ops.kda get fastkda's functions already)."""
    with _lock:
        for mod_name, names in _FLA_MODULES.items():
            module = importlib.import_module(mod_name)
            for name in names:
                current = getattr(module, name, None)
                if current is None:
                    raise AttributeError(f"{mod_name} has no `{name}`: an fla release this routing does not know")
                if current is not _OURS[name]:
                    _originals.setdefault(name, current)
        return _route_modules()


def unroute_fla_kda() -> int:
    """Undo route_fla_kda: fla's functions back in exactly the places routing replaced (where they
    still hold fastkda's); the number restored."""
    with _lock:
        restored = 0
        for module, attr, fla_fn, ours in reversed(_replaced):
            if getattr(module, attr, None) is ours:
                setattr(module, attr, fla_fn)
                restored += 1
        _replaced.clear()
        _originals.clear()
        return restored


def routed() -> bool:
    """Whether fla's KDA entry points are routed to fastkda's now."""
    return bool(_originals)
