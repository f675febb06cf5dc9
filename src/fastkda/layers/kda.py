"""KimiDeltaAttention: the token mixer of the Kimi Linear family as an ``nn.Module``.

    x -> q, k, v projections -> short causal depthwise conv + SiLU -> KDA (l2norm on q/k,
    gate -exp(A_log) softplus(f(x) + dt_bias) or the safe lower-bound gate, beta = sigmoid(b(x)))
    -> gated RMSNorm with a low-rank output gate -> output projection

Chunk mode (training, prefill) runs ``chunk_kda``; recurrent mode (decoding) runs
``fused_recurrent_kda``. A :class:`KDACache` keeps, per layer, the last ``conv_size - 1``
projected inputs of every sequence and the recurrent state, so that prefill followed by decode
steps gives the numbers of one long forward. Parameter names follow the public Kimi Linear
checkpoints (see docs/layer.md for the mapping).
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import seqlens
from ..api import chunk_kda, fused_recurrent_kda
from ..options import MAX_K, chunk_size_of, real_number

__all__ = ["KimiDeltaAttention", "KDACache", "ShortConvolution", "GatedRMSNorm"]


def _seq_index(T: int, cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    """For every token of a flattened varlen batch, the index of its sequence (int64)."""
    return torch.searchsorted(cu_seqlens.to(device, torch.long)[1:], torch.arange(T, device=device), right=True)


def _int(name: str, x, lo: int, hi: int | None = None, optional: bool = False, what: str | None = None) -> int | None:
    """An int argument of the layer (NumPy's too) in [lo, hi]; None where optional."""
    if x is None and optional:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < lo or (hi is not None and x > hi):
        what = what or (f"an int in [{lo}, {hi}]" if hi is not None else "a positive int" if lo == 1 else f"an int >= {lo}")
        raise ValueError(f"`{name}` must be {'None or ' if optional else ''}{what}, got {x!r}")
    return int(x)


EXTERNAL_CONV_DEVICES = ("cuda",)  # where the causal-conv1d package's kernels run


def _causal_conv1d():
    """``causal_conv1d_fn`` of the causal-conv1d package when it is installed and takes initial
    states (version 1.4 on), else None."""
    try:
        from causal_conv1d import causal_conv1d_fn
    except ImportError:
        return None
    params = inspect.signature(causal_conv1d_fn).parameters
    return causal_conv1d_fn if {"initial_states", "return_final_states", "seq_idx"} <= set(params) else None


CAUSAL_CONV1D = _causal_conv1d()  # looked up once: no import inside a forward that torch.compile traces


class ShortConvolution(nn.Module):
    """Causal depthwise 1-D convolution over time with SiLU, sequence- and cache-aware.

    ``weight`` is ``[hidden, 1, kernel_size]`` (the layout of ``nn.Conv1d(groups=hidden)``). With
    ``cu_seqlens`` no window reaches into the previous sequence. ``cache`` ``[N, hidden,
    kernel_size - 1]`` holds the inputs before the first token of every sequence; the new cache
    (the last ``kernel_size - 1`` inputs, older ones from the old cache) is returned when asked.

    On CUDA tensors, with the causal-conv1d package installed, a kernel size of 2 to 4, 16- or
    32-bit floats and a hidden size that divides by 8, its ``causal_conv1d_fn`` does the work (the
    cache as initial states; sequence indices for a varlen batch). Decode steps take the same call
    (its one-token update function changed its state layout across versions). A varlen batch with a
    cache, and code that ``torch.compile`` traces, stay on the PyTorch path.
    """

    def __init__(self, hidden_size: int, kernel_size: int = 4, bias: bool = False, activation: str | None = "silu"):
        super().__init__()
        if activation not in (None, "silu"):
            raise ValueError(f"`activation` must be 'silu' or None, got {activation!r}")
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1:
            raise ValueError(f"`kernel_size` must be a positive int, got {kernel_size!r}")
        self.hidden_size, self.kernel_size, self.activation = hidden_size, kernel_size, activation
        self.weight = nn.Parameter(torch.empty(hidden_size, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None, output_final_state: bool = False,
                cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None):
        """x: ``[B, T, hidden]`` (B = 1 with ``cu_seqlens``). Returns ``(y, new_cache or None)``.
        ``cu_seqlens_cpu``: the host copy of ``cu_seqlens``, read for the new cache of a varlen batch."""
        external = self._external(x, cache, output_final_state, cu_seqlens, cu_seqlens_cpu)
        if external is not None:
            return external
        B, T, D = x.shape
        W = self.kernel_size
        N = B if cu_seqlens is None else cu_seqlens.numel() - 1
        if cache is None:
            cache = x.new_zeros(N, D, W - 1)
        if cu_seqlens is None:
            xp = torch.cat([cache.transpose(1, 2).to(x.dtype), x], 1)  # [B, W - 1 + T, D]
            win = xp.unfold(1, W, 1)  # [B, T, D, W]: inputs t-W+1..t
        else:
            seq = _seq_index(T, cu_seqlens, x.device)
            start = cu_seqlens.to(x.device, torch.long)[seq]  # first token of every token's sequence
            t = torch.arange(T, device=x.device)
            src = t[:, None] - (W - 1) + torch.arange(W, device=x.device)[None, :]  # [T, W] input positions
            inside = src >= start[:, None]
            win = x[0, src.clamp(min=0)]  # [T, W, D]
            if W > 1:  # a position before its sequence start reads that sequence's cache, slot W-1 + (src - start)
                slot = (src - start[:, None] + (W - 1)).clamp(0, W - 2)
                win = torch.where(inside[..., None], win, cache.to(x.dtype)[seq[:, None], :, slot])
            win = win.transpose(1, 2)[None]  # [1, T, D, W]
        y = (win * self.weight[:, 0, :].to(x.dtype)).sum(-1)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        if self.activation == "silu":
            y = F.silu(y)
        new_cache = None
        if output_final_state:
            new_cache = self._final_cache(x, cache, cu_seqlens, cu_seqlens_cpu)
        return y, new_cache

    def _external(self, x, cache, output_final_state, cu_seqlens, cu_seqlens_cpu=None):
        """The causal-conv1d kernel's ``(y, new_cache)`` where it applies, else None."""
        B, T, D = x.shape
        if (CAUSAL_CONV1D is None or x.device.type not in EXTERNAL_CONV_DEVICES or not 2 <= self.kernel_size <= 4
                or x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or D % 8
                or (cu_seqlens is not None and cache is not None) or torch.compiler.is_compiling()):
            return None
        w = self.weight[:, 0, :].to(x.dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        xt = x.contiguous().transpose(1, 2)  # [B, D, T], channels contiguous ("channel last")
        if cu_seqlens is not None:
            seq_idx = _seq_index(T, cu_seqlens, x.device).to(torch.int32)[None]
            y = CAUSAL_CONV1D(xt, w, bias, seq_idx=seq_idx, activation=self.activation).transpose(1, 2)
            final = None
            if output_final_state:
                final = self._final_cache(x, x.new_zeros(cu_seqlens.numel() - 1, D, self.kernel_size - 1), cu_seqlens,
                                          cu_seqlens_cpu)
            return y, final
        init = None if cache is None else cache.to(x.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        if output_final_state:
            y, final = CAUSAL_CONV1D(xt, w, bias, initial_states=init, return_final_states=True,
                                     activation=self.activation)
            return y.transpose(1, 2), final.to(cache.dtype if cache is not None else x.dtype)
        return CAUSAL_CONV1D(xt, w, bias, initial_states=init, activation=self.activation).transpose(1, 2), None

    def _final_cache(self, x, cache, cu_seqlens, cu_seqlens_cpu=None):
        W = self.kernel_size
        if W == 1:  # nothing to keep: no boundaries to read
            return cache[..., :0].clone()

        def last(t):  # the last W - 1 inputs (none for W = 1; t[..., -0:] would keep them all)
            return t[..., t.shape[-1] - (W - 1):]

        if cu_seqlens is None:
            return last(torch.cat([cache.to(x.dtype), x.transpose(1, 2)], 2)).to(cache.dtype)
        cu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
        out = []
        for n in range(len(cu) - 1):
            seq = x[0, cu[n]: cu[n + 1]].transpose(0, 1)  # [D, L]
            out.append(last(torch.cat([cache[n].to(x.dtype), seq], 1)))
        return torch.stack(out).to(cache.dtype)


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x) * weight * sigmoid(gate)`` over the last dim (float32 inside)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * torch.sigmoid(gate.float())).to(x.dtype)


@dataclass
class KDACache:
    """Per-layer decoding state: ``conv_states[layer] = (q, k, v)`` caches ``[N, dim, conv - 1]``
    (None for a layer without the convolution) and ``recurrent_states[layer]`` ``[N, HV, K, V]``
    float32; N sequences."""

    conv_states: dict = field(default_factory=dict)
    recurrent_states: dict = field(default_factory=dict)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep sequences ``index`` (beam search, finished sequences)."""
        for layer, states in self.conv_states.items():
            self.conv_states[layer] = tuple(None if s is None else s.index_select(0, index) for s in states)
        for layer, s in self.recurrent_states.items():
            self.recurrent_states[layer] = s.index_select(0, index)


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention layer.

    Args:
        hidden_size: model width.
        num_heads: q/k heads H. ``num_v_heads`` (HV, default H): value heads (GVA when HV > H).
        head_dim: K (also V unless ``head_v_dim`` is given).
        conv_size: short convolution width (0 disables it).
        lower_bound: None for the softplus gate; a value in [-5, 0) selects the safe lower-bound gate.
        mode: "auto" (default: the recurrent kernel for short inputs at inference, else chunked),
            "chunk" or "fused_recurrent".
        layer_idx: key of this layer in a :class:`KDACache`.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, num_v_heads: int | None = None,
                 head_v_dim: int | None = None, conv_size: int = 4, lower_bound: float | None = None,
                 mode: str = "auto", norm_eps: float = 1e-6, layer_idx: int = 0, chunk_size: int = 64):
        super().__init__()
        if mode not in ("auto", "chunk", "fused_recurrent"):
            raise ValueError(f"`mode` must be 'auto', 'chunk' or 'fused_recurrent', got {mode!r}")
        hidden_size, num_heads = _int("hidden_size", hidden_size, 1), _int("num_heads", num_heads, 1)
        head_dim = _int("head_dim", head_dim, 1, MAX_K)
        num_v_heads = _int("num_v_heads", num_v_heads, 1, optional=True)
        head_v_dim = _int("head_v_dim", head_v_dim, 1, optional=True)
        conv_size = _int("conv_size", conv_size, 0, what="a non-negative int (0: no convolution)")
        chunk_size = chunk_size_of(chunk_size)
        if lower_bound is not None:
            lower_bound = real_number("lower_bound", lower_bound)
            if not (-5.0 <= lower_bound < 0.0):
                raise ValueError(f"`lower_bound` must be in [-5, 0) (the safe gate), got {lower_bound}")
        eps = real_number("norm_eps", norm_eps)
        if not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"`norm_eps` must be a positive finite number, got {norm_eps!r}")
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.num_v_heads = num_v_heads or num_heads
        if self.num_v_heads % num_heads:
            raise ValueError(f"`num_v_heads`={self.num_v_heads} must be a multiple of `num_heads`={num_heads}")
        self.head_v_dim = head_v_dim or head_dim
        self.conv_size, self.lower_bound, self.mode = conv_size, lower_bound, mode
        self.layer_idx, self.chunk_size = layer_idx, chunk_size
        key_dim, value_dim = num_heads * head_dim, self.num_v_heads * self.head_v_dim
        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_dim, bias=False)
        if conv_size > 0:
            self.q_conv1d = ShortConvolution(key_dim, conv_size)
            self.k_conv1d = ShortConvolution(key_dim, conv_size)
            self.v_conv1d = ShortConvolution(value_dim, conv_size)
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)  # low-rank forget gate
        self.f_b_proj = nn.Linear(head_dim, self.num_v_heads * head_dim, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32).uniform_(1, 16).log())
        self.dt_bias = nn.Parameter(torch.zeros(self.num_v_heads * head_dim, dtype=torch.float32))
        self.g_a_proj = nn.Linear(hidden_size, self.head_v_dim, bias=False)  # low-rank output gate
        self.g_b_proj = nn.Linear(self.head_v_dim, value_dim, bias=False)
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)
        self._register_load_state_dict_pre_hook(self._load_hook)

    @staticmethod
    def _load_hook(state_dict, prefix, *args):
        """Checkpoints store A_log as [1, 1, HV, 1]; keep the values, drop the unit dims."""
        key = prefix + "A_log"
        if key in state_dict and state_dict[key].dim() != 1:
            state_dict[key] = state_dict[key].reshape(-1)

    def _conv(self, name, x, cache, layer_cache, cu_seqlens, cu_seqlens_cpu):
        if self.conv_size == 0:
            return x, None
        conv = getattr(self, f"{name}_conv1d")
        return conv(x, cache=layer_cache, output_final_state=cache is not None, cu_seqlens=cu_seqlens,
                    cu_seqlens_cpu=cu_seqlens_cpu)

    def forward(self, hidden_states: torch.Tensor, cache: KDACache | None = None,
                cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden_states`` ``[B, T, hidden]`` (B = 1 with ``cu_seqlens``) -> ``[B, T, hidden]``.

        With ``cache``, the states of this layer are read (if present) and updated in it; the cache
        must hold as many sequences as the input. ``cu_seqlens_cpu``: the host copy of a device
        ``cu_seqlens`` (the same values), so that the layer reads nothing back from the device;
        without it a chunked varlen call reads the boundaries once per layer.
        """
        B, T, _ = hidden_states.shape
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim
        if cu_seqlens_cpu is not None:
            if cu_seqlens is None:
                raise ValueError("`cu_seqlens_cpu` was given without `cu_seqlens`")
            if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu" \
                    or cu_seqlens_cpu.shape != cu_seqlens.shape:
                raise ValueError(f"`cu_seqlens_cpu` must be a CPU tensor shaped like cu_seqlens {list(cu_seqlens.shape)}, "
                                 f"got {cu_seqlens_cpu!r:.80}")
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        conv_q = conv_k = conv_v = None
        state = None
        if cache is not None:
            conv_q, conv_k, conv_v = cache.conv_states.get(self.layer_idx, (None, None, None))
            state = cache.recurrent_states.get(self.layer_idx)
            held = {t.shape[0] for t in (conv_q, conv_k, conv_v, state) if t is not None}
            if held and held != {N}:
                raise ValueError(f"`cache` holds {min(held)} sequences for layer {self.layer_idx}, but the input has {N} "
                                 "(its batch size, or len(cu_seqlens) - 1): use a new KDACache, or KDACache.reorder")
        recurrent = self.mode == "fused_recurrent" or (self.mode == "auto" and not self.training and T <= 64)
        host = cu_seqlens_cpu
        if host is None and cu_seqlens is not None and not torch.compiler.is_compiling():
            if cu_seqlens.device.type == "cpu":
                host = cu_seqlens
            elif not recurrent or (cache is not None and self.conv_size > 1):  # read once for chunk_kda and the cache
                host = seqlens.host_seqlens(cu_seqlens)
        q, conv_q = self._conv("q", self.q_proj(hidden_states), cache, conv_q, cu_seqlens, host)
        k, conv_k = self._conv("k", self.k_proj(hidden_states), cache, conv_k, cu_seqlens, host)
        v, conv_v = self._conv("v", self.v_proj(hidden_states), cache, conv_v, cu_seqlens, host)
        g = self.f_b_proj(self.f_a_proj(hidden_states))
        beta = self.b_proj(hidden_states)
        q, k = q.view(B, T, H, K), k.view(B, T, H, K)
        v, g = v.view(B, T, HV, V), g.view(B, T, HV, K)
        kw = dict(
            initial_state=state, output_final_state=cache is not None, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
            lower_bound=self.lower_bound, cu_seqlens=cu_seqlens,
        )
        if recurrent:
            o, state = fused_recurrent_kda(q, k, v, g, beta, **kw)
        else:
            o, state = chunk_kda(q, k, v, g, beta, safe_gate=self.lower_bound is not None, chunk_size=self.chunk_size,
                                 cu_seqlens_cpu=host if cu_seqlens is not None else None, **kw)
        if cache is not None:
            cache.conv_states[self.layer_idx] = (conv_q, conv_k, conv_v)
            cache.recurrent_states[self.layer_idx] = state
        gate = self.g_b_proj(self.g_a_proj(hidden_states)).view(B, T, HV, V)
        o = self.o_norm(o, gate)
        return self.o_proj(o.reshape(B, T, HV * V))
