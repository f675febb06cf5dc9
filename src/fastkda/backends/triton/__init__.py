"""Triton backend for NVIDIA GPUs; CPU tensors run in the Triton interpreter
(``TRITON_INTERPRET=1``) when this backend is forced, which is how the CPU test tier checks it.

A call's launches follow its plan (``plan.chunk_plan``, ``plan.decode_plan``; ``fastkda.explain``
prints it). Chunk forward: ``chunk_gates``, ``intra``, ``wy`` (stage 1), ``scan`` and ``output``
(``forward`` launches them); chunk backward: ``bwd_scan``, ``bwd_wy``, ``bwd_intra``, ``bwd_l2norm``
(``backward``), through ``function``; decoding: ``recurrent``; the gate operators: ``gate``.
Shared tile helpers: ``tiles``; locations, gate math and launching: ``common``.

The default for CUDA tensors on NVIDIA GPUs (priority above the PyTorch backend, which runs the
same math in many more launches). CPU tensors go to it only when it is forced
(``FASTKDA_BACKEND=triton`` or ``fastkda.use_backend("triton")``) under ``TRITON_INTERPRET=1``.
Speed against fla-core and FlashKDA: BENCHMARKS.md."""

from __future__ import annotations

import importlib

import torch

from ... import platform
from ..registry import Backend, forced_backend, needs_grad
from .function import chunk_forward, chunk_kda_autograd, chunk_kda_vjp, plan_of
from .plan import current_tuning, gate_plan, pow2
from .recurrent import decode_call_of, describe_error, recurrent_forward, take_error_code
from . import gate as gate_kernels

MAX_DIM = platform.TRITON_MAX_DIM
MAX_GATE_TILE = 64 * 256  # kda_gate_chunk_cumsum: a program holds a chunk, [C, pow2(K)]
KERNEL_MODULES = ("chunk_gates", "intra", "wy", "short", "scan", "output", "bwd_scan", "bwd_wy", "bwd_intra",
                  "bwd_l2norm", "recurrent", "gate")


def kernels() -> dict:
    """This backend's jitted kernels by name (for the tools that compile them or count their bytes)."""
    out = {}
    for m in KERNEL_MODULES:
        for obj in vars(importlib.import_module(f"{__name__}.{m}")).values():
            if hasattr(obj, "arg_names") and obj.fn.__name__.endswith("_kernel"):
                out[obj.fn.__name__] = obj
    return out


class TritonBackend(Backend):
    name = "triton"
    priority = 100
    ops = ("chunk_kda", "fused_recurrent_kda", "kda_gate", "kda_gate_chunk_cumsum")
    differentiable = ("kda_gate", "chunk_kda")

    def _device_ok(self, t: torch.Tensor) -> tuple[bool, str]:
        if t.device.type == "cuda":
            if not platform.IS_NVIDIA:
                return False, "CUDA device is not NVIDIA"
            return True, "NVIDIA GPU"
        if t.device.type == "cpu" and platform.triton_interpret():
            if forced_backend() == self.name:
                return True, "CPU tensors in the Triton interpreter (forced)"
            return False, "CPU tensors run in the Triton interpreter only when the triton backend is forced"
        return False, f"tensors on {t.device.type} (needs an NVIDIA GPU, or TRITON_INTERPRET=1 with CPU tensors)"

    def verify(self, op, opts, inputs):
        # wrapped tensors are made inside a transform; one that escaped it is refused by any kernel
        # launch all the same (no data pointer), only with torch's message
        if torch._C._are_functorch_transforms_active():
            wrapped = torch._C._functorch.is_functorch_wrapped_tensor
            for t in inputs:
                if isinstance(t, torch.Tensor) and wrapped(t):
                    return False, "torch.func transforms (grad, vjp, vmap): the kernels take plain tensors only"
        if op.startswith("kda_gate"):  # inputs: (g, A_log, dt_bias[, cu_seqlens, its host copy])
            ok, reason = self._device_ok(inputs[0])
            if not ok:
                return ok, reason
            if inputs[0].dtype == torch.float64:
                return False, "float64 inputs: the PyTorch backend serves them"
            K = inputs[0].shape[-1]
            if op == "kda_gate_chunk_cumsum" and opts.chunk_size * pow2(K, 1) > MAX_GATE_TILE:
                return False, (f"chunk_size={opts.chunk_size}, K={K}: the Triton cumulative sum holds a chunk in "
                               f"one program, at most {MAX_GATE_TILE} elements")
            return ok, reason
        ok, reason = self._device_ok(inputs.q)
        if not ok:
            return ok, reason
        if inputs.q.dtype == torch.float64:
            return False, "float64 inputs: the PyTorch backend serves them"
        s = opts.shape
        if s.K > MAX_DIM or s.V > MAX_DIM:
            return False, f"K={s.K}, V={s.V}: the Triton kernels take K, V <= {MAX_DIM}"
        return True, reason

    def describe_plan(self, op, opts, inputs):
        if op == "chunk_kda":
            return plan_of(opts, inputs, train=needs_grad(inputs)).describe()
        if op == "fused_recurrent_kda":
            c = decode_call_of(opts, inputs, platform.resolve_device(inputs.q.device))
            p, ch = c.plan, c.choice
            return (f"decode plan: tiles of {p.BV} value columns, {c.n_tiles} of them over {ch.grid[0]} programs "
                    f"({p.launch.warps} warp{'' if p.launch.warps == 1 else 's'} each)"
                    + {0: "", 1: ", index check kernel", 2: ", index check in the decode programs"}[ch.check]
                    + (" (the decode kernel launched while it runs)" if ch.dependent else ""))
        return None

    def chunk_kda(self, opts, inputs):
        if needs_grad(inputs):
            return chunk_kda_autograd(opts, inputs)
        return chunk_forward(opts, inputs)

    def chunk_kda_vjp(self, opts, inputs, do, dht):
        """Gradients of every input without autograd (the compiled backward, fastkda.library)."""
        return chunk_kda_vjp(opts, inputs, do, dht)

    def fused_recurrent_kda(self, opts, inputs):
        return recurrent_forward(opts, inputs)

    def take_decode_error(self, device):
        code = take_error_code(device)
        return describe_error(code) if code else None

    def kda_gate(self, opts, inputs):
        return gate_kernels.gate_forward(opts, gate_plan(inputs[0].shape[-1], current_tuning()), *inputs)

    def kda_gate_chunk_cumsum(self, opts, inputs):
        return gate_kernels.gate_chunk_cumsum(opts, *inputs)
