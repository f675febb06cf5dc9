"""Assertions shared by the tests."""

import math

import torch

from fastkda.testing import AXES, grow, rel_rms, tolerance  # noqa: F401


def check(name: str, actual, ref, tol: float):
    assert actual is not None, f"{name}: missing"
    err = rel_rms(actual, ref)
    assert err <= tol, f"{name}: relative RMS error {err:.3g} > {tol:.3g}"
    return err


def tol_for(dtype: torch.dtype, backend: str = "torch") -> float:
    return tolerance(dtype, backend)


def finite(t):
    return t is not None and bool(torch.isfinite(t).all())


__all__ = ["check", "tol_for", "finite", "math"]
