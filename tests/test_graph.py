"""use_graph: varlen chunk_kda whose boundaries are never read back (chunk tables built on the
device in sizes fixed by the shapes), padded with empty sequences and ending before T."""

import numpy as np
import pytest
import torch
from conftest import BACKENDS, BACKWARD_BACKENDS, DEVICE, GPU
from helpers import GRAD_INPUTS, check, check_grads, grow, launched, tol_for

from fastkda import chunk_kda, use_backend
from fastkda.testing import Case, make_inputs, reference

EXTRA_TOKENS, EMPTY_TAILS = 7, 2
CASES = {  # block path (softplus, float32) and whole-chunk path (bounded gate, bfloat16), GVA, chunk 32
    "softplus_f32": Case(seqlens=(3, 70, 0, 33), H=2, HV=4, gate="softplus", l2norm=True, beta_sigmoid=True,
                         initial_state=True, final_state=True),
    "safe_bf16": Case(seqlens=(1, 65, 40), gate="safe", l2norm=True, dtype=torch.bfloat16, initial_state=False,
                      final_state=True),
    "chunk32_vfirst": Case(seqlens=(40, 0, 17), chunk_size=32, state_v_first=True, initial_state=True,
                           final_state=True),
}


def padded(x: dict, rng) -> tuple[dict, int]:
    """The inputs of a varlen case as a graph-mode call sees them: EMPTY_TAILS empty sequences
    after the real ones and EXTRA_TOKENS rows after the last sequence, all NaN (they must never be
    read, nor their gradients reach other rows). Returns (the padded inputs, the number of real rows)."""
    cu = x["cu_seqlens"]
    n = int(cu[-1])
    y = dict(x)
    for name in ("q", "k", "v", "g", "beta"):
        t = x[name]
        tail = torch.full((1, EXTRA_TOKENS, *t.shape[2:]), float("nan")).to(t)
        y[name] = torch.cat([t, tail], 1)
    y["cu_seqlens"] = torch.cat([cu, cu.new_full((EMPTY_TAILS,), n)])
    if x.get("initial_state") is not None:
        h0 = x["initial_state"]
        y["initial_state"] = torch.cat([h0, torch.randn(EMPTY_TAILS, *h0.shape[1:], generator=rng).to(h0)])
    return y, n


def leaves_of(y: dict) -> dict:
    out = {}
    for name in GRAD_INPUTS:
        t = y.get(name)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            out[name] = y[name] = t.detach().clone().requires_grad_(True)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("short", [False, True], ids=["chunk", "short"])
@pytest.mark.parametrize("name", list(CASES))
def test_graph_mode_forward(backend, short, name, rng, tune, launch_log):
    """Outputs of the real rows and the real sequences' final states against the float64 reference;
    the rows after the last sequence are zero; an empty tail sequence passes its initial state on.
    ``short``: the Triton backend's short path forced (its chunks' tables)."""
    if short and backend != "triton":
        pytest.skip("the short path is the Triton backend's")
    tune(short_min_pairs=1 if short else None)
    case = grow(CASES[name], GPU)
    x = make_inputs(case, device=DEVICE, generator=rng)
    y, n = padded(x, rng)
    N = len(case.seqlens)
    with use_backend(backend):
        o, s = chunk_kda(**y, chunk_size=case.chunk_size, use_graph=True, max_num_seqs=N + EMPTY_TAILS)
    if short:  # pre-gated unbounded gates keep the chunk-wide path
        assert bool(launched(launch_log, "kda_fwd_short_kernel")) is (case.gate != "pregated")
    o_r, s_r = reference(x)
    tol = tol_for(case.dtype, backend)
    check("o", o[:, :n], o_r, tol)
    assert torch.equal(o[:, n:], torch.zeros_like(o[:, n:]))
    check("final_state", s[:N], s_r, tol)
    tails = y["initial_state"][N:] if "initial_state" in y else torch.zeros_like(s[N:])
    assert torch.equal(s[N:], tails)


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_graph_mode_backward(backend, name, rng):
    """Gradients of the real rows, of the gate parameters and of the real sequences' initial
    states against the reference; zero for the rows after the last sequence (a graph-mode step
    must not train on them) and equal to dht for an empty tail sequence's initial state."""
    case = grow(CASES[name], GPU)
    x = make_inputs(case, device=DEVICE, generator=rng)
    y, n = padded(x, rng)
    N = len(case.seqlens)
    leaves = leaves_of(y)
    with use_backend(backend):
        o, s = chunk_kda(**y, chunk_size=case.chunk_size, use_graph=True)
    do = torch.randn(o.shape, generator=rng).to(o)
    ds = torch.randn(s.shape, generator=rng).to(s)
    loss = (o.float() * do.float()).sum() + (s * ds).sum()
    got = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)))
    for name_, t in got.items():
        if name_ in ("q", "k", "v", "g", "beta"):
            assert torch.equal(t[:, n:], torch.zeros_like(t[:, n:])), name_
    if "initial_state" in got:
        assert torch.equal(got["initial_state"][N:], ds[N:].to(got["initial_state"]))
    xr = leaves_of(dict(x))
    o_r, s_r = reference({**x, **xr})
    loss_r = (o_r * do[:, :n].double()).sum() + (s_r * ds[:N].double()).sum()
    want = dict(zip(xr, torch.autograd.grad(loss_r, list(xr.values()), allow_unused=True)))
    cut = {name_: (t[:, :n] if name_ in ("q", "k", "v", "g", "beta") else t[:N] if name_ == "initial_state" else t)
           for name_, t in got.items()}
    check_grads(cut, want, x, tol_for(case.dtype, backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("short", [None, 16, 32], ids=["chunk", "short", "short_pairs"])
def test_graph_mode_new_boundaries(backend, short, rng, tune, launch_log):
    """One set of shapes, boundaries changed in place between calls (what a CUDA graph replays):
    each call follows its own boundaries, with more, fewer or no real sequences. ``short``: the
    Triton backend's short path forced, on chunks of that many tokens (32: blocks merged in pairs)."""
    if short and backend != "triton":
        pytest.skip("the short path is the Triton backend's")
    tune(short_min_pairs=1 if short else None, short_chunk=short)
    case = grow(Case(seqlens=(30, 20, 50), gate="lowerbound", initial_state=False, final_state=True), GPU)
    x = make_inputs(case, device=DEVICE, generator=rng)
    T = x["q"].shape[1]
    cu = torch.zeros(6, dtype=torch.int32, device=DEVICE)  # up to 5 sequences
    for lens in ((T // 2, 0, T - T // 2), (1, 2, 3, 4, T - 20), (T - 5,), ()):
        bounds = [0, *torch.tensor(lens, dtype=torch.long).cumsum(0).tolist()]
        cu.copy_(torch.tensor(bounds + [bounds[-1]] * (6 - len(bounds)), dtype=torch.int32))
        with use_backend(backend):
            o, s = chunk_kda(**{**x, "cu_seqlens": cu}, use_graph=True, max_num_seqs=5)
        assert [e.args["C"] for e in launch_log if e.name == "kda_fwd_short_kernel"] == ([short] if short else [])
        launch_log.clear()
        n = bounds[-1]
        if n:
            real = {**x, **{k: x[k][:, :n] for k in ("q", "k", "v", "g", "beta")},
                    "cu_seqlens": torch.tensor(bounds, dtype=torch.int32, device=DEVICE)}
            o_r, s_r = reference(real)
            check("o", o[:, :n], o_r, tol_for(case.dtype, backend))
            check("final_state", s[:len(lens)], s_r, tol_for(case.dtype, backend))
        assert torch.equal(o[:, n:], torch.zeros_like(o[:, n:]))
        assert torch.equal(s[len(lens):], torch.zeros_like(s[len(lens):]))  # empty padding sequences, no initial state


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
@pytest.mark.parametrize("cu", [[0, 5, 3, 9], [2, 5, 9], [0, 5, 200]])
def test_graph_mode_broken_boundaries(cu, rng):
    """Boundaries that break the contract (decreasing, not from 0, past T) are not read back: the
    Triton backend stays inside its buffers and answers NaN, in the outputs and in every gradient;
    the PyTorch backend, which reads them anyway, raises."""
    case = Case(seqlens=(5, 4), gate="softplus", initial_state=True, final_state=True)
    x = make_inputs(case, device=DEVICE, generator=rng)
    x["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    x["initial_state"] = torch.randn(len(cu) - 1, *x["initial_state"].shape[1:], generator=rng).to(x["initial_state"])
    leaves = leaves_of(x)
    with use_backend("triton"):
        o, s = chunk_kda(**x, use_graph=True)
    assert o.isnan().all() and s.isnan().all()
    grads = torch.autograd.grad(o.float().sum() + s.sum(), list(leaves.values()))
    assert all(t.isnan().all() for t in grads), [n for n, t in zip(leaves, grads) if not t.isnan().all()]
    if DEVICE == "cpu":
        with use_backend("torch"), pytest.raises(ValueError, match="cu_seqlens"):
            chunk_kda(**x, use_graph=True)


def test_graph_mode_arguments(rng):
    """What use_graph and max_num_seqs accept, and that a dense batch ignores them."""
    case = Case(seqlens=(5, 4))
    x = make_inputs(case, device=DEVICE, generator=rng)
    with pytest.raises(ValueError, match="max_num_seqs"):
        chunk_kda(**x, use_graph=True, max_num_seqs=3)
    with pytest.raises(ValueError, match="max_num_seqs"):
        chunk_kda(**x, use_graph=True, max_num_seqs=-1)
    with pytest.raises(TypeError, match="use_graph"):
        chunk_kda(**x, use_graph=1)
    with pytest.raises(TypeError, match=r"`cu_seqlens_cpu` must be a torch.Tensor, got list"):
        chunk_kda(**x, use_graph=True, cu_seqlens_cpu=[0, 5, 9])  # checked as a host copy, then not used
    with pytest.raises(ValueError, match=r"`cu_seqlens_cpu` must be a CPU int tensor shaped like cu_seqlens \[3\]"):
        chunk_kda(**x, use_graph=True, cu_seqlens_cpu=torch.tensor([0, 9]))
    with pytest.raises(ValueError, match=r"`max_num_seqs` must be None or a non-negative int, got 2\.0"):
        chunk_kda(**x, use_graph=True, max_num_seqs=2.0)
    with pytest.raises(ValueError, match=r"hold max_num_seqs \+ 1 = 4 entries"):
        chunk_kda(**x, use_graph=True, max_num_seqs=np.int64(3))  # NumPy's ints are ints
    dense = make_inputs(Case(T=20), device=DEVICE, generator=rng)
    o1, _ = chunk_kda(**dense)
    o2, _ = chunk_kda(**dense, use_graph=True, max_num_seqs=7)
    assert torch.equal(o1, o2)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
def test_graph_mode_tables():
    """The device-built chunk tables hold the host-built ones first, then slots past the end of
    sequence N + 1, the one-token sequence appended to the boundaries."""
    from fastkda.backends.triton.common import chunk_tables, chunk_tables_static, graph_seqlens

    for cu, T, bad in (([0], 0, False), ([0], 9, False), ([0, 5, 3, 9], 9, True), ([1, 5], 9, True), ([0, 10], 9, True)):
        ext, flag = graph_seqlens(torch.tensor(cu), T)
        assert bool(flag) == bad and (ext[1:len(cu)] >= ext[:len(cu) - 1]).all() and ext.max() <= max(T, 1)
        ci, co, nt = chunk_tables_static(ext, len(cu) - 1, T, 64)
        assert ci.shape == (nt, 2) and co.shape == (len(cu),)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        N = int(torch.randint(1, 7, (1,), generator=g))
        lens = torch.randint(0, 150, (N,), generator=g)
        lens[torch.rand(N, generator=g) < 0.3] = 0
        T = int(lens.sum()) + int(torch.randint(0, 70, (1,), generator=g))
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        for C in (32, 64):
            ext, bad = graph_seqlens(cu, T)
            assert not bad and ext[:N + 1].tolist() == cu.tolist() and ext[N + 1:].tolist() == [0, 1]
            ci, co, nt = chunk_tables_static(ext, N, T, C)
            ci_h, co_h, nt_h = chunk_tables(cu, C, "cpu")
            assert nt == (-(-T // C) + N - 1 if T else 0) and nt >= nt_h
            assert torch.equal(ci[:nt_h], ci_h) and torch.equal(co, co_h)
            assert (ci[nt_h:] == torch.tensor([N + 1, 1], dtype=torch.int32)).all()


@pytest.mark.gpu
def test_graph_mode_cuda_graph_replay(rng):
    """A CUDA graph of a training step (forward and backward), replayed with new boundaries written
    into the captured tensor, matches eager calls with those boundaries."""
    case = grow(Case(seqlens=(30, 20, 50), gate="safe", l2norm=True, dtype=torch.bfloat16, initial_state=False), True)
    x = make_inputs(case, device="cuda", generator=rng)
    T = x["q"].shape[1]
    cu = torch.zeros(5, dtype=torch.int32, device="cuda")
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    do = torch.randn(x["v"].shape, generator=rng).to(x["v"])

    def step():
        o, _ = chunk_kda(**{**x, **leaves, "cu_seqlens": cu}, use_graph=True, max_num_seqs=4)
        return (o, *torch.autograd.grad(o, list(leaves.values()), do))

    def set_lens(lens):
        b = [0, *torch.tensor(lens).cumsum(0).tolist()]
        cu.copy_(torch.tensor(b + [b[-1]] * (5 - len(b)), dtype=torch.int32))

    set_lens((T // 3, T // 3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for lens in ((T // 2, 0, T - T // 2), (7, 100, 3, T - 200), (T - 1,)):
        set_lens(lens)
        graph.replay()
        want = step()
        for a, b in zip(outs, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_mode_intermediate_states(backend, rng):
    """return_intermediate_states with use_graph: h has one slot per chunk slot of the fixed-size
    tables, the real chunks' states first (as without use_graph), zeros after them."""
    case = grow(Case(seqlens=(3, 70, 0, 33), state_v_first=True), GPU)
    x = make_inputs(case, device=DEVICE, generator=rng)
    y, n = padded(x, rng)
    with torch.inference_mode(), use_backend(backend):
        _, _, h = chunk_kda(**x, return_intermediate_states=True)
        _, _, hg = chunk_kda(**y, return_intermediate_states=True, use_graph=True)
    T, N, C = y["q"].shape[1], len(case.seqlens) + EMPTY_TAILS, case.chunk_size
    assert hg.shape == (1, -(-T // C) + N - 1, *h.shape[2:])
    check("h", hg[:, :h.shape[1]], h, 1e-6)
    assert torch.equal(hg[:, h.shape[1]:], torch.zeros_like(hg[:, h.shape[1]:]))


def test_graph_mode_not_with(rng):
    """use_graph with context parallelism or under torch.compile: errors naming it."""
    from fastkda.distributed import CPContext

    x = make_inputs(Case(seqlens=(5, 4), initial_state=False, final_state=False), device=DEVICE, generator=rng)
    cp = CPContext(cu_seqlens=x["cu_seqlens"].tolist(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="use_graph"):
        chunk_kda(**{**x, "cu_seqlens": None}, cp_context=cp, use_graph=True)
    compiled = torch.compile(lambda: chunk_kda(**x, use_graph=True), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="use_graph"):
        compiled()


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
def test_graph_mode_disable_recompute(backend, rng):
    """disable_recompute=True keeps the forward's intermediates for the backward under use_graph
    too: the same outputs and gradients as recomputing them."""
    case = grow(Case(seqlens=(3, 70, 0, 33), gate="safe", l2norm=True, dtype=torch.bfloat16, initial_state=False,
                     final_state=True), GPU)
    y, _ = padded(make_inputs(case, device=DEVICE, generator=rng), rng)
    runs = []
    for keep in (False, True):
        leaves = leaves_of(dict(y))
        with use_backend(backend):
            o, s = chunk_kda(**{**y, **leaves}, use_graph=True, disable_recompute=keep)
        runs.append((o, s, *torch.autograd.grad((o.float() ** 2).sum() + s.sum(), list(leaves.values()))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
