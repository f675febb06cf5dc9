"""The host copy of cu_seqlens: read back once per tensor and reused while the tensor is unchanged
(options.host_seqlens); every change PyTorch can see is read again and checked again."""

import pytest
import torch
from conftest import BACKENDS, DEVICE, GPU
from helpers import check, grow, tol_for

from fastkda import chunk_kda, options, use_backend
from fastkda.testing import Case, make_inputs, reference


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(options, "_HOST_COPIES", type(options._HOST_COPIES)())


def test_host_copy_reused_until_the_tensor_changes():
    cu = torch.tensor([0, 3, 7, 12], dtype=torch.int32, device=DEVICE)
    a = options.host_seqlens(cu)
    assert a.dtype == torch.int64 and a.device.type == "cpu" and a.tolist() == [0, 3, 7, 12]
    assert options.host_seqlens(cu) is a  # unchanged: the same copy
    cu[2] = 8  # in place: a new version
    b = options.host_seqlens(cu)
    assert b is not a and b.tolist() == [0, 3, 8, 12] and a.tolist() == [0, 3, 7, 12]
    cu[1:3].copy_(torch.tensor([1, 2], dtype=torch.int32))  # through a view (shared version counter)
    assert options.host_seqlens(cu).tolist() == [0, 1, 2, 12]
    twin = cu.clone()  # equal values, another tensor
    assert options.host_seqlens(twin) is not options.host_seqlens(cu)
    cu.resize_(3)  # the same object, another shape
    assert options.host_seqlens(cu).tolist() == [0, 1, 2]


def test_values_checked_and_tables_built_once_per_copy(monkeypatch):
    """What a varlen call derives from the boundaries (the value check, the chunk tables) is kept
    with the host copy: done again for a changed tensor or another T, never kept for a copy the
    caller owns (cu_seqlens_cpu), nor for values that failed the check."""
    calls = []
    check = options.check_seqlens
    monkeypatch.setattr(options, "check_seqlens", lambda vals, T, **kw: calls.append(T) or check(vals, T, **kw))
    ref = torch.zeros(1, device=DEVICE)
    cu = torch.tensor([0, 3, 7, 12], device=DEVICE)
    for _ in range(3):
        n, host = options._cu_seqlens(cu, None, 1, 12, ref, True)
    assert n == 3 and calls == [12]
    made = []
    tables = [options.seqlens_derived(host, ("chunks", 4), lambda: made.append(1) or object()) for _ in range(2)]
    assert tables[0] is tables[1] and made == [1]
    with pytest.raises(ValueError, match="end at the total length"):
        options._cu_seqlens(cu, None, 1, 13, ref, True)  # another T: checked (and refused) again
    with pytest.raises(ValueError, match="end at the total length"):
        options._cu_seqlens(cu, None, 1, 13, ref, True)  # a failure is not kept
    assert calls == [12, 13, 13]
    cu[3] = 13  # in place: a new copy, checked again
    options._cu_seqlens(cu, None, 1, 13, ref, True)
    assert calls == [12, 13, 13, 13]
    mine = torch.tensor([0, 3, 7, 13])
    for _ in range(2):
        options._cu_seqlens(cu, mine, 1, 13, ref, True)
    assert calls == [12, 13, 13, 13, 13, 13]  # the caller's copy: every call


@pytest.mark.skipif("triton" not in BACKENDS, reason="no Triton")
def test_chunk_tables_follow_the_copy():
    from fastkda.backends.triton.common import chunk_tables

    cu = torch.tensor([0, 5, 5, 70], device=DEVICE)
    a = chunk_tables(options.host_seqlens(cu), 64, DEVICE)
    assert chunk_tables(options.host_seqlens(cu), 64, DEVICE) is a
    assert a[2] == 3 and a[0].tolist() == [[0, 0], [2, 0], [2, 1]] and a[1].tolist() == [0, 1, 1, 3]
    b = chunk_tables(options.host_seqlens(cu), 32, DEVICE)
    assert b[2] == 4 and b[1].tolist() == [0, 1, 1, 4]
    cu[1] = 2  # in place
    c = chunk_tables(options.host_seqlens(cu), 64, DEVICE)
    assert c is not a and c[0].tolist() == [[0, 0], [1, 0], [2, 0], [2, 1]] and c[1].tolist() == [0, 1, 2, 4]


def test_host_copy_never_aliases_a_cpu_tensor():
    cu = torch.tensor([0, 4, 9])
    host = options.host_seqlens(cu)
    assert host.data_ptr() != cu.data_ptr()


def test_host_copy_bounded_and_switchable(monkeypatch):
    tensors = [torch.tensor([0, n], device=DEVICE) for n in range(1, 12)]
    for t in tensors:
        options.host_seqlens(t)
    assert len(options._HOST_COPIES) == options.HOST_COPIES
    monkeypatch.setattr(options, "HOST_COPIES", 0)
    cu = tensors[-1]
    assert options.host_seqlens(cu) is not options.host_seqlens(cu)


def test_inference_tensors_read_every_call():
    with torch.inference_mode():
        cu = torch.tensor([0, 2, 5], device=DEVICE)
    a, b = options.host_seqlens(cu), options.host_seqlens(cu)
    assert a is not b and a.tolist() == b.tolist() == [0, 2, 5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_boundaries_changed_in_place_between_calls(backend, rng):
    """The same cu_seqlens tensor, refilled in place between calls: every call follows (and checks)
    its own boundaries, as if it were read back each time."""
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


@pytest.mark.skipif(not GPU or "triton" not in BACKENDS, reason="GPU tier")
def test_repeated_varlen_call_does_not_synchronize(rng):
    """The second call with the same cu_seqlens reads nothing back: no device synchronisation."""
    case = grow(Case(seqlens=(30, 20, 50), gate="safe", l2norm=True, dtype=torch.bfloat16, initial_state=False), True)
    x = make_inputs(case, device="cuda", generator=rng)
    with use_backend("triton"), torch.no_grad():
        chunk_kda(**x)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            o, _ = chunk_kda(**x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    check("o", o, reference(x)[0], tol_for(case.dtype, "triton"))
