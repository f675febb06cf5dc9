"""Small Triton kernels that run one library helper on a tile, for tests of those helpers (imported
inside the tests, so that the test modules load without Triton)."""

import triton
import triton.language as tl

from fastkda.backends.triton.common import softplus
from fastkda.backends.triton.tiles import exclusive_cumsum
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
