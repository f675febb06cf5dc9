"""State pools under fused_recurrent_kda: the decode kernel never touches memory outside the
pool's slots, whatever the index check decides; bad and padding slots write nothing; duplicate
live slots are reported like bad ones; concurrent calls keep their own check; the default call
does not synchronise; a pool whose slots overlap in memory is refused before anything runs."""

import contextlib
import re
import sys
import threading

import pytest
import torch
from conftest import DEVICE, GPU
from torch.utils._python_dispatch import TorchDispatchMode

from fastkda import decode_error, explain, fused_recurrent_kda, use_backend
from fastkda.backends import backends
from fastkda.testing import Case, make_inputs, poisoned

BACKENDS = [b.name for b in backends() if "fused_recurrent_kda" in b.ops]
TRITON = pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
HV, K, V = 2, 16, 16
GUARD = 2  # rows of the wider tensor before and after the pool


def _inputs(rng, **kw):
    case = Case(H=1, HV=HV, K=K, V=V, initial_state=False, final_state=False, **({"B": 2, "T": 1} | kw))
    return make_inputs(case, device=DEVICE, generator=rng)


def _guarded_pool(num_slots, rng):
    """(wide, pool): pool is the contiguous view wide[GUARD:GUARD + num_slots] of a wider tensor
    whose other rows hold NaN (the guard region)."""
    wide = torch.full((num_slots + 2 * GUARD, HV, K, V), float("nan"))
    wide[GUARD:GUARD + num_slots] = torch.randn(num_slots, HV, K, V, generator=rng)
    wide = wide.to(DEVICE)
    return wide, wide[GUARD:GUARD + num_slots]


def _same_bits(a, b) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _guard_intact(wide, before) -> bool:
    return _same_bits(wide[:GUARD], before[:GUARD]) and _same_bits(wide[-GUARD:], before[-GUARD:])


def _slots_changed(pool, before) -> set:
    return {s for s in range(pool.shape[0]) if not _same_bits(pool[s], before[s])}


@TRITON
def test_kernel_bounds_slots_whatever_the_check_decides(rng, tune):
    """With the index check switched off, the decode kernel still writes only slots in
    [0, num_slots): a slot past the pool, below it or -1 (padding) reads and writes nothing and
    gives zero output; the other sequences of the call are written."""
    S = 6
    wide, pool = _guarded_pool(S, rng)
    x = _inputs(rng, B=5)
    with use_backend("triton"):
        fused_recurrent_kda(**_inputs(rng), initial_state=pool.clone(), ssm_state_indices=torch.tensor([0, 1], device=DEVICE),
                            inplace_final_state=True, raise_on_bad_index=False)  # a good call first
        tune(decode_slot_check=False)
        before = wide.clone()
        idx = torch.tensor([S, -1, 2, -2, S + 1], device=DEVICE)
        o, _ = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx, inplace_final_state=True,
                                   raise_on_bad_index=False)
    assert _guard_intact(wide, before), "a slot outside the pool was written"
    assert _slots_changed(pool, before[GUARD:GUARD + S]) == {2}
    assert o[2].abs().sum() > 0 and not o[[0, 1, 3, 4]].any() and torch.isfinite(o).all()
    decode_error(DEVICE)


@TRITON
def test_kernel_bounds_speculative_slots_whatever_the_check_decides(rng, tune):
    """Speculative decoding with the index check switched off: a start slot past the pool makes
    the sequence padding (nothing read or written), a draft slot past the pool is not written, and
    tokens past the row's 1 + num_draft columns write nothing (the index row is not read past its
    end: the index tensor is a view whose next row names slot 0)."""
    S = 8
    wide, pool = _guarded_pool(S, rng)
    x = _inputs(rng, seqlens=(2, 2, 1, 3))
    table = torch.tensor([[1, 2], [3, S + 1], [4, S], [5, 6], [0, 0]], device=DEVICE)
    idx = table[:4]
    acc = torch.tensor([1, 1, 2, 1], device=DEVICE)
    tune(decode_slot_check=False)
    before = wide.clone()
    with use_backend("triton"):
        o, _ = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=acc,
                                   inplace_final_state=True, raise_on_bad_index=False)
    assert _guard_intact(wide, before), "a slot outside the pool was written"
    assert _slots_changed(pool, before[GUARD:GUARD + S]) == {1, 2, 3, 5, 6}
    assert not o[0, 4].any() and o[0, 5:].abs().sum() > 0 and torch.isfinite(o).all()
    decode_error(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_slot_in_a_view_of_a_wider_tensor(backend, rng):
    """A slot just past the pool (a view of a wider tensor) with raise_on_bad_index=False: nothing
    of the wider tensor changes, the outputs are zero and decode_error() names the sequence (the
    PyTorch backend raises instead)."""
    S = 4
    wide, pool = _guarded_pool(S, rng)
    x = _inputs(rng, B=3)
    before = wide.clone()
    decode_error(DEVICE)
    with use_backend(backend):
        if backend == "torch":
            with pytest.raises(ValueError, match=rf"`ssm_state_indices` holds slot {S} at \[2\]"):
                fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=torch.tensor([1, -1, S], device=DEVICE),
                                    inplace_final_state=True, raise_on_bad_index=False)
        else:
            o, _ = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=torch.tensor([1, -1, S], device=DEVICE),
                                       inplace_final_state=True, raise_on_bad_index=False)
            assert torch.equal(o, torch.zeros_like(o))
            assert "sequence 2 holds a slot outside the pool" in decode_error(DEVICE)
    assert _same_bits(wide, before)


BAD_SEQLENS = {  # cu_seqlens of 5 tokens in 3 sequences, and the first sequence they break
    "decreasing": ([0, 3, 2, 5], 1),
    "ends_before_T": ([0, 2, 3, 4], 2),
    "starts_after_0": ([1, 2, 3, 5], 0),
    "ends_after_T": ([0, 2, 3, 6], 2),
}


def _device_seqlens(monkeypatch):
    """On the CPU tier, the host's own check of cu_seqlens values bypassed, so that the decode
    kernel sees them as it would on a GPU (where the host does not read them)."""
    import fastkda.options

    if not GPU:
        monkeypatch.setattr(fastkda.options, "host_values", lambda cu, given, T: cu.to(torch.int64))


@TRITON
@pytest.mark.parametrize("programs", ["per_tile", "looping"])
@pytest.mark.parametrize("pooled", [True, False])
@pytest.mark.parametrize("name", list(BAD_SEQLENS))
def test_bad_cu_seqlens_values_on_the_device(name, pooled, programs, rng, check_path, tune, monkeypatch):
    """cu_seqlens values on the device are checked there (the call does not synchronise): bad
    ones, with a pool or per-sequence states, write no state, give zeros in every output row
    (also rows no sequence covers) and a final state of zeros; decode_error() names the sequence,
    raise_on_bad_index=True raises. "looping": two programs loop over the call's six tiles, and a
    check kernel takes two sequences per step."""
    from fastkda.backends.triton.plan import DecodeLaunch

    _device_seqlens(monkeypatch)
    if programs == "looping":
        tune(sm_count=1, decode_f32=DecodeLaunch(64, 2, 1, 2), decode_check_rows=2)
    vals, n = BAD_SEQLENS[name]
    x = _inputs(rng, B=1, seqlens=(2, 1, 2))
    del x["output_final_state"]
    x["cu_seqlens"] = torch.tensor(vals, dtype=torch.int32, device=DEVICE)
    if pooled:
        state = torch.randn(4, HV, K, V, generator=rng).to(DEVICE)
        kw = dict(initial_state=state, ssm_state_indices=torch.tensor([3, 0, 2], device=DEVICE),
                  inplace_final_state=True)
    else:
        state = torch.randn(3, HV, K, V, generator=rng).to(DEVICE)
        kw = dict(initial_state=state, output_final_state=True)
    before = state.clone()
    decode_error(DEVICE)
    rule = "`cu_seqlens` must start at 0, be non-decreasing and end at"
    with use_backend("triton"):
        o, final = fused_recurrent_kda(**x, **kw)
        assert torch.equal(o, torch.zeros_like(o))
        if pooled:
            assert _same_bits(state, before)
        else:
            assert torch.equal(final, torch.zeros_like(final)) and _same_bits(state, before)
        assert decode_error(DEVICE) == f"{rule} the total length T: not so at sequence {n}"
        raised = f"{rule} T=5: not so at sequence {n} (cu_seqlens[{n}]={vals[n]}, "
        with pytest.raises(ValueError, match=re.escape(raised)):
            fused_recurrent_kda(**x, **kw, raise_on_bad_index=True)
        assert _same_bits(state, before)
        x["cu_seqlens"] = torch.tensor([0, 2, 3, 5], dtype=torch.int32, device=DEVICE)  # the same call, good
        o, _ = fused_recurrent_kda(**x, **kw)
        assert torch.isfinite(o).all() and o.abs().sum() > 0
    assert decode_error(DEVICE) is None


@TRITON
def test_cu_seqlens_past_t_in_speculative_decoding(rng, check_path, monkeypatch):
    """A boundary past T is reported as such, not as the token count it gives its sequence (more
    than the index row's columns)."""
    _device_seqlens(monkeypatch)
    x = _inputs(rng, B=1, seqlens=(1, 1))
    del x["output_final_state"]
    x["cu_seqlens"] = torch.tensor([0, 3, 2], dtype=torch.int32, device=DEVICE)
    pool = torch.randn(4, HV, K, V, generator=rng).to(DEVICE)
    before = pool.clone()
    kw = dict(initial_state=pool, ssm_state_indices=torch.tensor([[0, 1], [2, 3]], device=DEVICE),
              num_accepted_tokens=torch.tensor([1, 1], device=DEVICE), inplace_final_state=True)
    match = r"`cu_seqlens` must start at 0, .*not so at sequence 0 \(cu_seqlens\[0\]=0, cu_seqlens\[1\]=3\)"
    with use_backend("triton"), pytest.raises(ValueError, match=match):
        fused_recurrent_kda(**x, **kw, raise_on_bad_index=True)
    assert _same_bits(pool, before)


def test_cu_seqlens_of_no_sequences_with_tokens(rng, monkeypatch):
    """cu_seqlens = [0] (no sequence) with tokens: no sequence's program could check it on the
    device, so the host refuses it from the shapes (here with the host's value check bypassed,
    as for a GPU cu_seqlens)."""
    _device_seqlens(monkeypatch)
    x = _inputs(rng, B=1, seqlens=(2, 3))
    x["cu_seqlens"] = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    for backend in BACKENDS:
        match = r"`cu_seqlens` of no sequences \(\[0\]\) needs T = 0 tokens, got T=5"
        with use_backend(backend), pytest.raises(ValueError, match=match):
            fused_recurrent_kda(**x)


@TRITON
def test_concurrent_calls_keep_their_own_check(rng, monkeypatch):
    """Several threads decode on one pool at once (one thread's calls name a slot past the pool):
    every good call gives what it gives alone, the bad calls touch nothing (in the pool or around
    it) and decode_error() names the bad call. On the CPU tier kernel launches take turns (the
    Triton interpreter runs one at a time, like a stream), interleaved between threads; on a GPU
    every thread has its own stream."""
    S, workers, steps = 6, 4, 4
    wide, pool = _guarded_pool(S, rng)
    inputs = [[_inputs(rng) for _ in range(steps)] for _ in range(workers)]
    idx = [torch.tensor([0, S] if w == 0 else [w, -1], device=DEVICE) for w in range(workers)]  # worker 0: bad
    with use_backend("triton"):
        serial = wide.clone()
        want = [[fused_recurrent_kda(**x, initial_state=serial[GUARD:GUARD + S], ssm_state_indices=idx[w],
                                     inplace_final_state=True, raise_on_bad_index=False)[0] for x in inputs[w]]
                for w in range(workers)]
    assert all(not o.any() for o in want[0])
    assert "sequence 1 holds" in decode_error(DEVICE)
    before = wide.clone()

    if not GPU:
        from triton.runtime import interpreter

        lock, run = threading.Lock(), interpreter.GridExecutor.__call__

        def one_at_a_time(self, *args, **kwargs):
            with lock:
                return run(self, *args, **kwargs)

        monkeypatch.setattr(interpreter.GridExecutor, "__call__", one_at_a_time)
    streams = [torch.cuda.Stream() for _ in range(workers)] if GPU else [None] * workers
    for s in streams:
        if s is not None:
            s.wait_stream(torch.cuda.current_stream())
    got = [[] for _ in range(workers)]
    failures = []
    start = threading.Barrier(workers)

    def work(w):
        try:
            stream = torch.cuda.stream(streams[w]) if GPU else contextlib.nullcontext()
            with use_backend("triton"), stream, poisoned():  # poisoning is per thread
                start.wait()
                for x in inputs[w]:
                    got[w].append(fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx[w],
                                                      inplace_final_state=True, raise_on_bad_index=False)[0])
        except Exception as e:  # noqa: BLE001 (re-raised below)
            failures.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    if GPU:
        torch.cuda.synchronize()
    if failures:
        raise failures[0]
    assert _guard_intact(wide, before), "a slot outside the pool was written"
    assert _same_bits(wide, serial), "the pool differs from the serial run's"
    for w in range(workers):
        for step, (a, b) in enumerate(zip(got[w], want[w])):
            assert _same_bits(a, b), f"worker {w} step {step}: output differs from the serial run's"
    assert "sequence 1 holds" in decode_error(DEVICE)
    assert decode_error(DEVICE) is None


DUPLICATES = {  # (indices, accepted, tokens per sequence, the error's words): two live sequences touch one slot
    "decode": ([0, 0], None, None, r"sequence 0 shares pool slot 0 with sequence 1 \(0 and 0\)"),
    "decode_padding_between": ([2, -1, 2], None, None, r"sequence 0 shares pool slot 2 with sequence 2 \(2 and 2\)"),
    "draft_slots": ([[0, 1], [2, 1]], [1, 1], (2, 2),
                    r"sequence 0 shares pool slot 1 with sequence 1 \(\[0, 1\] and \[2, 1\]\)"),
    "start_and_draft": ([[0, 1], [3, 0]], [2, 1], (1, 2),
                        r"sequence 0 shares pool slot 0 with sequence 1 \(\[0, 1\] and \[3, 0\]\)"),
}


@TRITON
@pytest.mark.parametrize("name", list(DUPLICATES))
def test_duplicate_live_slots_are_reported(name, rng, check_path):
    """Two sequences of one in-place call that read or write the same slot: reported like a bad
    slot (the call changes nothing and returns zeros; decode_error() names the sequence, or with
    raise_on_bad_index=True a ValueError naming the slot)."""
    idx, acc, lens, words = DUPLICATES[name]
    x = _inputs(rng, B=len(idx)) if lens is None else _inputs(rng, seqlens=lens)
    kw = dict(ssm_state_indices=torch.tensor(idx, device=DEVICE), inplace_final_state=True)
    if acc is not None:
        kw["num_accepted_tokens"] = torch.tensor(acc, device=DEVICE)
    pool = torch.randn(5, HV, K, V, generator=rng).to(DEVICE)
    before = pool.clone()
    decode_error(DEVICE)
    with use_backend("triton"):
        o, _ = fused_recurrent_kda(**x, initial_state=pool, **kw)
        assert torch.equal(pool, before) and torch.equal(o, torch.zeros_like(o))
        assert "shares a pool slot" in decode_error(DEVICE)
        with pytest.raises(ValueError, match=r"`ssm_state_indices`: " + words):
            fused_recurrent_kda(**x, initial_state=pool, **kw, raise_on_bad_index=True)
    assert torch.equal(pool, before)
    assert decode_error(DEVICE) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_slots_that_are_allowed(backend, rng, check_path):
    """Shared slots that are well defined: sequences that only read one slot (no in-place write)
    start from the same state; a slot named by another sequence in a column it does not touch; one
    sequence naming a slot twice in its row (the state after its later token wins)."""
    pool = torch.randn(5, HV, K, V, generator=rng).to(DEVICE)
    x = _inputs(rng)
    decode_error(DEVICE)
    x1 = {**x, **{n: x[n][:1].expand_as(x[n]) for n in ("q", "k", "v", "g", "beta")}, "output_final_state": True}
    with use_backend(backend):
        o, s = fused_recurrent_kda(**x1, initial_state=pool, ssm_state_indices=torch.tensor([3, 3], device=DEVICE))
        torch.testing.assert_close(o[0], o[1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(s[0], s[1], rtol=1e-6, atol=1e-6)
        assert o.abs().sum() > 0
        # row 0 touches slot 0 only (one token, starting from column 0); slot 1 belongs to row 1
        spec = dict(num_accepted_tokens=torch.tensor([1, 1], device=DEVICE), inplace_final_state=True)
        a, b = pool.clone(), pool.clone()
        o_a, _ = fused_recurrent_kda(**x, initial_state=a, ssm_state_indices=torch.tensor([[0, 1], [1, 2]], device=DEVICE), **spec)
        o_b, _ = fused_recurrent_kda(**x, initial_state=b, ssm_state_indices=torch.tensor([[0, -1], [1, 2]], device=DEVICE), **spec)
        assert torch.equal(o_a, o_b) and torch.equal(a, b) and not torch.equal(a, pool)
        # one sequence of two tokens naming slot 3 twice: slot 3 ends with the state after token 1
        y = _inputs(rng, B=1, T=2)
        spec1 = dict(num_accepted_tokens=torch.tensor([1], device=DEVICE), inplace_final_state=True)
        a, b = pool.clone(), pool.clone()
        o_a, _ = fused_recurrent_kda(**y, initial_state=a, ssm_state_indices=torch.tensor([[3, 3]], device=DEVICE), **spec1)
        o_b, _ = fused_recurrent_kda(**y, initial_state=b, ssm_state_indices=torch.tensor([[3, 4]], device=DEVICE), **spec1)
        assert torch.equal(o_a, o_b) and torch.equal(a[3], b[4])
    if backend == "triton":
        assert decode_error(DEVICE) is None


# the refusal names the argument, then the layout it was given
OVERLAP = r"`initial_state` is written in place .*overlap in memory \(shape \[\d+, 2, 16, 16\], stride \(0, "


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pooled", [True, False])
def test_overlapping_pool_written_in_place_is_refused(backend, pooled, rng):
    """An expanded (stride-0) state written in place: a ValueError naming `initial_state` before
    anything runs, also right after an in-place call on a dense state of the same shape (whose
    checked options are kept), and from explain(); read without the in-place write it works like
    its dense copy."""
    x = _inputs(rng)
    one = torch.randn(1, HV, K, V, generator=rng).to(DEVICE)
    state = one.expand(4 if pooled else 2, HV, K, V)
    one_before = one.clone()
    kw = dict(ssm_state_indices=torch.tensor([3, 1], device=DEVICE)) if pooled else {}
    with use_backend(backend):
        fused_recurrent_kda(**x, initial_state=state.clone(), inplace_final_state=True, **kw)
        with pytest.raises(ValueError, match=OVERLAP):
            fused_recurrent_kda(**x, initial_state=state, inplace_final_state=True, **kw)
        with pytest.raises(ValueError, match=OVERLAP):
            explain(fused_recurrent_kda, **x, initial_state=state, inplace_final_state=True, **kw)
        assert torch.equal(one, one_before)  # the refused calls wrote nothing
        x["output_final_state"] = True
        o, s = fused_recurrent_kda(**x, initial_state=state, **kw)
        o_d, s_d = fused_recurrent_kda(**x, initial_state=state.contiguous(), **kw)
    assert torch.equal(o, o_d) and torch.equal(s, s_d)


class _HostReads(TorchDispatchMode):
    """Records the operators that read tensor values back to the host (on a GPU each one is a
    synchronisation): item(), int(), bool(), equal, nonzero, ..."""

    READS = {"_local_scalar_dense", "equal", "is_nonzero", "nonzero", "masked_select", "unique_dim", "_unique2",
             "unique_consecutive", "repeat_interleave"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__ in self.READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@TRITON
@pytest.mark.parametrize("spec", [False, True])
def test_default_call_reads_nothing_back(spec, rng):
    """The default eager call (good or bad indices) reads no tensor value back to the host;
    raise_on_bad_index=True does (one read of the call's error code)."""
    x = _inputs(rng, B=3, T=2 if spec else 1)
    pool = torch.randn(6, HV, K, V, generator=rng).to(DEVICE)
    if spec:
        kw = dict(ssm_state_indices=torch.tensor([[0, 1], [2, 3], [4, 6]], device=DEVICE),
                  num_accepted_tokens=torch.tensor([1, 2, 1], device=DEVICE))
    else:
        kw = dict(ssm_state_indices=torch.tensor([0, 2, 6], device=DEVICE))
    with use_backend("triton"):
        fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, **kw)  # warm-up
        decode_error(DEVICE)
        with _HostReads() as probe:
            fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, **kw)
            fused_recurrent_kda(**x, initial_state=pool, **kw)
        assert probe.reads == []
        good = kw["ssm_state_indices"].clamp(max=5)
        with _HostReads() as probe:
            fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, raise_on_bad_index=True,
                                **{**kw, "ssm_state_indices": good})
        assert probe.reads, "the probe must see the read of raise_on_bad_index=True"
    assert "sequence 2 holds" in decode_error(DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [False, True])
def test_default_call_does_not_synchronise_gpu(spec, rng):
    """The default eager call makes no synchronising CUDA call (torch's sync debug mode raises on
    one); raise_on_bad_index=True makes one."""
    x = _inputs(rng, B=3, T=2 if spec else 1)
    pool = torch.randn(6, HV, K, V, device="cuda")
    if spec:
        kw = dict(ssm_state_indices=torch.tensor([[0, 1], [2, 3], [4, 6]], device="cuda"),
                  num_accepted_tokens=torch.tensor([1, 2, 1], device="cuda"))
    else:
        kw = dict(ssm_state_indices=torch.tensor([0, 2, 6], device="cuda"))
    fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, **kw)  # warm-up: compilation
    decode_error("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, **kw)
        fused_recurrent_kda(**x, initial_state=pool, **kw)
        with pytest.raises(RuntimeError, match="synchroniz"):
            fused_recurrent_kda(**x, initial_state=pool, inplace_final_state=True, raise_on_bad_index=True, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert "sequence 2 holds" in decode_error("cuda")


@pytest.mark.gpu
def test_duplicate_slots_in_a_cuda_graph(rng):
    """Duplicate live slots in a captured call: the replay changes nothing, returns zeros and
    decode_error() reports it; the same graph replayed with distinct slots written into the
    captured indices decodes."""
    x = _inputs(rng)
    pool = torch.randn(4, HV, K, V, device="cuda")
    idx = torch.tensor([1, 2], device="cuda")
    fused_recurrent_kda(**x, initial_state=pool.clone(), ssm_state_indices=idx, inplace_final_state=True)  # warm-up
    decode_error("cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, _ = fused_recurrent_kda(**x, initial_state=pool, ssm_state_indices=idx, inplace_final_state=True)
    idx.copy_(torch.tensor([3, 3]))
    before = pool.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pool, before) and not o.any()
    assert "sequence 0 shares a pool slot" in decode_error("cuda")
    idx.copy_(torch.tensor([3, 0]))
    graph.replay()
    torch.cuda.synchronize()
    assert decode_error("cuda") is None and o.abs().sum() > 0 and not torch.equal(pool, before)
