"""The values of cu_seqlens: read on every call (seqlens.host_seqlens), or taken from
cu_seqlens_cpu; what is derived from them (chunk tables) is kept by the values themselves
(seqlens.seqlens_derived), so a tensor whose values change, however they were written, gets its
new values' results."""

import sys
import threading

import pytest
import torch
from conftest import BACKENDS, BACKWARD_BACKENDS, DEVICE, GPU
from helpers import check, grow, tol_for

from fastkda import chunk_kda, options, seqlens, use_backend
from fastkda.testing import Case, make_inputs, reference


@pytest.fixture(autouse=True)
def fresh_cache():
    seqlens.clear_cache()
    yield
    seqlens.clear_cache()


def test_host_copy_read_every_call():
    cu = torch.tensor([0, 3, 7, 12], dtype=torch.int32, device=DEVICE)
    a = seqlens.host_seqlens(cu)
    assert a.dtype == torch.int64 and a.device.type == "cpu" and a.tolist() == [0, 3, 7, 12]
    b = seqlens.host_seqlens(cu)
    assert b is not a and b.tolist() == a.tolist()
    cu.data[2] = 8  # behind the version counter's back
    assert seqlens.host_seqlens(cu).tolist() == [0, 3, 8, 12] and a.tolist() == [0, 3, 7, 12]
    with torch.inference_mode():
        inf = torch.tensor([0, 2, 5], device=DEVICE)
    assert seqlens.host_seqlens(inf).tolist() == [0, 2, 5]


def test_host_copy_never_aliases_a_cpu_tensor():
    cu = torch.tensor([0, 4, 9])
    assert seqlens.host_seqlens(cu).data_ptr() != cu.data_ptr()


def test_derived_kept_by_values():
    """seqlens_derived keeps make()'s result under the values and the key: equal values (of any
    tensor) share it, other values or another key make a new one, a failure is not kept, and the
    number of entries is bounded."""
    made = []

    def make(tag):
        return lambda: made.append(tag) or object()

    a = seqlens.seqlens_derived(torch.tensor([0, 3, 7]), ("k", 1), make("a"))
    assert seqlens.seqlens_derived(torch.tensor([0, 3, 7], dtype=torch.int32), ("k", 1), make("b")) is a
    assert seqlens.seqlens_derived(torch.tensor([0, 3, 8]), ("k", 1), make("c")) is not a
    assert seqlens.seqlens_derived(torch.tensor([0, 3, 7]), ("k", 2), make("d")) is not a
    assert made == ["a", "c", "d"]

    def fail():
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        seqlens.seqlens_derived(torch.tensor([0, 1]), ("k",), fail)
    assert seqlens.seqlens_derived(torch.tensor([0, 1]), ("k",), lambda: 5) == 5
    for n in range(2 * seqlens.DERIVED_ENTRIES):
        seqlens.seqlens_derived(torch.tensor([0, n]), ("k",), make(n))
    assert seqlens.cache_size() == seqlens.DERIVED_ENTRIES


def test_values_checked_every_call():
    """The value check runs on every call, on the values read then (or on cu_seqlens_cpu's): the
    same values are judged again against each call's length."""
    ref = torch.zeros(1, device=DEVICE)
    cu = torch.tensor([0, 3, 7, 12], device=DEVICE)
    for _ in range(2):
        n, host = options.cu_seqlens_checked(cu, None, 1, 12, ref, True)
        assert n == 3 and host.tolist() == [0, 3, 7, 12]
    with pytest.raises(ValueError, match="end at the total length T=13, got 12"):
        options.cu_seqlens_checked(cu, None, 1, 13, ref, True)
    cu.data[3] = 13
    with pytest.raises(ValueError, match="end at the total length T=12, got 13"):
        options.cu_seqlens_checked(cu, None, 1, 12, ref, True)
    mine = torch.tensor([0, 3, 7, 13])
    n, host = options.cu_seqlens_checked(cu, mine, 1, 13, ref, True)
    assert host.tolist() == [0, 3, 7, 13] and host is not mine  # a copy: the caller may write to its own
    with pytest.raises(ValueError, match="end at the total length T=14, got 13"):
        options.cu_seqlens_checked(cu, mine, 1, 14, ref, True)
    assert options.cu_seqlens_checked(cu, mine, 1, 14, ref, False) == (3, None)  # never read, never checked


def test_values_checked_where_no_device_read():
    """check_values=None (decoding, the layer): the values are checked where that needs no device
    read: a CPU cu_seqlens, or its host copy cu_seqlens_cpu; a device cu_seqlens alone, shapes only."""
    meta = torch.zeros(1, device="meta")
    cu = torch.tensor([0, 3, 7], device="meta")  # off the CPU, without values
    with seqlens.no_device_reads():
        assert options.cu_seqlens_checked(cu, None, 1, 7, meta, None) == (2, None)
        n, host = options.cu_seqlens_checked(cu, torch.tensor([0, 3, 7]), 1, 7, meta, None)
        assert n == 2 and host.tolist() == [0, 3, 7]
        with pytest.raises(ValueError, match="end at the total length T=8, got 7"):
            options.cu_seqlens_checked(cu, torch.tensor([0, 3, 7]), 1, 8, meta, None)
    with pytest.raises(ValueError, match="non-decreasing, got 4 then 3 at index 2"):
        options.cu_seqlens_checked(torch.tensor([0, 4, 3, 7]), None, 1, 7, torch.zeros(1), None)


def test_no_device_reads():
    """Inside seqlens.no_device_reads() (this thread only; blocks nest), reading back a cu_seqlens
    that is not on the CPU raises; a CPU one is read as ever."""
    cpu = torch.tensor([0, 2, 5])
    off_cpu = cpu.to("meta")  # off the CPU, without values: reading it fails anyway, refused only in a block

    def refusal(t):
        try:
            seqlens.host_seqlens(t)
        except (RuntimeError, NotImplementedError) as e:
            return "no_device_reads" in str(e)
        return False

    assert not refusal(off_cpu)
    with seqlens.no_device_reads():
        with seqlens.no_device_reads():
            assert refusal(off_cpu)
        assert refusal(off_cpu) and seqlens.host_seqlens(cpu).tolist() == [0, 2, 5]
        other = []
        worker = threading.Thread(target=lambda: other.append(refusal(off_cpu)))
        worker.start()
        worker.join()
        assert other == [False]
    assert not refusal(off_cpu)


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
def test_chunk_tables_follow_the_values():
    from fastkda.backends.triton.common import chunk_tables

    cu = torch.tensor([0, 5, 5, 70], device=DEVICE)
    a = chunk_tables(seqlens.host_seqlens(cu), 64, DEVICE)
    assert chunk_tables(seqlens.host_seqlens(cu), 64, DEVICE) is a
    assert a[2] == 3 and a[0].tolist() == [[0, 0], [2, 0], [2, 1]] and a[1].tolist() == [0, 1, 1, 3]
    b = chunk_tables(seqlens.host_seqlens(cu), 32, DEVICE)
    assert b[2] == 4 and b[1].tolist() == [0, 1, 1, 4]
    cu.data[1] = 2  # behind the version counter's back
    c = chunk_tables(seqlens.host_seqlens(cu), 64, DEVICE)
    assert c is not a and c[0].tolist() == [[0, 0], [1, 0], [2, 0], [2, 1]] and c[1].tolist() == [0, 1, 2, 4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_boundaries_changed_in_place_between_calls(backend, rng):
    """The same cu_seqlens tensor, refilled in place between calls: every call follows (and checks)
    its own boundaries."""
    case = grow(Case(seqlens=(30, 20, 50), gate="softplus", initial_state=False, final_state=True), GPU)
    x = make_inputs(case, device=DEVICE, generator=rng)
    T = x["q"].shape[1]
    cu = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    for lens in ((T // 2, 0, T - T // 2), (1, T - 3, 2), (T - 5, 3, 2), (T // 2, 0, T - T // 2)):
        cu.copy_(torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32))
        with use_backend(backend):
            o, s = chunk_kda(**{**x, "cu_seqlens": cu})
        o_r, s_r = reference({**x, "cu_seqlens": cu.clone()})
        check("o", o, o_r, tol_for(case.dtype, backend))
        check("final_state", s, s_r, tol_for(case.dtype, backend))
    cu[1] = T + 1  # broken in place: checked again
    with use_backend(backend), pytest.raises(ValueError, match="non-decreasing"):
        chunk_kda(**{**x, "cu_seqlens": cu})


@pytest.mark.parametrize("how", ["data", "numpy"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_boundaries_written_behind_pytorchs_back_are_read(backend, how, rng):
    """Values written into cu_seqlens without advancing its version counter (through ``.data`` or
    a NumPy view, as a CUDA graph replay or a custom kernel does) are the ones the next call uses."""
    if how == "numpy" and DEVICE != "cpu":
        pytest.skip("a NumPy view needs a CPU tensor")
    case = grow(Case(seqlens=(30, 20, 50), gate="softplus", initial_state=False, final_state=True), GPU)
    x = make_inputs(case, device=DEVICE, generator=rng)
    T = x["q"].shape[1]
    cu = torch.tensor([0, 3 * T // 10, T // 2, T], device=DEVICE)
    new = torch.tensor([0, 7 * T // 10, 8 * T // 10, T])  # other chunks: the first sequence spans two
    with use_backend(backend):
        chunk_kda(**{**x, "cu_seqlens": cu})
        if how == "data":
            cu.data[1:3] = new[1:3].to(DEVICE)
        else:
            cu.numpy()[1:3] = new.numpy()[1:3]
        o, s = chunk_kda(**{**x, "cu_seqlens": cu})
    o_r, s_r = reference({**x, "cu_seqlens": new.to(DEVICE)})
    check("o", o, o_r, tol_for(case.dtype, backend))
    check("final_state", s, s_r, tol_for(case.dtype, backend))


def test_cpu_cu_seqlens_must_agree_with_cu_seqlens_cpu():
    """A CPU cu_seqlens is compared with the cu_seqlens_cpu given beside it (no copy is saved there)."""
    q = torch.randn(1, 12, 2, 8)
    x = dict(q=q, k=torch.randn_like(q), v=torch.randn(1, 12, 2, 4), g=-torch.rand(1, 12, 2, 8),
             beta=torch.rand(1, 12, 2))
    with pytest.raises(ValueError, match=r"`cu_seqlens` and `cu_seqlens_cpu` must hold the same values, "
                                         r"got cu_seqlens\[1\]=3 and cu_seqlens_cpu\[1\]=5"):
        chunk_kda(**x, cu_seqlens=torch.tensor([0, 3, 12]), cu_seqlens_cpu=torch.tensor([0, 5, 12]))
    o, _ = chunk_kda(**x, cu_seqlens=torch.tensor([0, 3, 12], dtype=torch.int32), cu_seqlens_cpu=torch.tensor([0, 3, 12]))
    assert o.shape == (1, 12, 2, 4)


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
def test_cu_seqlens_cpu_written_after_the_forward(backend, rng):
    """The call keeps its own copy of cu_seqlens_cpu: the caller refilling its buffer after the
    forward does not change the backward."""
    case = grow(Case(seqlens=(30, 20, 50), gate="softplus", initial_state=False, final_state=True), GPU)
    x = make_inputs(case, device=DEVICE, requires_grad=True, generator=rng)
    leaves = [x[n] for n in ("q", "k", "v", "g", "beta")]
    host = x["cu_seqlens"].cpu().long()
    with use_backend(backend):
        o, s = chunk_kda(**x)
        do, ds = torch.randn_like(o), torch.randn_like(s)
        want = torch.autograd.grad((o, s), leaves, (do, ds))
        o, s = chunk_kda(**x, cu_seqlens_cpu=host)
        host.copy_(torch.tensor([0, 0, 0, int(host[-1])]))  # tables of these values would leave out two sequences
        got = torch.autograd.grad((o, s), leaves, (do, ds))
    for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert torch.equal(a, b), n


def test_threads_share_the_derived_cache():
    """Many threads checking and laying out their own boundaries at once: every call gets its own
    values' results (no torn or stale entry, no error from the shared cache)."""
    ref = torch.zeros(1)
    errors, done = [], []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)

    def work(i):
        try:
            for r in range(1000):
                n = 1 + (i * 7 + r) % 40
                cu = torch.tensor([0, n, n + i + 1])
                N, host = options.cu_seqlens_checked(cu, None, 1, n + i + 1, ref, True)
                got = seqlens.seqlens_derived(host, ("lens",), lambda: tuple((host[1:] - host[:-1]).tolist()))
                assert N == 2 and got == (n, i + 1), (got, n, i)
            done.append(i)
        except Exception as e:  # reported below
            errors.append(repr(e))

    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:3]
    assert sorted(done) == list(range(8))


@pytest.mark.skipif(not GPU or "triton" not in BACKENDS, reason="GPU tier")
def test_varlen_call_with_host_boundaries_does_not_synchronize(rng):
    """Given cu_seqlens_cpu, a varlen call reads nothing back: no device synchronisation (the
    chunk tables of these values made by the first call)."""
    case = grow(Case(seqlens=(30, 20, 50), gate="safe", l2norm=True, dtype=torch.bfloat16, initial_state=False), True)
    x = make_inputs(case, device="cuda", generator=rng)
    host = x["cu_seqlens"].cpu()
    with use_backend("triton"), torch.no_grad():
        chunk_kda(**x, cu_seqlens_cpu=host)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            o, _ = chunk_kda(**x, cu_seqlens_cpu=host)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    check("o", o, reference(x)[0], tol_for(case.dtype, "triton"))
