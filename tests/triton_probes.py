"""Small Triton kernels that run one library helper on a tile, for tests of those helpers, and one
for the test suite's bounds check (imported inside the tests, so that the test modules load without
Triton)."""

import triton
import triton.language as tl

from fastkda.backends.triton.common import sigmoid, softplus
from fastkda.backends.triton.tiles import exclusive_cumsum, prod, round_tf32
from fastkda.backends.triton.chunk_gates import exact_cumsum


@triton.jit
def exclusive_cumsum_kernel(x, y, N: tl.constexpr, M: tl.constexpr):
    """y [N, M] = tiles.exclusive_cumsum of x [N, M] along the rows."""
    o = tl.arange(0, N)[:, None] * M + tl.arange(0, M)[None, :]
    tl.store(y + o, exclusive_cumsum(tl.load(x + o), 0))


@triton.jit
def exact_cumsum_kernel(x, G, E, C: tl.constexpr, BS: tl.constexpr):
    """G, E [C, BS] = chunk_gates.exact_cumsum of x [C, BS] (float32 sums and their rounding errors)."""
    o = tl.arange(0, C)[:, None] * BS + tl.arange(0, BS)[None, :]
    b_G, b_E = exact_cumsum(tl.load(x + o))
    tl.store(G + o, b_G)
    tl.store(E + o, b_E)


@triton.jit
def softplus_kernel(x, y, N: tl.constexpr, FAST: tl.constexpr):
    """y [N] = common.softplus(x [N], FAST)."""
    o = tl.arange(0, N)
    tl.store(y + o, softplus(tl.load(x + o), FAST))


@triton.jit
def sigmoid_kernel(x, y, N: tl.constexpr, FAST: tl.constexpr):
    """y [N] = common.sigmoid(x [N], FAST)."""
    o = tl.arange(0, N)
    tl.store(y + o, sigmoid(tl.load(x + o), FAST))


@triton.jit
def round_tf32_kernel(x, y, N: tl.constexpr):
    """y [N] = tiles.round_tf32(x [N])."""
    o = tl.arange(0, N)
    tl.store(y + o, round_tf32(tl.load(x + o)))


@triton.jit
def prod_kernel(a, b, c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, PREC: tl.constexpr):
    """c [M, N] = tiles.prod(a [M, K], b [K, N], PREC), float32 operands."""
    o_m, o_n, o_k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    b_a = tl.load(a + o_m[:, None] * K + o_k[None, :])
    b_b = tl.load(b + o_k[:, None] * N + o_n[None, :])
    tl.store(c + o_m[:, None] * N + o_n[None, :], prod(b_a, b_b, PREC))


@triton.jit
def masked_copy_kernel(x, y, n, EXTRA: tl.constexpr, ATOMIC: tl.constexpr):
    """y[:n + EXTRA] = x[:n + EXTRA] (or added atomically), 8 lanes: EXTRA past a length n reaches
    outside both (tests/test_bounds.py)."""
    o_i = tl.arange(0, 8)
    b_x = tl.load(x + o_i, mask=o_i < n + EXTRA, other=0.0)
    if ATOMIC:
        tl.atomic_add(y + o_i, b_x, mask=o_i < n + EXTRA)
    else:
        tl.store(y + o_i, b_x, mask=o_i < n + EXTRA)
