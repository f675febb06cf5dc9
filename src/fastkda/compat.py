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


def _swap(table: dict[int, object]) -> int:
    """In every loaded module, replace each attribute whose value's id is a key of ``table`` by the
    value; the number of replacements."""
    count = 0
    for mod_name, module in list(sys.modules.items()):
        if mod_name == "fastkda" or mod_name.startswith("fastkda."):
            continue
        attrs = getattr(module, "__dict__", None)
        if not attrs:
            continue
        for name, value in list(attrs.items()):
            new = table.get(id(value))
            if new is not None and value is not new:
                setattr(module, name, new)
                count += 1
    return count


def route_fla_kda() -> int:
    """Make fla's KDA entry points fastkda's, in fla's modules and in every loaded module that
    imported them; returns the number of names replaced. Raises ModuleNotFoundError when fla is
    not installed. Calling it again is harmless."""
    with _lock:
        for mod_name, names in _FLA_MODULES.items():
            module = importlib.import_module(mod_name)
            for name in names:
                current = getattr(module, name, None)
                if current is None:
                    raise AttributeError(f"{mod_name} has no `{name}`: an fla release this routing does not know")
                if current is not _OURS[name]:
                    _originals.setdefault(name, current)
        return _swap({id(fla_fn): _OURS[name] for name, fla_fn in _originals.items()})


def unroute_fla_kda() -> int:
    """Undo route_fla_kda: fla's functions back wherever fastkda's were put; the number restored."""
    with _lock:
        if not _originals:
            return 0
        restored = _swap({id(_OURS[name]): fla_fn for name, fla_fn in _originals.items()})
        _originals.clear()
        return restored


def routed() -> bool:
    """Whether fla's KDA entry points are routed to fastkda's now."""
    return bool(_originals)
