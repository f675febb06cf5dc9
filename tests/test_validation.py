"""One test per validation rule: a ValueError/TypeError naming the argument and the value,
raised before any work (state pools untouched)."""

import os
import re
import warnings

import numpy as np
import pytest
import torch
from conftest import BACKENDS, DEVICE, GPU
from helpers import check, grow, tol_for

import fastkda
from fastkda import chunk_kda, fused_kda_gate, fused_recurrent_kda, kda_gate_chunk_cumsum, use_backend
from fastkda.testing import Case, make_inputs, reference

B, T, H, HV, K, V = 1, 20, 2, 4, 16, 8


def base(**over):
    x = dict(
        q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, HV, V),
        g=-torch.rand(B, T, HV, K), beta=torch.rand(B, T, HV),
    )
    x.update(over)
    return x


def h0(n=B, dtype=torch.float32, vfirst=False):
    return torch.randn(n, HV, V, K, dtype=dtype) if vfirst else torch.randn(n, HV, K, V, dtype=dtype)


CHUNK_RULES = [
    ("A_log missing", dict(use_gate_in_kernel=True), ValueError,
     r"^`A_log` must be given when `use_gate_in_kernel=True` and `lower_bound` is None, got A_log=None$"),
    ("safe_gate in-kernel without lower_bound", dict(safe_gate=True, use_gate_in_kernel=True, A_log=torch.randn(HV)), ValueError, r"`lower_bound` must be given, in \[-5, 0\), when `safe_gate=True` and `use_gate_in_kernel=True`, got lower_bound=None"),
    ("safe_gate lower_bound < -5", dict(safe_gate=True, lower_bound=-5.5), ValueError, r"lower_bound=-5\.5"),
    ("safe_gate lower_bound 0", dict(safe_gate=True, lower_bound=0.0), ValueError, r"finite negative.*0\.0"),
    ("lower_bound positive", dict(lower_bound=1.0), ValueError,
     r"`lower_bound` must be a finite negative number \(>= -3\.403e\+38, float32's range\), got 1\.0"),
    ("lower_bound type", dict(lower_bound="x"), TypeError, r"`lower_bound` must be a real number or None, got str"),
    ("chunk_size 16", dict(chunk_size=16), ValueError, r"`chunk_size` must be either 32 or 64, got 16"),
    ("chunk_size 128", dict(chunk_size=128), ValueError, r"`chunk_size` must be either 32 or 64, got 128"),
    ("allow_neg_eigval without sigmoid", dict(allow_neg_eigval=True), ValueError, r"`allow_neg_eigval=True` needs `use_beta_sigmoid_in_kernel=True`"),
    ("K > 256", dict(q=torch.randn(B, T, H, 257), k=torch.randn(B, T, H, 257), g=-torch.rand(B, T, HV, 257)), ValueError, r"K=257"),
    ("HV % H", dict(q=torch.randn(B, T, 3, K), k=torch.randn(B, T, 3, K)), ValueError, r"HV=4.*H=3"),
    ("k shape", dict(k=torch.randn(B, T, H, K + 1)), ValueError, r"`k` must have shape \[B, T, H, K\]=\[1, 20, 2, 16\], got \[1, 20, 2, 17\]"),
    ("g shape", dict(g=-torch.rand(B, T, H, K)), ValueError, r"`g` must have shape \[B, T, HV, K\]=\[1, 20, 4, 16\], got \[1, 20, 2, 16\]"),
    ("beta shape", dict(beta=torch.rand(B, T, HV, 1)), ValueError, r"`beta` must have shape \[B, T, HV\]=\[1, 20, 4\], got \[1, 20, 4, 1\]"),
    ("v batch", dict(v=torch.randn(B, T + 1, HV, V)), ValueError, r"`v` must have shape \[B, T, HV, V\].*\[1, 21, 4, 8\]"),
    ("q ndim", dict(q=torch.randn(T, H, K)), ValueError, r"`q` must be 4-D.*\[20, 2, 16\]"),
    ("q type", dict(q=[1.0]), TypeError, r"`q` must be a torch.Tensor, got list"),
    ("A_log shape", dict(use_gate_in_kernel=True, A_log=torch.randn(H)), ValueError, r"`A_log` must have shape \[HV\]=\[4\], got shape \[2\]"),
    ("A_log 2-D", dict(use_gate_in_kernel=True, A_log=torch.randn(2, 2)), ValueError, r"`A_log` must have shape \[HV\]=\[4\], got shape \[2, 2\]"),
    ("dt_bias shape", dict(use_gate_in_kernel=True, A_log=torch.randn(HV), dt_bias=torch.randn(HV)), ValueError, r"`dt_bias` must have shape \[HV\*K\]=\[64\] \(or \[HV, K\]\), got shape \[4\]"),
    ("dt_bias transposed", dict(use_gate_in_kernel=True, A_log=torch.randn(HV), dt_bias=torch.randn(K, HV)), ValueError, r"`dt_bias` must have shape .*got shape \[16, 4\]"),
    ("chunk_size float", dict(chunk_size=64.0), ValueError, r"`chunk_size` must be either 32 or 64, got 64\.0"),
    ("initial_state shape", dict(initial_state=torch.randn(B, HV, V, K)), ValueError, r"`initial_state` must have shape \[N, HV, K, V\]=\[1, 4, 16, 8\].*got \[1, 4, 8, 16\]"),
    ("initial_state state_v_first shape", dict(initial_state=h0(), state_v_first=True), ValueError,
     r"`initial_state` must have shape \[N, HV, V, K\]=\[1, 4, 8, 16\] \(state_v_first=True\), got \[1, 4, 16, 8\]"),
    ("initial_state count", dict(initial_state=h0(2)), ValueError, r"\[N, HV, K, V\]=\[1, 4, 16, 8\].*got \[2, 4, 16, 8\]"),
    ("initial_state dtype", dict(initial_state=h0(dtype=torch.bfloat16)), ValueError, r"`initial_state` must be float32, got torch.bfloat16"),
    ("cu_seqlens batch", dict(q=torch.randn(2, T, H, K), k=torch.randn(2, T, H, K), v=torch.randn(2, T, HV, V),
                              g=-torch.rand(2, T, HV, K), beta=torch.rand(2, T, HV), cu_seqlens=torch.tensor([0, T])),
     ValueError, r"`cu_seqlens` needs the batch flattened to 1 .*got batch size 2"),
    ("cu_seqlens dtype", dict(cu_seqlens=torch.tensor([0.0, T])), ValueError, r"`cu_seqlens` must be int32 or int64, got torch.float32"),
    ("cu_seqlens start", dict(cu_seqlens=torch.tensor([1, T])), ValueError, r"`cu_seqlens` must start at 0, got \[1, 20\]"),
    ("cu_seqlens monotone", dict(cu_seqlens=torch.tensor([0, 12, 5, T])), ValueError, r"non-decreasing, got 12 then 5 at index 2"),
    ("cu_seqlens end", dict(cu_seqlens=torch.tensor([0, 5, T - 1])), ValueError, r"must end at the total length T=20, got 19"),
    ("cu_seqlens 2-D", dict(cu_seqlens=torch.tensor([[0, T]])), ValueError,
     r"`cu_seqlens` must be a 1-D tensor \[N\+1\], got shape \[1, 2\]"),
    ("cu_seqlens_cpu without cu_seqlens", dict(cu_seqlens_cpu=torch.tensor([0, T])), ValueError, r"`cu_seqlens_cpu` was given without `cu_seqlens`"),
    ("intermediate states outside inference", dict(return_intermediate_states=True), ValueError,
     r"`return_intermediate_states=True` is for inference only"),
    ("cp with initial state", dict(cp_context=object(), initial_state=h0()), ValueError, r"`initial_state` cannot be used with `cp_context`"),
    ("cp with final state", dict(cp_context=object(), output_final_state=True), ValueError, r"`output_final_state=True` cannot be used with `cp_context`"),
    ("qkv dtypes", dict(k=torch.randn(B, T, H, K, dtype=torch.bfloat16)), ValueError, r"share one dtype.*k=torch.bfloat16"),
    ("integer g", dict(g=torch.zeros(B, T, HV, K, dtype=torch.int32)), ValueError, r"`g` must be bfloat16, float16, float32 or float64, got torch.int32"),
    ("device mismatch", dict(g=-torch.rand(B, T, HV, K, device="meta")), ValueError, r"`g` is on meta but `q` is on cpu"),
    ("flag type", dict(output_final_state="yes"), TypeError, r"`output_final_state` must be a bool, got str"),
    ("scale type", dict(scale="1"), TypeError, r"`scale` must be a real number or None, got str"),
    ("scale nan", dict(scale=float("nan")), ValueError,
     r"`scale` must be finite \(\|scale\| <= 3\.403e\+38, float32's range\), got nan"),
    ("lower_bound beyond float32", dict(use_gate_in_kernel=True, A_log=torch.randn(HV), lower_bound=-1e40), ValueError,
     r"`lower_bound` must be a finite negative number \(>= -3\.403e\+38, float32's range\), got -1e\+40"),
    ("no value heads", dict(v=torch.randn(B, T, 0, V), g=-torch.rand(B, T, 0, K), beta=torch.rand(B, T, 0)), ValueError,
     r"the value heads HV=0 \(v.shape\[2\]\) must be a positive multiple of the q/k heads H=2"),
    ("flag numpy bool", dict(output_final_state=np.bool_(True)), TypeError,
     r"`output_final_state` must be a bool, got numpy\.bool"),
    ("cu_seqlens_cpu dtype", dict(cu_seqlens=torch.tensor([0, T]), cu_seqlens_cpu=torch.tensor([0.0, T])), ValueError,
     r"`cu_seqlens_cpu` must be a CPU int tensor shaped like cu_seqlens \[2\]"),
    ("cu_seqlens_cpu shape", dict(cu_seqlens=torch.tensor([0, T]), cu_seqlens_cpu=torch.tensor([0, 5, T])), ValueError,
     r"`cu_seqlens_cpu` must be a CPU int tensor shaped like cu_seqlens \[2\]"),
    ("cu_seqlens_cpu type", dict(cu_seqlens=torch.tensor([0, T]), cu_seqlens_cpu=[0, T]), TypeError,
     r"`cu_seqlens_cpu` must be a torch.Tensor, got list"),
    ("A_log integer", dict(use_gate_in_kernel=True, A_log=torch.zeros(HV, dtype=torch.int32)), ValueError,
     r"`A_log` must be bfloat16, float16, float32 or float64, got torch.int32"),
    ("A_log device", dict(use_gate_in_kernel=True, A_log=torch.randn(HV, device="meta")), ValueError,
     r"`A_log` is on meta but `q` is on cpu"),
    ("cu_seqlens device", dict(cu_seqlens=torch.tensor([0, T], device="meta")), ValueError,
     r"`cu_seqlens` is on meta but `q` is on cpu"),
    ("cu_seqlens empty", dict(cu_seqlens=torch.zeros(0, dtype=torch.int32)), ValueError,
     r"`cu_seqlens` must be a 1-D tensor \[N\+1\], got shape \[0\]"),
]


@pytest.mark.parametrize("name,over,exc,match", CHUNK_RULES, ids=[r[0] for r in CHUNK_RULES])
def test_chunk_kda_rule(name, over, exc, match):
    with pytest.raises(exc, match=match):
        chunk_kda(**base(**over))


def test_cp_context_rules():
    from fastkda.distributed import CPContext

    with pytest.raises(TypeError, match=r"`cp_context` must be a fastkda.distributed.CPContext, got object"):
        chunk_kda(**base(cp_context=object()))
    ctx = CPContext(cu_seqlens=torch.tensor([0, 2 * T]), rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"pass the global `cu_seqlens` to the CPContext"):
        chunk_kda(**base(cp_context=ctx, cu_seqlens=torch.tensor([0, T])))
    with pytest.raises(ValueError, match=r"this rank's shard \[1, 20, H, K\], got \[1, 19, 2, 16\]"):
        chunk_kda(**base(q=torch.randn(1, T - 1, H, K), cp_context=ctx))
    with pytest.raises(ValueError, match=r"the global length T=10 must be a multiple of the world size 3"):
        CPContext(cu_seqlens=torch.tensor([0, 10]), rank=0, world_size=3)
    with pytest.raises(ValueError, match=r"`cu_seqlens` must start at 0 and be non-decreasing, got \[0, 8, 6\]"):
        CPContext(cu_seqlens=torch.tensor([0, 8, 6]), rank=0, world_size=2)
    cu = torch.tensor([0, 8])
    for rank, world in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match=rf"`rank` must be in \[0, world_size\).*rank={rank}, world_size={world}"):
            CPContext(cu_seqlens=cu, rank=rank, world_size=world)
    with pytest.raises(TypeError, match=r"`world_size` must be an int or None, got float: 2\.0"):
        CPContext(cu_seqlens=cu, rank=0, world_size=2.0)
    with pytest.raises(ValueError, match=r"`rank` and `world_size` are needed.*rank=None, world_size=2"):
        CPContext(cu_seqlens=cu, world_size=2)  # no process group to take the rank from
    for bad, got in ((torch.tensor([0.0, 8.5]), r"torch.float32 of shape \[2\]"),
                     (torch.tensor([[0, 8]]), r"torch.int64 of shape \[1, 2\]")):
        with pytest.raises(ValueError, match=r"`cu_seqlens` must be a 1-D integer tensor \[N\+1\], got " + got):
            CPContext(cu_seqlens=bad, rank=0, world_size=2)


def test_cp_context_must_match_the_process_group(tmp_path):
    """With torch.distributed initialised, a rank or world size that is not the group's is an
    error (a CPContext of another size would shard and combine wrongly)."""
    import torch.distributed as dist

    from fastkda.distributed import CPContext

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert (CPContext(cu_seqlens=torch.tensor([0, 8])).rank, CPContext(cu_seqlens=torch.tensor([0, 8])).world_size) == (0, 1)
        with pytest.raises(ValueError, match=r"`world_size`=2 differs from the process group's world_size 1"):
            CPContext(cu_seqlens=torch.tensor([0, 8]), rank=0, world_size=2)
        with pytest.raises(ValueError, match=r"`rank`=1 differs from the process group's rank 0"):
            CPContext(cu_seqlens=torch.tensor([0, 8]), rank=1, world_size=1)
    finally:
        dist.destroy_process_group()


def test_valid_base_call_runs():
    o, s = chunk_kda(**base(), output_final_state=True)
    assert o.shape == (B, T, HV, V) and s.shape == (N := B, HV, K, V) and N == 1


POOL = 6


def pool():
    return torch.randn(POOL, HV, K, V)


RECURRENT_RULES = [
    ("indices without pool", dict(ssm_state_indices=torch.tensor([0])), ValueError, r"`ssm_state_indices` selects slots.*initial_state=None"),
    ("indices dtype", dict(initial_state=pool(), ssm_state_indices=torch.tensor([0.0])), ValueError,
     r"`ssm_state_indices` must be int32 or int64, got torch.float32"),
    ("indices shape", dict(initial_state=pool(), ssm_state_indices=torch.tensor([0, 1])), ValueError, r"\[N\] or \[N, 1 \+ num_draft\] with N=1.*\[2\]"),
    ("spec indices without accepted", dict(initial_state=pool(), ssm_state_indices=torch.zeros(1, T, dtype=torch.long)),
     ValueError, r"needs `num_accepted_tokens` \[N\], got None"),
    ("accepted without 2-D indices", dict(initial_state=pool(), ssm_state_indices=torch.tensor([0]),
                                          num_accepted_tokens=torch.tensor([1])), ValueError,
     r"`num_accepted_tokens` needs 2-D .*got ssm_state_indices=Tensor\(shape=\[1\]"),
    ("accepted shape", dict(initial_state=pool(), ssm_state_indices=torch.zeros(1, T, dtype=torch.long),
                            num_accepted_tokens=torch.tensor([1, 1])), ValueError,
     r"`num_accepted_tokens` must be.*\[N\]=\[1\], got Tensor\(shape=\[2\]"),
    ("too few draft slots", dict(initial_state=pool(), ssm_state_indices=torch.zeros(1, 3, dtype=torch.long), num_accepted_tokens=torch.tensor([1])), ValueError, r"3 slots per sequence but each sequence has T=20"),
    ("pool state shape", dict(initial_state=torch.randn(POOL, HV, V, K), ssm_state_indices=torch.tensor([0])),
     ValueError, r"`initial_state` must have shape \[num_slots, HV, K, V\]=\[num_slots, 4, 16, 8\].*"
                 r"got \[6, 4, 8, 16\]"),
    ("pool dtype", dict(initial_state=pool().half(), ssm_state_indices=torch.tensor([0])), ValueError, r"`initial_state` must be float32 or bfloat16 .*got torch.float16"),
    ("state dtype", dict(initial_state=torch.randn(B, HV, K, V, dtype=torch.float64)), ValueError, r"`initial_state` must be float32 or bfloat16 .*got torch.float64"),
    ("inplace without state", dict(inplace_final_state=True), ValueError, r"`inplace_final_state=True` writes into `initial_state`, got initial_state=None"),
    ("allow_neg_eigval without sigmoid", dict(allow_neg_eigval=True), ValueError,
     r"`allow_neg_eigval=True` needs `use_beta_sigmoid_in_kernel=True`.*got use_beta_sigmoid_in_kernel=False"),
    ("A_log missing", dict(use_gate_in_kernel=True), ValueError, r"`A_log` must be given.*got A_log=None$"),
    ("g shape", dict(g=-torch.rand(B, T, H, K)), ValueError,
     r"`g` must have shape \[B, T, HV, K\]=\[1, 20, 4, 16\], got \[1, 20, 2, 16\]"),
    ("state type", dict(initial_state=[0.0]), TypeError, r"`initial_state` must be a torch.Tensor, got list"),
    ("pool type", dict(initial_state=[0.0], ssm_state_indices=torch.tensor([0])), TypeError,
     r"`initial_state` must be a torch.Tensor, got list"),
    ("inplace into a state that requires grad", dict(initial_state=h0().requires_grad_(), inplace_final_state=True),
     ValueError, r"`inplace_final_state=True` writes into `initial_state`, which requires grad"),
    ("inplace flag type", dict(initial_state=h0(), inplace_final_state=1), TypeError,
     r"`inplace_final_state` must be a bool, got int: 1"),
    ("accepted dtype", dict(initial_state=pool(), ssm_state_indices=torch.zeros(1, T, dtype=torch.long),
                            num_accepted_tokens=torch.tensor([1.0])), ValueError,
     r"`num_accepted_tokens` must be an int32/int64 tensor of shape \[N\]=\[1\]"),
    ("indices device", dict(initial_state=pool(), ssm_state_indices=torch.tensor([0], device="meta")), ValueError,
     r"`ssm_state_indices` is on meta but `q` is on cpu"),
    ("accepted device", dict(initial_state=pool(), ssm_state_indices=torch.zeros(1, T, dtype=torch.long),
                             num_accepted_tokens=torch.tensor([1], device="meta")), ValueError,
     r"`num_accepted_tokens` is on meta but `q` is on cpu"),
]


def test_state_on_another_device():
    for fn in (chunk_kda, fused_recurrent_kda):
        with pytest.raises(ValueError, match=r"`initial_state` is on meta but `q` is on cpu"):
            fn(**base(initial_state=h0().to("meta")))


@pytest.mark.parametrize("name,over,exc,match", RECURRENT_RULES, ids=[r[0] for r in RECURRENT_RULES])
def test_fused_recurrent_rule(name, over, exc, match):
    before = over.get("initial_state")
    snapshot = before.clone() if isinstance(before, torch.Tensor) else None
    with pytest.raises(exc, match=match):
        fused_recurrent_kda(**base(**over))
    if snapshot is not None:
        assert torch.equal(before, snapshot)


@pytest.mark.parametrize(
    "idx,acc,match",
    [
        ([POOL], None, r"slot 6 at \[0\]; slots must be in \[0, 6\) or -1"),
        ([-2], None, r"`ssm_state_indices` holds slot -2 at \[0\]"),
        ([[0, 1, POOL + 3] + [1] * (T - 3)], [1], r"slot 9 at \[0, 2\]"),
        ([[0] * T], [0], r"`num_accepted_tokens\[0\]`=0 must be in \[1, 20\]"),
        ([[0] * T], [T + 1], r"`num_accepted_tokens\[0\]`=21"),
    ],
)
def test_bad_pool_indices_leave_pool_untouched(idx, acc, match):
    p = pool()
    snapshot = p.clone()
    kw = dict(initial_state=p, ssm_state_indices=torch.tensor(idx), inplace_final_state=True)
    if acc is not None:
        kw["num_accepted_tokens"] = torch.tensor(acc)
    with pytest.raises(ValueError, match=match):
        fused_recurrent_kda(**base(), **kw)
    assert torch.equal(p, snapshot)


def test_gate_helpers_validate():
    g = torch.randn(2, 5, HV, K)
    with pytest.raises(ValueError, match=r"^`A_log` must be given when `lower_bound` is None, got A_log=None$"):
        fused_kda_gate(g)  # (the gate helpers have no use_gate_in_kernel, and their device is g's)
    with pytest.raises(ValueError, match=r"`A_log` is on meta but `g` is on cpu"):
        fused_kda_gate(g, torch.randn(HV, device="meta"))
    with pytest.raises(ValueError, match=r"`cu_seqlens` is on meta but `g` is on cpu"):
        kda_gate_chunk_cumsum(g[:1], torch.randn(HV), 64, cu_seqlens=torch.tensor([0, 5], device="meta"))
    with pytest.raises(ValueError, match=r"`dt_bias` must have shape \[HV\*K\]=\[64\] \(or \[HV, K\]\), got shape \[3\]"):
        fused_kda_gate(g, torch.randn(HV), torch.randn(3))
    with pytest.raises(ValueError, match=r"`chunk_size` must be a positive power of two, got 48"):
        kda_gate_chunk_cumsum(g, torch.randn(HV), 48)
    with pytest.raises(ValueError, match=r"`chunk_size` must be a positive power of two, got None"):
        kda_gate_chunk_cumsum(g, torch.randn(HV), None)
    with pytest.raises(ValueError, match=r"`g` must be \[B, T, H, K\], got shape \[5, 4, 16\]"):
        kda_gate_chunk_cumsum(g[0], torch.randn(HV), 64)
    with pytest.raises(ValueError, match=r"`cu_seqlens` must end at the total length T=5, got 3"):
        kda_gate_chunk_cumsum(g[:1], torch.randn(HV), 64, cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"`output_dtype` must be a floating torch.dtype, got torch.int32"):
        fused_kda_gate(g, torch.randn(HV), output_dtype=torch.int32)
    with pytest.raises(ValueError, match=r"`lower_bound` must be a finite negative number \(.*\), got -1e\+40"):
        fused_kda_gate(g, torch.randn(HV), lower_bound=-1e40)
    with pytest.raises(ValueError, match=r"`scale` must be finite \(.*float32's range\), got 1e\+39"):
        kda_gate_chunk_cumsum(g, torch.randn(HV), 64, scale=1e39)
    with pytest.raises(ValueError, match=r"`g` must be \[\.\.\., H, K\], got shape \[4\]"):
        fused_kda_gate(torch.randn(HV), torch.randn(HV))
    want = kda_gate_chunk_cumsum(g, torch.randn(HV, generator=torch.Generator().manual_seed(0)), 64)
    got = kda_gate_chunk_cumsum(g, torch.randn(HV, generator=torch.Generator().manual_seed(0)), np.int64(64))
    assert torch.equal(got, want)  # NumPy's ints are ints


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
def test_transpose_state_layout_is_state_v_first(fn):
    """fla-core's former name of state_v_first: the same results, with a DeprecationWarning; both
    at once, or a non-bool, raise."""
    import fastkda

    x = base(initial_state=h0(vfirst=True), output_final_state=True)
    want = fn(**x, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        got = fn(**x, transpose_state_layout=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match=r"pass `state_v_first` or the deprecated `transpose_state_layout`, not both"):
        fn(**x, state_v_first=True, transpose_state_layout=True)
    with pytest.raises(TypeError, match=r"`transpose_state_layout` must be a bool, got int: 1$"):
        fn(**x, transpose_state_layout=1)
    with pytest.warns(DeprecationWarning):
        assert fastkda.explain(fn, **x, transpose_state_layout=True)[0] == fastkda.explain(fn, **x, state_v_first=True)[0]


# fla-core 0.6.0's fla.ops.kda: positional parameters in order, then what it reads from **kwargs
FLA_CHUNK = ("q k v g beta scale initial_state output_final_state use_qk_l2norm_in_kernel use_gate_in_kernel "
             "use_beta_sigmoid_in_kernel allow_neg_eigval safe_gate lower_bound disable_recompute "
             "return_intermediate_states state_v_first cu_seqlens cu_seqlens_cpu cp_context use_graph max_num_seqs",
             "A_log dt_bias chunk_size transpose_state_layout")
FLA_RECURRENT = ("q k v g beta A_log dt_bias scale initial_state output_final_state use_qk_l2norm_in_kernel "
                 "use_gate_in_kernel use_beta_sigmoid_in_kernel allow_neg_eigval lower_bound state_v_first cu_seqlens",
                 "transpose_state_layout")


@pytest.mark.parametrize("fn,names", [(chunk_kda, FLA_CHUNK), (fused_recurrent_kda, FLA_RECURRENT)])
def test_fla_signature(fn, names):
    """A drop-in for fla-core 0.6.0: its positional parameters in the same order, and the keyword
    arguments it reads, under the same names."""
    import inspect

    params = list(inspect.signature(fn).parameters)
    positional, keywords = names[0].split(), names[1].split()
    assert params[:len(positional)] == positional
    assert set(keywords) <= set(params)


@pytest.mark.parametrize("backend", BACKENDS)
def test_safe_gate_pregated_without_lower_bound(backend, rng):
    """safe_gate=True with a pre-gated g already in [-5, 0) and no lower_bound (fla-core's varlen
    tests): the caller vouches for the range; every backend runs it, forward and backward, with the
    results of the same call with lower_bound=-5."""
    case = grow(Case(seqlens=(40, 1, 70), gate="pregated_safe", dtype=torch.float16 if GPU else torch.float32), GPU)
    x = make_inputs(case, device=DEVICE, requires_grad=True, generator=rng)
    assert x.pop("lower_bound") == -5.0 and x["safe_gate"] is True
    leaves = [x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]
    with use_backend(backend):
        o, s = chunk_kda(**x)
        o_lb, s_lb = chunk_kda(**x, lower_bound=-5.0)
    assert torch.equal(o, o_lb) and torch.equal(s, s_lb)
    o_r, s_r = reference(x)
    tol = tol_for(case.dtype, backend)
    check("o", o, o_r, tol)
    check("final_state", s, s_r, tol)
    do, ds = torch.randn_like(o), torch.randn_like(s)
    got = torch.autograd.grad((o, s), leaves, (do, ds))
    want = torch.autograd.grad((o_lb, s_lb), leaves, (do, ds))
    for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("scale", [np.float32(0.5), np.float64(0.5), np.int64(1), torch.tensor(0.5), torch.tensor([0.5])])
def test_real_scalars_as_scale_and_lower_bound(scale):
    """NumPy's real scalars and one-element tensors are numbers: the same results as the float."""
    x = base(use_gate_in_kernel=True, A_log=torch.randn(HV), g=torch.randn(B, T, HV, K))
    want = chunk_kda(**x, scale=float(scale), lower_bound=-2.0)[0]
    assert torch.equal(chunk_kda(**x, scale=scale, lower_bound=-2.0)[0], want)
    assert torch.equal(chunk_kda(**x, scale=float(scale), lower_bound=np.float32(-2.0))[0], want)
    assert torch.equal(fused_recurrent_kda(**x, scale=scale, lower_bound=np.float32(-2.0))[0],
                       fused_recurrent_kda(**x, scale=float(scale), lower_bound=-2.0)[0])


@pytest.mark.parametrize("bad,exc,match", [
    (np.bool_(True), TypeError, r"`scale` must be a real number or None, got numpy\.bool"),
    (True, TypeError, r"`scale` must be a real number or None, got bool"),
    (1j, TypeError, r"`scale` must be a real number or None, got complex"),
    (torch.ones(2), TypeError, r"`scale` must be a real number or a one-element real tensor.*shape=\[2\]"),
    (torch.tensor(0.5, device="meta"), TypeError, r"`scale` must be a real number or a one-element real tensor.*meta"),
    (np.float32("inf"), ValueError, r"`scale` must be finite \(.*float32's range\), got inf"),
    (1e39, ValueError, r"`scale` must be finite \(\|scale\| <= 3\.403e\+38, float32's range\), got 1e\+39"),
    (torch.tensor(0.5, requires_grad=True), TypeError, r"`scale` is read as a number.*requires_grad=True"),
])
def test_bad_scalars(bad, exc, match):
    with pytest.raises(exc, match=match):
        chunk_kda(**base(), scale=bad)


def test_scale_parameter_without_grad():
    """A scale tensor that requires grad is a number where no gradient is taken (no_grad)."""
    x = base()
    with torch.no_grad():
        got = chunk_kda(**x, scale=torch.nn.Parameter(torch.tensor(0.25)))[0]
        assert torch.equal(got, chunk_kda(**x, scale=0.25)[0])


@pytest.mark.parametrize("varlen", [False, True])
def test_meta_tensors_propagate_shapes(varlen):
    """On meta tensors chunk_kda validates and returns outputs of the right shapes and dtypes
    (what torch.compile's fake implementation gives), reading no values."""
    n = 3 if varlen else 2
    q = torch.empty(1 if varlen else n, T, H, K, device="meta", dtype=torch.bfloat16)
    x = dict(q=q, k=torch.empty_like(q), v=torch.empty(*q.shape[:2], HV, V, device="meta", dtype=torch.bfloat16),
             g=torch.empty(*q.shape[:2], HV, K, device="meta"), beta=torch.empty(*q.shape[:2], HV, device="meta"))
    if varlen:
        x["cu_seqlens"] = torch.empty(n + 1, dtype=torch.int32, device="meta")
    o, s = chunk_kda(**x, initial_state=torch.empty(n, HV, K, V, device="meta"), output_final_state=True,
                     use_gate_in_kernel=True, A_log=torch.empty(HV, device="meta"), safe_gate=True, lower_bound=-5.0)
    assert o.device.type == "meta" and o.shape == x["v"].shape and o.dtype == torch.bfloat16
    assert s.device.type == "meta" and s.shape == (n, HV, K, V) and s.dtype == torch.float32
    o, s = chunk_kda(**x, state_v_first=True)
    assert o.shape == x["v"].shape and s is None
    leaves = [t.requires_grad_() for n, t in x.items() if n != "cu_seqlens"]
    o, s = chunk_kda(**x, output_final_state=True, state_v_first=True)
    assert s.shape == (n, HV, V, K)
    grads = torch.autograd.grad((o, s), leaves, (torch.empty_like(o), torch.empty_like(s)))
    assert [d.shape for d in grads] == [t.shape for t in leaves] and all(d.device.type == "meta" for d in grads)
    g_shape = re.escape(str(list(x["g"][..., :-1].shape)))
    with pytest.raises(ValueError, match=r"`g` must have shape .*, got " + g_shape):
        chunk_kda(**{**x, "g": x["g"][..., :-1]})


def test_shared_keywords_between_operators(rng):
    """An options dict shared by chunk_kda and fused_recurrent_kda, with fla's `head_first=False`, works
    with both (as with fla-core, whose operators take any keyword): the other operator's keywords
    that mean nothing here are ignored, and the results are those of the call without them."""
    x = make_inputs(Case(T=20, K=16, V=16, gate="softplus"), generator=rng)
    shared = dict(safe_gate=False, head_first=False, chunk_size=64, disable_recompute=False, cu_seqlens_cpu=None,
                  use_graph=False, max_num_seqs=None, inplace_final_state=False, raise_on_bad_index=False,
                  ssm_state_indices=None, num_accepted_tokens=None)
    own = {"chunk_kda": {"inplace_final_state", "raise_on_bad_index", "ssm_state_indices", "num_accepted_tokens"},
           "fused_recurrent_kda": {"safe_gate", "chunk_size", "disable_recompute", "cu_seqlens_cpu", "use_graph",
                                   "max_num_seqs"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for any of them
        for fn, other in ((chunk_kda, "fused_recurrent_kda"), (fused_recurrent_kda, "chunk_kda")):
            kw = {n: v for n, v in shared.items() if n in own[other] or n == "head_first"}
            got = fn(**x, **kw)[0]
            want = fn(**x)[0]
            assert torch.equal(got, want), fn.__name__
            assert fastkda.explain(fn, **x, **kw)[0] == fastkda.explain(fn, **x)[0]


@pytest.mark.parametrize("fn,kw,match", [
    ("chunk_kda", dict(head_first=True), r"`head_first=True` .* not supported.*got head_first=True"),
    ("fused_recurrent_kda", dict(head_first=True), r"`head_first=True` .* not supported.*got head_first=True"),
    ("chunk_kda", dict(ssm_state_indices=torch.tensor([0])),
     r"`ssm_state_indices` is an argument of the other operator, not of chunk_kda: got ssm_state_indices=Tensor\("),
    ("chunk_kda", dict(num_accepted_tokens=torch.tensor([1])),
     r"`num_accepted_tokens` is an argument of the other operator, not of chunk_kda: got num_accepted_tokens=Tensor\("),
    ("chunk_kda", dict(inplace_final_state=True),
     r"`inplace_final_state` is an argument .*: got inplace_final_state=True$"),
    ("fused_recurrent_kda", dict(cp_context=object()),
     r"`cp_context` is an argument of the other operator, not of fused_recurrent_kda: got cp_context=<object"),
    ("fused_recurrent_kda", dict(return_intermediate_states=True),
     r"`return_intermediate_states` is an argument .*: got return_intermediate_states=True$"),
])
def test_foreign_keywords_that_would_change_the_result(fn, kw, match):
    """A keyword of the other operator (or fla's head_first=True) whose value would change the result
    here is a ValueError naming it, before anything runs."""
    x = make_inputs(Case(T=8, K=16, V=16))
    with pytest.raises(ValueError, match=match):
        getattr(fastkda, fn)(**x, **kw)
    with pytest.raises(ValueError, match=match):
        fastkda.explain(getattr(fastkda, fn), **x, **kw)


def test_unknown_keyword_warns_once():
    """Any other keyword is ignored with a warning naming it, once per operator and name."""
    x = make_inputs(Case(T=8, K=16, V=16))
    name = f"not_an_option_{os.getpid()}_{id(x)}"  # a name no earlier call used
    want = chunk_kda(**x)[0]
    with pytest.warns(UserWarning, match=f"chunk_kda: ignoring unknown keyword arguments \\['{name}'\\]"):
        got = chunk_kda(**x, **{name: 1})[0]
    assert torch.equal(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chunk_kda(**x, **{name: 2})  # the second time: silent
    with pytest.warns(UserWarning, match="fused_recurrent_kda: ignoring"):
        fused_recurrent_kda(**x, **{name: 1})
