"""Context parallelism: gloo process groups of 2 and 4 ranks on this machine; forward and
backward equal the single-process run, ragged varlen batches crossing rank boundaries."""

import datetime
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GRAD_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, lens, seed, backend_name, grads, errfile, fused_max, subgroups, dtype):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))  # a mismatch fails instead of hanging
        # `subgroups` context-parallel groups of consecutive ranks (as in a data x context parallel
        # mesh), each over its own batch; every rank creates every group
        size = world // subgroups
        groups = [dist.new_group(list(range(i * size, (i + 1) * size))) for i in range(subgroups)]
        group, seed = groups[rank // size], seed + 7 * (rank // size)
        from fastkda import chunk_kda, use_backend
        from fastkda.distributed import CPContext
        from fastkda.testing import Case, make_inputs, rel_rms
        from helpers import gate_param_scales, param_error

        case = Case(seqlens=tuple(lens), H=1, HV=2, K=16, V=24, gate="softplus", l2norm=True, beta_sigmoid=True,
                    initial_state=False, final_state=False, dtype=dtype)
        x = make_inputs(case, generator=torch.Generator().manual_seed(seed), requires_grad=grads)
        cu = x.pop("cu_seqlens")
        x.pop("output_final_state")
        T = int(cu[-1])
        do = torch.randn(1, T, 2, 24, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
        # the single-process run on the whole batch, in float64
        names = [n for n in GRAD_NAMES if isinstance(x.get(n), torch.Tensor)]
        x64 = {n: (t.detach().double().requires_grad_(grads) if n in names else t) for n, t in x.items()}
        with use_backend("torch"):
            o_full, _ = chunk_kda(**x64, cu_seqlens=cu)
        if grads:
            full = torch.autograd.grad((o_full * do.double()).sum(), [x64[n] for n in names])
            scales = gate_param_scales(x, full[names.index("g")])
        # compiled Triton kernels want CUDA tensors (every rank on the one GPU; gloo moves CUDA tensors too)
        dev = "cuda" if backend_name == "triton" and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
        # fused_max: the identity run as a call of its own instead of extra value columns
        ctx = CPContext(group=group, cu_seqlens=cu.to(dev),
                        **({} if fused_max is None else dict(fused_max_columns=fused_max)))
        assert ctx.world_size == size
        lo, hi = ctx.lo, ctx.hi
        shard = {n: (t.detach()[:, lo:hi].to(dev).requires_grad_(grads) if n in ("q", "k", "v", "g", "beta")
                     else (t.detach().to(dev).requires_grad_(grads) if isinstance(t, torch.Tensor) else t))
                 for n, t in x.items()}
        with use_backend(backend_name):
            o, s = chunk_kda(**shard, cp_context=ctx)
        assert s is None
        err = rel_rms(o.cpu(), o_full[:, lo:hi].detach())
        assert err < 2e-5, f"rank {rank}: output error {err:.2e}"
        if grads:
            got = torch.autograd.grad((o * do[:, lo:hi].to(dev)).sum(), [shard[n] for n in names])
            for n, gl, gf in zip(names, [t.cpu() for t in got], full):
                if n in ("A_log", "dt_bias"):  # shared parameters: the ranks' gradients add up
                    gl = gl.clone()
                    dist.all_reduce(gl, group=group)
                    err = param_error(gl, gf, scales[n])  # see gate_param_scales
                else:
                    err = rel_rms(gl, gf[:, lo:hi])
                assert err < 5e-5, f"rank {rank}: d{n} error {err:.2e}"
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(errfile, "a") as f:
            f.write(f"rank {rank}:\n{traceback.format_exc()}\n")
        raise
    # leave without running the interpreter's teardown: gloo's background threads occasionally
    # abort the process there ("terminate called without an active exception") after all work is done
    os._exit(0)


def _spawn(world, lens, backend="torch", grads=True, tmp_path=None, fused_max=None, subgroups=1, dtype=torch.float32):
    errfile = str(tmp_path / "err.txt")
    seed = int(os.environ.get("FASTKDA_TEST_SEED") or int.from_bytes(os.urandom(3), "little"))
    try:
        mp.spawn(_worker, args=(world, _free_port(), lens, seed, backend, grads, errfile, fused_max, subgroups, dtype),
                 nprocs=world, join=True)
    except Exception as e:
        msg = open(errfile).read() if os.path.exists(errfile) else ""
        pytest.fail(f"seed={seed} lens={lens}: {type(e).__name__}: {e}\n{msg}")


@pytest.mark.parametrize(
    "world,lens",
    [
        (2, [37, 90, 1]),            # one sequence crosses the boundary, the shard start is mid-sequence
        (2, [64, 64]),               # a sequence starts exactly at the boundary
        (4, [5, 150, 0, 60, 41]),    # a sequence spans two whole shards (carried through a rank)
        (4, [256]),                  # one sequence over all ranks
    ],
)
def test_cp_gloo_forward_backward(world, lens, tmp_path):
    _spawn(world, lens, tmp_path=tmp_path)


@pytest.mark.parametrize("world,lens", [(2, [37, 90, 1]), (4, [5, 150, 0, 60, 41])])
def test_cp_identity_run_separate(world, lens, tmp_path):
    """V + K above the fused width: the identity run goes as a call of its own, same results (the
    default case [5, 150, 0, 60, 41] over 4 ranks takes both ways: rank 1's first segment spans its
    shard, rank 2's covers 27 of 64 tokens)."""
    _spawn(world, lens, tmp_path=tmp_path, fused_max=0)


def test_cp_subgroups(tmp_path):
    """Two context-parallel groups of two ranks each (ranks 0-1 and 2-3, each group over its own
    batch): group-local ranks in the exchange and its backward."""
    _spawn(4, [37, 90, 1], tmp_path=tmp_path, subgroups=2)


def test_cp_float64(tmp_path):
    """float64 inputs (the PyTorch backend): the carried states and the exchange stay float64."""
    _spawn(2, [37, 90, 1], tmp_path=tmp_path, dtype=torch.float64)


def test_cp_gloo_triton(tmp_path):
    """The Triton backend (interpreter) serves the ranks' forward and backward."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs a GPU or the interpreter")
    _spawn(2, [50, 30, 48], backend="triton", grads=True, tmp_path=tmp_path)


def test_torchrun_example_and_exchange_volume():
    """The documented torchrun example runs (gloo, 2 ranks) and reports HV*K*(K+V)*4 bytes per rank."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.path.join(root, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         os.path.join(root, "examples", "context_parallel.py")],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    H, K, V = 4, 64, 64
    assert f"{H * K * (K + V) * 4} B sent, {H * K * (K + V) * 4} B received" in out.stdout, out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more GPUs")
def test_cp_nccl_example():
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    n = min(torch.cuda.device_count(), 8)
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
         os.path.join(root, "examples", "context_parallel.py"), "--cuda", "--seqlens", "7000,1000,192"],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
