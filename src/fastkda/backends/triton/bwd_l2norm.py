"""Backward of the l2 norm of q and k (and the sum over the value heads of a group)."""

from __future__ import annotations

import triton
import triton.language as tl

from ...alloc import new_empty
from .common import launch
from .plan import cdiv, pow2


@triton.jit
def kda_bwd_qk_kernel(x, dxh, dx, rows, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                      BR: tl.constexpr, L2NORM: tl.constexpr):
    """dx [rows, H, K] = the l2norm backward of the sum of dxh [rows, H * G, K] over the G value heads
    of each group: with y = x / |x|, dx = (dy - y (y . dy)) / |x|."""
    i_r, i_h = tl.program_id(0), tl.program_id(1)
    o_r = (i_r * BR + tl.arange(0, BR)).to(tl.int64)
    o_k = tl.arange(0, BK)
    m = (o_r < rows)[:, None] & (o_k < K)[None, :]
    b_dy = tl.zeros([BR, BK], tl.float32)
    for j in range(G):
        b_dy += tl.load(dxh + o_r[:, None] * (H * G * K) + (i_h * G + j) * K + o_k[None, :], mask=m, other=0.0)
    o_p = o_r[:, None] * (H * K) + i_h * K + o_k[None, :]
    if L2NORM:
        b_x = tl.load(x + o_p, mask=m, other=0.0).to(tl.float32)
        b_r = tl.rsqrt(tl.sum(b_x * b_x, 1) + 1e-6)
        b_y = b_x * b_r[:, None]
        b_dy = (b_dy - b_y * tl.sum(b_y * b_dy, 1)[:, None]) * b_r[:, None]
    tl.store(dx + o_p, b_dy.to(dx.dtype.element_ty), mask=m)


def bwd_qk(x, dxh, l2norm: bool, rows_per_program: int, launch_opts):
    """dq (or dk) [B, T, H, K] in x's dtype from the per-value-head dxh [B, T, HV, K] (float32);
    ``launch_opts``: the plan's Launch."""
    B, T, H, K = x.shape
    HV = dxh.shape[2]
    dx = new_empty(B, T, H, K, dtype=x.dtype, device=x.device)
    rows = B * T
    if rows:
        launch(kda_bwd_qk_kernel, (cdiv(rows, rows_per_program), H), x, dxh, dx, rows, H=H, G=HV // H, K=K,
               BK=pow2(K, 1), BR=rows_per_program, L2NORM=l2norm, **launch_opts.kwargs())
    return dx
