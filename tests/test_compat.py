"""fastkda.compat: fla's KDA entry points routed to fastkda's and back. The CPU tier uses a
stand-in fla package; with fla-core installed (GPU tier) the real one."""

import importlib.util
import sys
import types

import pytest

import fastkda
from fastkda import compat

HAS_FLA = importlib.util.find_spec("fla") is not None


@pytest.fixture
def fake_fla(monkeypatch):
    """A stand-in for fla's module layout, plus a model module that imported from it."""
    if HAS_FLA:
        pytest.skip("fla is installed: test_route_real_fla covers it")
    fns = {n: types.FunctionType((lambda: None).__code__, {}, n) for n in compat._OURS}
    mods = {}
    for name in ("fla", "fla.ops", "fla.ops.kda", "fla.ops.kda.chunk", "fla.ops.kda.fused_recurrent", "fla.ops.kda.gate",
                 "user_model"):
        mods[name] = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mods[name])
    mods["fla.ops.kda.chunk"].chunk_kda = fns["chunk_kda"]
    mods["fla.ops.kda.fused_recurrent"].fused_recurrent_kda = fns["fused_recurrent_kda"]
    mods["fla.ops.kda.gate"].fused_kda_gate = fns["fused_kda_gate"]
    mods["fla.ops.kda.gate"].kda_gate_chunk_cumsum = fns["kda_gate_chunk_cumsum"]
    mods["fla.ops.kda"].chunk_kda = fns["chunk_kda"]
    mods["fla.ops.kda"].fused_recurrent_kda = fns["fused_recurrent_kda"]
    mods["user_model"].chunk_kda = fns["chunk_kda"]  # `from fla.ops.kda import chunk_kda` in a model
    mods["user_model"].helper = len  # untouched
    mods["user_code"] = types.ModuleType("user_code")  # imported fastkda itself: never touched
    mods["user_code"].chunk_kda = fastkda.chunk_kda
    monkeypatch.setitem(sys.modules, "user_code", mods["user_code"])
    yield mods, fns
    compat.unroute_fla_kda()


def test_route_and_unroute(fake_fla):
    mods, fns = fake_fla
    assert compat.route_fla_kda() == 7
    assert compat.routed()
    assert mods["fla.ops.kda"].chunk_kda is fastkda.chunk_kda
    assert mods["fla.ops.kda.fused_recurrent"].fused_recurrent_kda is fastkda.fused_recurrent_kda
    assert mods["fla.ops.kda.gate"].fused_kda_gate is fastkda.fused_kda_gate
    assert mods["user_model"].chunk_kda is fastkda.chunk_kda and mods["user_model"].helper is len
    assert compat.route_fla_kda() == 0  # again: nothing left to replace
    mine = object()
    mods["fla.ops.kda.gate"].fused_kda_gate = mine  # set by the user since: unrouting leaves it
    assert compat.unroute_fla_kda() == 6
    assert mods["fla.ops.kda.gate"].fused_kda_gate is mine
    assert mods["user_model"].chunk_kda is fns["chunk_kda"] and not compat.routed()
    assert fastkda.chunk_kda is compat._OURS["chunk_kda"]  # fastkda's own names never change
    assert mods["user_code"].chunk_kda is fastkda.chunk_kda


def test_route_without_fla(monkeypatch):
    if HAS_FLA:
        pytest.skip("fla is installed")
    with pytest.raises(ModuleNotFoundError):
        compat.route_fla_kda()


@pytest.mark.skipif(not HAS_FLA, reason="fla is not installed")
def test_route_real_fla():
    import fla.ops.kda as fla_kda

    original = fla_kda.chunk_kda
    try:
        assert compat.route_fla_kda() >= 4
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        assert chunk_kda is fastkda.chunk_kda and fused_recurrent_kda is fastkda.fused_recurrent_kda
    finally:
        compat.unroute_fla_kda()
    assert fla_kda.chunk_kda is original
