"""Tile helpers shared by the chunk kernels (Triton JIT functions, plain ``tl``: they run in the
interpreter too). Tiles are [rows, BS] blocks of a [B, T, heads, D] tensor at one head; gates are
base-2 log decays (float32). Names: ``cum_gates`` the cumulative gates stored by the gates kernel
(block-local on the block path, from the chunk start on the whole-chunk path), ``gates_after`` the
gates after a token within its 16-token block, the pair levels of docs/math.md section 3."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_lower(x, o_c, C: tl.constexpr):
    """A chunk's [C, C] scratch of 16 x 16 blocks (in its own dtype), the blocks on and below the
    diagonal (the ones above are never written) and zeros above."""
    return tl.load(x + o_c[:, None] * C + o_c[None, :], mask=(o_c[:, None] // 16) >= (o_c[None, :] // 16), other=0.0)


@triton.jit
def as_operand(x, DT: tl.constexpr, EMU: tl.constexpr):
    """x as a matrix-product operand of dtype DT. The interpreter's bfloat16 products are wrong
    (they multiply raw bits), so with EMU the rounding to DT is kept and the product is float32."""
    if EMU:
        return x.to(DT).to(tl.float32)
    return x.to(DT)


@triton.jit
def _exclusive_combine(a1, b1, a2, b2):
    # (sum of a segment without its last element, its last element) of two adjacent segments
    return a1 + b1 + a2, b2


@triton.jit
def exclusive_cumsum(x, axis: tl.constexpr):
    """sum_{s < t} x_s along ``axis``: a scan that adds every term once, in order (never an inclusive
    sum minus the term itself, which loses a small prefix next to a large term)."""
    b_s, _ = tl.associative_scan((tl.zeros_like(x), x), axis, _exclusive_combine)
    return b_s


@triton.jit
def row_of(x, o_r, r):
    """Row r of a [R, C] tile, as a [C] vector."""
    return tl.sum(tl.where(o_r[:, None] == r, x, 0.0), 0)


@triton.jit
def tile_ptr(x, row0, i_head, NH: tl.constexpr, D: tl.constexpr, o_i, o_d):
    """Pointers to rows row0 + o_i of x [.., NH, D] at head i_head, columns o_d: the first row's
    offset in int64, the tile's own offsets from it in int32 (o_i are rows within a chunk)."""
    return x + (row0.to(tl.int64) * NH + i_head) * D + (o_i[:, None] * (NH * D) + o_d[None, :])


@triton.jit
def load_tile(x, bos, t0, T_seq, i_head, NH: tl.constexpr, D: tl.constexpr, o_i, o_d):
    """Rows t0 + o_i of x [.., NH, D] at head i_head, columns o_d, as float32 (0 outside)."""
    m = ((t0 + o_i) < T_seq)[:, None] & (o_d < D)[None, :]
    return tl.load(tile_ptr(x, bos + t0, i_head, NH, D, o_i, o_d), mask=m, other=0.0).to(tl.float32)


@triton.jit
def store_tile(x, b_x, bos, t0, T_seq, i_head, NH: tl.constexpr, D: tl.constexpr, o_i, o_d):
    """Store a tile at rows t0 + o_i of x [.., NH, D] (rows past the sequence end skipped)."""
    m = ((t0 + o_i) < T_seq)[:, None] & (o_d < D)[None, :]
    tl.store(tile_ptr(x, bos + t0, i_head, NH, D, o_i, o_d), b_x.to(x.dtype.element_ty), mask=m)


@triton.jit
def cum_gates(gc, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_i, o_d):
    """Cumulative gates stored in gc at rows t0 + o_i (block-local in the block path, from the chunk
    start in the whole-chunk path): a padding row repeats the last token's (its gate is 0); all 0
    when t0 is past the end (a block of padding only)."""
    o_t = tl.minimum(o_i, T_seq - 1 - t0)  # rows from t0
    b_c = tl.load(tile_ptr(gc, bos + t0, i_hv, HV, K, o_t, o_d), mask=(o_d < K)[None, :], other=0.0)
    return tl.where(t0 < T_seq, b_c, 0.0)


@triton.jit
def cum_gates_last(gc, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr, o_d):
    """The cumulative gates from the chunk start (whole-chunk path) at the chunk's last token  [BS]."""
    o_last = (bos + tl.minimum(t0 + C - 1, T_seq - 1)) * (HV * K) + i_hv * K
    return tl.load(gc + o_last + o_d, mask=o_d < K, other=0.0)


@triton.jit
def gates_after(ga, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_i, o_d):
    """Sum of the gates after each token of rows t0 + o_i, up to the end of its 16-token block: a
    reverse cumulative sum of the next rows within each block (never a difference of two sums,
    which loses precision for large gates)   [rows, BS]."""
    R: tl.constexpr = o_i.shape[0]
    BS: tl.constexpr = o_d.shape[0]
    m = ((o_i % 16 < 15) & (t0 + 1 + o_i < T_seq))[:, None] & (o_d < K)[None, :]
    b_g = tl.load(tile_ptr(ga, bos + t0 + 1, i_hv, HV, K, o_i, o_d), mask=m, other=0.0)
    if R == 16:
        return tl.cumsum(b_g, 0, reverse=True)
    return tl.reshape(tl.cumsum(tl.reshape(b_g, [R // 16, 16, BS]), 1, reverse=True), [R, BS])


@triton.jit
def block_sum(gc, bos, tb, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_d):
    """Sum of the gates of the block starting at token tb, columns o_d."""
    o_t = tl.minimum(tb + 15, T_seq - 1)
    return tl.load(gc + (bos + o_t) * (HV * K) + i_hv * K + o_d, mask=(o_d < K) & (tb < T_seq), other=0.0)


@triton.jit
def block_sums(gc, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_d, LO, HI):
    """Sum of the gates of blocks LO..HI-1 of the chunk starting at t0 (a pure sum of block sums)."""
    b_s = tl.zeros_like(o_d.to(tl.float32))
    for b in range(LO, HI):
        b_s += block_sum(gc, bos, t0 + 16 * b, T_seq, i_hv, HV, K, o_d)
    return b_s


@triton.jit
def rnorm(b_ss, L2NORM: tl.constexpr):
    """1 / sqrt(b_ss + 1e-6) for squared row norms b_ss (ones without l2norm)."""
    if L2NORM:
        b_r = tl.rsqrt(b_ss + 1e-6)
    else:
        b_r = tl.full(b_ss.shape, 1.0, tl.float32)
    return b_r


@triton.jit
def load_beta_raw(beta, bos, t0, T_seq, i_hv, o_i, HV: tl.constexpr):
    """beta of rows t0 + o_i as stored (0 past the sequence): a load whose first use can wait
    (the scan loads the next chunk's a step ahead and activates it there, with ``activate_beta``)."""
    o_t = t0 + o_i
    return tl.load(beta + (bos + o_t).to(tl.int64) * HV + i_hv, mask=o_t < T_seq, other=0.0)


@triton.jit
def activate_beta(b_raw, t0, T_seq, o_i, SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr):
    """beta of rows t0 + o_i from its stored values, float32 (sigmoid(.) * BETA_SCALE with SIGMOID),
    0 past the sequence."""
    b_b = b_raw.to(tl.float32)
    if SIGMOID:
        b_b = tl.sigmoid(b_b) * BETA_SCALE
    return tl.where(t0 + o_i < T_seq, b_b, 0.0)


@triton.jit
def load_beta(beta, bos, t0, T_seq, i_hv, o_i, HV: tl.constexpr, SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr):
    return activate_beta(load_beta_raw(beta, bos, t0, T_seq, i_hv, o_i, HV), t0, T_seq, o_i, SIGMOID, BETA_SCALE)


@triton.jit
def load_block(x, row, col, C: tl.constexpr, o_i):
    """The [16, 16] block at rows row.., columns col.. of this program's [C, C] scratch, as float32."""
    return tl.load(x + (row + o_i)[:, None] * C + col + o_i[None, :]).to(tl.float32)


@triton.jit
def store_block(x, b_x, row, col, C: tl.constexpr, o_i):
    tl.store(x + (row + o_i)[:, None] * C + col + o_i[None, :], b_x.to(x.dtype.element_ty))


@triton.jit
def inv_unit_lower(b_L, o_i, PREC: tl.constexpr):
    """(I + L)^-1 for a strictly lower triangular 16x16 L: L^16 = 0, so with N = -L it is
    (I + N)(I + N^2)(I + N^4)(I + N^8); six small products (at prod's PREC) instead of a serial
    substitution."""
    b_N = -b_L
    b_X = b_N + tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    for _ in tl.static_range(3):
        b_N = prod(b_N, b_N, PREC)
        b_X += prod(b_X, b_N, PREC)
    return b_X


@triton.jit
def round_tf32(x):
    """float32 x rounded to the nearest tf32 (10 mantissa bits, ties away from zero); infinities and
    NaNs (exponent bits all ones) pass unchanged: a carry would turn a NaN into a number."""
    b = x.to(tl.uint32, bitcast=True)
    r = ((b + 0x1000) >> 13) << 13
    return tl.where((b & 0x7F800000) == 0x7F800000, b, r).to(tl.float32, bitcast=True)


@triton.jit
def prod(a, b, PREC: tl.constexpr):
    """a @ b in float32. PREC: Triton's input precisions ("ieee", "tf32", "tf32x3"; with 16-bit
    operands only their own dtype matters); "tf32_rn": tf32 from float32 operands rounded to nearest
    first (the tensor cores read a float32 operand with its low 13 bits dropped, a truncation whose
    one-signed errors add up along a product: as large as float16's own rounding, docs/kernels.md);
    "bf16": rounded to bfloat16 (operands already bfloat16, like the w/u kernel's bfloat16 X, stay as
    they are); "bf16_emulated" for the interpreter, whose bfloat16 products are wrong
    (tiles.as_operand): operands cut to bfloat16 (its conversion truncates; the GPU rounds to
    nearest), float32 products."""
    if PREC == "bf16":  # one return: the compiler visits code after a constexpr-if's return
        c = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16_emulated":
        c = tl.dot(as_operand(a, tl.bfloat16, True), as_operand(b, tl.bfloat16, True), input_precision="ieee")
    elif PREC == "tf32_rn":
        c = tl.dot(_tf32_operand(a), _tf32_operand(b), input_precision="tf32")
    else:
        c = tl.dot(a, b, input_precision=PREC)
    return c


@triton.jit
def _tf32_operand(x):
    """A tf32 product's operand: float32 rounded to nearest, 16-bit dtypes (exact in tf32) as they are."""
    if x.dtype == tl.float32:
        y = round_tf32(x)
    else:
        y = x
    return y


@triton.jit
def half_pairs(i, j, S: tl.constexpr):
    """Mask of the pairs (i, j) with i in the second half and j in the first half of the same
    S-token segment."""
    return ((i // S) == (j // S)) & (i % S >= S // 2) & (j % S < S // 2)


@triton.jit
def split_level(b_g, b_gn, o_i, H: tl.constexpr):
    """Level H of a 16-token block's pairs for any gate (docs/math.md section 3): rows in the second
    half of a 2H-token segment against columns in its first half, anchored at the first half's last
    token a. Returns (the level's mask [16, 16], row factors e^(gates a+1..i), column factors
    e^(gates j+1..a), [16, BS]); b_g holds the block's activated gates, b_gn the next token's.
    Every exponent is a segment-local sum of the gates it spans, never a difference of two sums,
    and is <= 0 on every row (the rows and columns outside the level are discarded)."""
    BS: tl.constexpr = b_g.shape[1]
    m = half_pairs(o_i[:, None], o_i[None, :], 2 * H)
    if H == 1:  # row 2m+1 against column 2m: e^(g_i) and 1
        return m, tl.exp2(b_g), tl.full([16, BS], 1.0, tl.float32)
    b_f = tl.reshape(tl.cumsum(tl.reshape(b_g, [16 // H, H, BS]), 1), [16, BS])  # gates from the segment start
    b_n = tl.where((o_i % H < H - 1)[:, None], b_gn, 0.0)  # the gates after each token, within its H-segment
    b_b = tl.reshape(tl.cumsum(tl.reshape(b_n, [16 // H, H, BS]), 1, reverse=True), [16, BS])
    return m, tl.exp2(b_f), tl.exp2(b_b)


@triton.jit
def level_products(b_q, b_k, b_g, b_gn, o_i, PREC: tl.constexpr):
    """(Aqk, Akk) [16, 16] of a 16-token block for any gate, unscaled, lower entries only (Akk's
    diagonal left 0): the four half-segment levels (split_level) of its feature columns b_q, b_k
    [16, BS], with the gates b_g and the next tokens' b_gn, plus the diagonal of Aqk (factor 1)."""
    b_Aqk = tl.where(o_i[:, None] == o_i[None, :], tl.sum(b_q * b_k, 1)[:, None], 0.0)
    b_Akk = tl.zeros([16, 16], tl.float32)
    for lvl in tl.static_range(4):
        m_l, b_r, b_f = split_level(b_g, b_gn, o_i, 8 >> lvl)
        b_c = tl.trans(b_k * b_f)
        b_Aqk += tl.where(m_l, prod(b_q * b_r, b_c, PREC), 0.0)
        b_Akk += tl.where(m_l, prod(b_k * b_r, b_c, PREC), 0.0)
    return b_Aqk, b_Akk


@triton.jit
def block_pairs(i, j, strict, S: tl.constexpr):
    """Mask of the pairs (i, j) of the same S-token segment with j <= i - strict (S = 16: the middle
    anchor's level, intra's _middle_anchor and _chained_level; S = 8: the clamped anchor's within the
    diagonal blocks' halves); block_pairs(j, i, ..) is its transpose."""
    return ((i // S) == (j // S)) & (j <= i - strict)


@triton.jit
def cum_gates_lo(gd, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_i, o_d, EXACT_SUMS: tl.constexpr):
    """With EXACT_SUMS, the rounding errors of the stored cumulative gates (gd, float16) at rows t0 + o_i, as
    cum_gates: the exact sums are gc + gd. Without it, zeros."""
    if EXACT_SUMS:
        return cum_gates(gd, bos, t0, T_seq, i_hv, HV, K, o_i, o_d).to(tl.float32)
    return tl.zeros([o_i.shape[0], o_d.shape[0]], tl.float32)


@triton.jit
def anchored_level(b_G, b_L, gc, gd, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_c, o_d, S: tl.constexpr,
              EXACT_SUMS: tl.constexpr):
    """Level S of a chunk's pairs for any gate (docs/math.md section 3): (mask [C, C] of its pairs,
    row factors e^(G - G_a), column factors e^(G_a - G) [C, BS]): every S-row segment's second half
    against its first, anchored at the first half's last token a. Exponents <= 0 on the pairs kept,
    clamped at 0 elsewhere (finite, discarded). With EXACT_SUMS (unbounded gates) b_L and gd hold the
    rounding errors of the float32 sums b_G and gc, and each exponent is (G_hi - G_a,hi) + (G_lo -
    G_a,lo): off by the difference's own rounding plus about |G| 2^-34 (float16 errors), not |G|
    2^-24. No such level holds the diagonal."""
    o_a = (o_c // S) * S + S // 2 - 1
    b_e = b_G - cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_a, o_d)  # G - G_a   [C, BS]
    if EXACT_SUMS:
        b_e += b_L - cum_gates_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_a, o_d, EXACT_SUMS)
    b_r = tl.exp2(tl.minimum(b_e, 0.0))
    b_c = tl.exp2(tl.minimum(-b_e, 0.0))
    return half_pairs(o_c[:, None], o_c[None, :], S), b_r, b_c


@triton.jit
def clamped_anchor(b_G, b_L, gc, gd, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, o_r, o_d,
                   S: tl.constexpr, CLAMP: tl.constexpr, EXACT_SUMS: tl.constexpr):
    """Exponents G_i - G_m [R, BS] of the rows o_r (whole S-token segments of the chunk; m: the middle
    token of each row's segment; b_G, b_L: cum_gates and cum_gates_lo of those rows) on gates clamped
    at -CLAMP (base 2): within S/2 CLAMP of 0 whatever the gates, exact but on the pairs whose span
    holds a clamped gate, whose factors, exact and clamped, are both below 2^-CLAMP (docs/math.md
    section 3). Each gate is its row's sum less the row before's (exact sums with EXACT_SUMS); a
    segment's first gate enters no exponent and is taken as 0."""
    R: tl.constexpr = o_r.shape[0]
    BS: tl.constexpr = o_d.shape[0]
    o_p = tl.maximum(o_r - 1, (o_r // S) * S)  # the row before in the same segment (a first row: itself)
    b_g = b_G - cum_gates(gc, bos, t0, T_seq, i_hv, HV, K, o_p, o_d)
    if EXACT_SUMS:
        b_g += b_L - cum_gates_lo(gd, bos, t0, T_seq, i_hv, HV, K, o_p, o_d, EXACT_SUMS)
    b_s = tl.cumsum(tl.reshape(tl.maximum(b_g, -CLAMP), [R // S, S, BS]), 1)  # sums within each segment
    b_m = tl.sum(tl.where((tl.arange(0, S) == S // 2)[None, :, None], b_s, 0.0), 1)  # [R // S, BS] at m
    return tl.reshape(b_s - b_m[:, None, :], [R, BS])


@triton.jit
def per_block(b_t, C: tl.constexpr):
    """[C // 16, BS] -> [C, BS]: row b of b_t repeated over the rows of 16-token block b."""
    BS: tl.constexpr = b_t.shape[1]
    return tl.reshape(tl.broadcast_to(b_t[:, None, :], [C // 16, 16, BS]), [C, BS])


@triton.jit
def blocks_around(gc, bos, t0, T_seq, i_hv, HV: tl.constexpr, K: tl.constexpr, NC: tl.constexpr, o_c, o_d):
    """([C, BS], [C, BS]): for every row of the chunk, the gates of the blocks before its own and of
    those after it, sums of block sums (each block sum loaded once)."""
    b_before = tl.zeros([o_c.shape[0], o_d.shape[0]], tl.float32)
    b_after = tl.zeros([o_c.shape[0], o_d.shape[0]], tl.float32)
    for b in range(NC):
        b_s = block_sum(gc, bos, t0 + 16 * b, T_seq, i_hv, HV, K, o_d)[None, :]
        b_before += tl.where((b < o_c // 16)[:, None], b_s, 0.0)
        b_after += tl.where((b > o_c // 16)[:, None], b_s, 0.0)
    return b_before, b_after


@triton.jit
def chunk_form(gok, i_p, SELECT: tl.constexpr, EXACT_SUMS: tl.constexpr):
    """(skip, mid) of chunk slot i_p from its gok word (bit 0: the middle anchor; bit 1: exact sums),
    read once: whether this launch of the plan's split passes leaves the chunk to another (SELECT 1
    takes the chunks with gok == 1, middle anchor and plain sums; 2 those with gok == 0, past the
    middle anchor's span with plain sums; 3 those with exact sums, bit 1; 0 every chunk), and whether
    its diagonal blocks take the middle anchor (always for bounded gates and SELECT 1, never for
    SELECT 2, else gok's bit 0)."""
    skip = False
    mid = SELECT != 2
    if SELECT != 0 or EXACT_SUMS:  # one return: the compiler visits code after a constexpr-if's return (gok None)
        f = tl.load(gok + i_p)
        if SELECT == 1:
            skip = f != 1
        if SELECT == 2:
            skip = f != 0
        if SELECT == 3:
            skip = (f & 2) == 0
        if EXACT_SUMS:
            mid = (f & 1) != 0
    return skip, mid


@triton.jit
def state_tile_ptrs(base, i_k, i_kv, K: tl.constexpr, V: tl.constexpr, V_FIRST: tl.constexpr):
    """Pointers and mask of a state tile of (key, value) index tiles i_k, i_kv (broadcastable: a
    [BK, BV] tile from [BK, 1] and [1, BV], its transpose from [1, BK] and [BV, 1]) in a state
    stored [K, V] or, with V_FIRST, [V, K]."""
    m = (i_k < K) & (i_kv < V)
    if V_FIRST:
        return base + i_kv * K + i_k, m
    return base + i_k * V + i_kv, m


@triton.jit
def state_ptrs(base, o_k, o_v, K: tl.constexpr, V: tl.constexpr, V_FIRST: tl.constexpr):
    """Pointers and mask of a [BK, BV] state tile stored [K, V] or, with V_FIRST, [V, K]."""
    return state_tile_ptrs(base, o_k[:, None], o_v[None, :], K, V, V_FIRST)


@triton.jit
def chunk_decay(gl, c_off, i_t, T_seq, i_hv, o_k, HV: tl.constexpr, K: tl.constexpr, C: tl.constexpr):
    """Chunk i_t's decay gl [BK] (float32); 1 for a chunk past the sequence (nothing read)."""
    return tl.load(gl + ((c_off + i_t) * HV + i_hv) * K + o_k, mask=(o_k < K) & (i_t * C < T_seq), other=1.0)


@triton.jit
def chunk_operands(w, qg, kd, Aqk, bos, i_hv, i_t, T_seq, o_k, HV: tl.constexpr, K: tl.constexpr,
                   C: tl.constexpr, DT: tl.constexpr, EMU: tl.constexpr, A_FULL: tl.constexpr):
    """Chunk i_t's w, qg, kd [C, BK] and Aqk [C, C] (lower triangle) as product operands (its decay:
    chunk_decay). A_FULL: stage 1 wrote Aqk's whole [C, C] block, zeros above the diagonal, so that
    its rows load without the triangle's mask (as bulk asynchronous copies)."""
    o_c = tl.arange(0, C)
    o_t = i_t * C + o_c
    m_t = o_t < T_seq
    r_t = (bos + o_t).to(tl.int64)[:, None] * HV + i_hv
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_w = as_operand(tl.load(w + r_t * K + o_k[None, :], mask=m_tk, other=0.0), DT, EMU)  # w, qg, kd: [B, T, HV, K]
    b_qg = as_operand(tl.load(qg + r_t * K + o_k[None, :], mask=m_tk, other=0.0), DT, EMU)
    b_kd = as_operand(tl.load(kd + r_t * K + o_k[None, :], mask=m_tk, other=0.0), DT, EMU)
    if A_FULL:
        m_A = m_t[:, None] & (o_c < C)[None, :]
    else:
        m_A = m_t[:, None] & (o_c[:, None] >= o_c[None, :])
    b_A = as_operand(tl.load(Aqk + r_t * C + o_c[None, :], mask=m_A, other=0.0), DT, EMU)
    return b_w, b_qg, b_kd, b_A
