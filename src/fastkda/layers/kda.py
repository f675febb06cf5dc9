"""KimiDeltaAttention: the token mixer of the Kimi Linear family as an ``nn.Module``.

    x -> q, k, v projections -> short causal depthwise conv + SiLU -> KDA (l2norm on q/k,
    gate -exp(A_log) softplus(f(x) + dt_bias) or the lower-bound gate, beta = sigmoid(b(x)))
    -> gated RMSNorm with a low-rank output gate -> output projection

The constructor, the forward and the parameter names are those of ``fla.layers.KimiDeltaAttention``
(flash-linear-attention 0.6.0): fla's state dicts load as they are, and so do the names of the
public Kimi Linear checkpoints (a load pre-hook renames them; see docs/layer.md). Training and long
inputs run ``chunk_kda``; decoding runs ``fused_recurrent_kda``. A :class:`KDACache`, or a cache
with fla's layer-cache interface, keeps every sequence's convolution inputs and recurrent state, so
that prefill followed by decode steps gives the numbers of one long forward.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import seqlens
from ..api import chunk_kda, fused_recurrent_kda
from ..dtypes import INDEX_DTYPES
from ..options import MAX_K, bool_of, chunk_size_of, cu_seqlens_checked, lower_bound_of, real_number, type_name

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


def _positive(name: str, x) -> float:
    """A positive finite real argument of the layer (``options.real_number``'s kinds) as a float."""
    x = real_number(name, x)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"`{name}` must be a positive finite number, got {x!r}")
    return x


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

    ``weight`` is ``[hidden, 1, kernel_size]`` (the layout of ``nn.Conv1d(groups=hidden)``), and
    both are initialised as ``nn.Conv1d``'s. With ``cu_seqlens`` no window reaches into the previous
    sequence. ``cache`` ``[N, hidden, kernel_size - 1]`` holds the inputs before the first token of
    every sequence; the new cache (the last ``kernel_size - 1`` inputs, older ones from the old
    cache) is returned when asked. With ``cache_width=kernel_size`` the cache keeps the last
    ``kernel_size`` inputs instead (fla's layout; the oldest one is carried, never read).

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
        hidden_size, kernel_size = _int("hidden_size", hidden_size, 1), _int("kernel_size", kernel_size, 1)
        self.hidden_size, self.kernel_size, self.activation = hidden_size, kernel_size, activation
        # the causal-conv1d package's kernel (None: not installed) and the device types it runs on;
        # per instance, so that a caller (or a test) can route one module elsewhere
        self.kernel_fn, self.kernel_devices = CAUSAL_CONV1D, EXTERNAL_CONV_DEVICES
        self.weight = nn.Parameter(torch.empty(hidden_size, 1, kernel_size))
        self.bias = nn.Parameter(torch.empty(hidden_size)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        if self.bias is not None:  # fan_in = kernel_size
            nn.init.uniform_(self.bias, -kernel_size**-0.5, kernel_size**-0.5)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, kernel_size={self.kernel_size}, bias={self.bias is not None}, "
                f"activation={self.activation}")

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None, output_final_state: bool = False,
                cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
                cache_width: int | None = None):
        """x: ``[B, T, hidden]`` (B = 1 with ``cu_seqlens``). Returns ``(y, new_cache or None)``.
        ``cu_seqlens_cpu``: the host copy of ``cu_seqlens``, read for the new cache of a varlen batch.
        ``cache_width``: inputs kept per channel in ``cache`` and the new cache, ``kernel_size - 1``
        (default) or ``kernel_size``."""
        W = self.kernel_size
        width = W - 1 if cache_width is None else cache_width
        if width not in (W - 1, W):
            raise ValueError(f"`cache_width` must be kernel_size - 1 = {W - 1} or kernel_size = {W}, got {cache_width!r}")
        if (not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != self.hidden_size
                or not x.is_floating_point()):
            got = f"shape {list(x.shape)}, {x.dtype}" if isinstance(x, torch.Tensor) else type_name(x)
            raise ValueError(f"`x` must be a floating [B, T, hidden_size={self.hidden_size}] tensor, got {got}")
        if cu_seqlens is not None:  # shapes, dtypes, devices (the values where they are read)
            cu_seqlens_checked(cu_seqlens, cu_seqlens_cpu, x.shape[0], x.shape[1], x, False, "x")
        N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if cache is not None and (cache.dim() != 3 or cache.shape != (N, self.hidden_size, width)):
            raise ValueError(f"`cache` must be [N, {self.hidden_size}, {width}] with N={N} sequences (the batch, or "
                             f"len(cu_seqlens) - 1), got {list(cache.shape)}")
        if width == W - 1:
            return self._forward(x, cache, output_final_state, cu_seqlens, cu_seqlens_cpu)
        y, _ = self._forward(x, None if cache is None else cache[..., 1:], False, cu_seqlens, cu_seqlens_cpu)
        if not output_final_state:
            return y, None
        if cache is None:
            cache = x.new_zeros(x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1, x.shape[2], W)
        return y, self._final_cache(x, cache, cu_seqlens, cu_seqlens_cpu)

    def _forward(self, x, cache, output_final_state, cu_seqlens, cu_seqlens_cpu):
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
        fn = self.kernel_fn
        if (fn is None or x.device.type not in self.kernel_devices or not 2 <= self.kernel_size <= 4
                or x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or D % 8
                or (cu_seqlens is not None and cache is not None) or torch.compiler.is_compiling()):
            return None
        w = self.weight[:, 0, :].to(x.dtype)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        xt = x.contiguous().transpose(1, 2)  # [B, D, T], channels contiguous ("channel last")
        if cu_seqlens is not None:
            seq_idx = _seq_index(T, cu_seqlens, x.device).to(torch.int32)[None]
            y = fn(xt, w, bias, seq_idx=seq_idx, activation=self.activation).transpose(1, 2)
            final = None
            if output_final_state:
                final = self._final_cache(x, x.new_zeros(cu_seqlens.numel() - 1, D, self.kernel_size - 1), cu_seqlens,
                                          cu_seqlens_cpu)
            return y, final
        init = None if cache is None else cache.to(x.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        if output_final_state:
            y, final = fn(xt, w, bias, initial_states=init, return_final_states=True, activation=self.activation)
            return y.transpose(1, 2), final.to(cache.dtype if cache is not None else x.dtype)
        return fn(xt, w, bias, initial_states=init, activation=self.activation).transpose(1, 2), None

    def _final_cache(self, x, cache, cu_seqlens, cu_seqlens_cpu=None):
        """The last ``cache.shape[-1]`` inputs of every sequence, the cache's before its first token."""
        width = cache.shape[-1]
        if width == 0:  # nothing to keep: no boundaries to read
            return cache[..., :0].clone()

        def last(t):  # the last `width` inputs (t[..., -0:] would keep them all)
            return t[..., t.shape[-1] - width:]

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
        dim, eps = _int("dim", dim, 1), _positive("eps", eps)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * torch.sigmoid(gate.float())).to(x.dtype)


@dataclass
class KDACache:
    """Per-layer decoding state: ``conv_states[layer] = (q, k, v)`` caches ``[N, dim, conv - 1]``
    (None for a layer without the convolution) and ``recurrent_states[layer]`` ``[N, HV, K, V]``
    float32 (float64 for float64 inputs); N sequences."""

    conv_states: dict = field(default_factory=dict)
    recurrent_states: dict = field(default_factory=dict)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep sequences ``index`` (beam search, finished sequences): a 1-D int32/int64 tensor of
        sequences of the cache, each in [0, N); its values are read back (one synchronisation) and
        checked before any state moves (an index past N would fault on the GPU)."""
        if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.dtype not in INDEX_DTYPES:
            got = f" {index.dtype} of shape {list(index.shape)}" if isinstance(index, torch.Tensor) else ""
            raise ValueError(f"`index` must be a 1-D int32 or int64 tensor, got {type_name(index)}{got}")
        sizes = {s.shape[0] for states in self.conv_states.values() for s in states if s is not None}
        sizes |= {s.shape[0] for s in self.recurrent_states.values()}
        if sizes and index.numel():
            lo, hi = torch.aminmax(index)
            lo, hi, n = int(lo), int(hi), min(sizes)
            if lo < 0 or hi >= n:
                raise ValueError(f"`index` must hold sequences of the cache in [0, {n}), got values from {lo} to {hi}")
        for layer, states in self.conv_states.items():
            self.conv_states[layer] = tuple(None if s is None else s.index_select(0, index) for s in states)
        for layer, s in self.recurrent_states.items():
            self.recurrent_states[layer] = s.index_select(0, index)


_LOW_RANK_NAMES = {"f_a_proj": "f_proj.0", "f_b_proj": "f_proj.1", "g_a_proj": "g_proj.0", "g_b_proj": "g_proj.1"}
_MODES = ("chunk", "fused_recurrent", "auto")
RECURRENT_MAX_TOKENS = 64  # inference inputs of at most this many tokens take the recurrent kernel


def _is_layer_cache(obj) -> bool:
    """Whether ``obj`` keeps per-layer states the way fla's ``Cache`` does: ``len(obj)`` layers,
    ``obj[i]`` a dict with ``recurrent_state`` and ``conv_state``, ``obj.update(..., layer_idx=i)``."""
    return (not isinstance(obj, Mapping) and callable(getattr(obj, "update", None)) and hasattr(obj, "__getitem__")
            and hasattr(obj, "__len__"))


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention layer, with the constructor, forward and parameter names of
    ``fla.layers.KimiDeltaAttention`` (flash-linear-attention 0.6.0).

    Args:
        hidden_size: model width.
        expand_v: value head dim over key head dim; ``head_dim * expand_v`` must be an integer.
        head_dim: K, the key head dim (at most 256).
        num_heads: q/k heads H.
        num_v_heads: value heads HV (default H); a multiple of H (grouped value heads).
        mode: ``"chunk"`` or ``"fused_recurrent"``: the kernel for inputs of more than 64 tokens at
            inference. Gradients always take the chunked kernel and inference inputs of at most 64
            tokens (decoding) the recurrent one, unless ``force_mode``. ``"auto"`` is ``"chunk"``.
        use_short_conv: the causal depthwise convolution (with SiLU) on q, k, v; without it q, k, v
            are ``silu`` of their projections.
        allow_neg_eigval: ``beta = 2 * sigmoid(b_proj(x))``, in (0, 2).
        safe_gate: promise the kernels that every gate lies in ``[lower_bound, 0)``; needs
            ``lower_bound`` in [-5, 0). It also starts ``A_log`` at 0.
        lower_bound: None for the gate ``-exp(A_log) * softplus(f + dt_bias)``; a negative number
            for ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``.
        conv_size: width of the short convolution; 0 leaves it out and keeps q, k, v as projected.
        conv_bias: a bias in the short convolution.
        layer_idx: this layer's index in a model's cache (needed with ``past_key_values``).
        norm_eps: epsilon of the output RMSNorm.

    Options of fastkda's own (keyword only):
        head_v_dim: V directly, instead of ``expand_v``.
        chunk_size: 32 or 64, for ``chunk_kda``.
        force_mode: run ``mode``'s kernel for every input, training included.

    Other keyword arguments are ignored with a warning.
    """

    def __init__(self, hidden_size: int = 2048, expand_v: float = 1, head_dim: int = 128, num_heads: int = 16,
                 num_v_heads: int | None = None, mode: str = "chunk", use_short_conv: bool = True,
                 allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: float | None = None,
                 conv_size: int = 4, conv_bias: bool = False, layer_idx: int | None = None, norm_eps: float = 1e-5,
                 *, head_v_dim: int | None = None, chunk_size: int = 64, force_mode: bool = False, **kwargs):
        super().__init__()
        if kwargs:
            warnings.warn(f"KimiDeltaAttention ignores the keyword arguments {sorted(kwargs)}", UserWarning, stacklevel=2)
        if not isinstance(mode, str) or mode not in _MODES:
            raise ValueError(f"`mode` must be 'chunk' or 'fused_recurrent' (or 'auto'), got {mode!r}")
        hidden_size, num_heads = _int("hidden_size", hidden_size, 1), _int("num_heads", num_heads, 1)
        head_dim = _int("head_dim", head_dim, 1, MAX_K)
        num_v_heads = _int("num_v_heads", num_v_heads, 1, optional=True)
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        if num_v_heads % num_heads:
            raise ValueError(f"`num_v_heads`={num_v_heads} must be a multiple of `num_heads`={num_heads}")
        expand_v = _positive("expand_v", expand_v)
        wanted = head_dim * expand_v
        if head_v_dim is None:
            head_v_dim = round(wanted)
            if head_v_dim < 1 or not math.isclose(wanted, head_v_dim, rel_tol=1e-5):
                raise ValueError(f"`expand_v`={expand_v!r} gives a value head dim head_dim * expand_v = {head_dim} * "
                                 f"{expand_v!r} = {wanted!r}, which is not a positive integer")
        else:
            head_v_dim = _int("head_v_dim", head_v_dim, 1, optional=True)
            if expand_v != 1 and not math.isclose(wanted, head_v_dim, rel_tol=1e-5):
                raise ValueError(f"`head_v_dim`={head_v_dim} disagrees with `expand_v`={expand_v!r} (head_dim * expand_v "
                                 f"= {wanted!r}): give one of them")
            expand_v = head_v_dim / head_dim
        use_short_conv, conv_bias = bool_of("use_short_conv", use_short_conv), bool_of("conv_bias", conv_bias)
        allow_neg_eigval, safe_gate = bool_of("allow_neg_eigval", allow_neg_eigval), bool_of("safe_gate", safe_gate)
        force_mode = bool_of("force_mode", force_mode)
        if force_mode and mode == "auto":
            raise ValueError("`force_mode=True` needs `mode` 'chunk' or 'fused_recurrent', got 'auto'")
        conv_size = _int("conv_size", conv_size, 0, what="a non-negative int (0: no convolution)")
        layer_idx = _int("layer_idx", layer_idx, 0, optional=True, what="a non-negative int")
        chunk_size = chunk_size_of(chunk_size)
        lower_bound = lower_bound_of(lower_bound)
        if safe_gate and (lower_bound is None or not -5.0 <= lower_bound < 0.0):
            raise ValueError(f"`safe_gate=True` needs `lower_bound` in [-5, 0), got lower_bound={lower_bound!r}")
        eps = _positive("norm_eps", norm_eps)

        self.hidden_size, self.expand_v, self.head_dim = hidden_size, expand_v, head_dim
        self.num_heads, self.num_v_heads = num_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_dim, head_v_dim
        self.key_dim, self.value_dim = num_heads * head_dim, num_v_heads * head_v_dim
        self.gate_dim = num_v_heads * head_dim
        self.mode, self.force_mode, self.chunk_size = mode, force_mode, chunk_size
        self.use_short_conv, self.conv_size, self.conv_bias = use_short_conv, conv_size, conv_bias
        self.allow_neg_eigval, self.safe_gate, self.lower_bound = allow_neg_eigval, safe_gate, lower_bound
        self.layer_idx, self.norm_eps = layer_idx, eps

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if self.has_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias)
        # low-rank forget gate (rank V) -> [HV * K], activated in the kernel with A_log and dt_bias
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, head_v_dim, bias=False),
                                    nn.Linear(head_v_dim, self.gate_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        if safe_gate:
            A_log = torch.zeros(num_v_heads, dtype=torch.float32)
        else:
            A_log = torch.empty(num_v_heads, dtype=torch.float32).uniform_(1, 16).log()
        self.A_log = nn.Parameter(A_log)
        # dt log-uniform in [1e-3, 1e-1]; dt_bias = softplus^-1(dt) = dt + log(1 - exp(-dt))
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = (lo + (hi - lo) * torch.rand(self.gate_dim, dtype=torch.float32)).exp().clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        # low-rank output gate (rank V, with a bias) -> [HV * V]
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, head_v_dim, bias=False),
                                    nn.Linear(head_v_dim, self.value_dim, bias=True))
        self.o_norm = GatedRMSNorm(head_v_dim, eps=eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self._register_load_state_dict_pre_hook(self._load_hook)

    @property
    def has_conv(self) -> bool:
        return self.use_short_conv and self.conv_size > 0

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, num_heads={self.num_heads}, num_v_heads={self.num_v_heads}, "
                f"head_k_dim={self.head_k_dim}, head_v_dim={self.head_v_dim}, lower_bound={self.lower_bound}, "
                f"safe_gate={self.safe_gate}, allow_neg_eigval={self.allow_neg_eigval}, layer_idx={self.layer_idx}")

    @staticmethod
    def _load_hook(state_dict, prefix, *args):
        """Kimi Linear checkpoints (and fastkda's earlier layer) name the low-rank pairs
        ``f_a_proj``/``f_b_proj``/``g_a_proj``/``g_b_proj`` (the output gate without a bias) and store
        ``A_log`` as ``[1, 1, HV, 1]``: rename, add a zero output-gate bias, keep A_log's values."""
        key = prefix + "A_log"
        if key in state_dict and state_dict[key].dim() != 1:
            state_dict[key] = state_dict[key].reshape(-1)
        g_b = state_dict.get(prefix + "g_b_proj.weight")
        for old, new in _LOW_RANK_NAMES.items():
            for p in ("weight", "bias"):
                if prefix + f"{old}.{p}" in state_dict:
                    state_dict[prefix + f"{new}.{p}"] = state_dict.pop(prefix + f"{old}.{p}")
        if g_b is not None and prefix + "g_proj.1.bias" not in state_dict:
            state_dict[prefix + "g_proj.1.bias"] = g_b.new_zeros(g_b.shape[0])

    def _recurrent(self, T: int) -> bool:
        """Whether this call runs the recurrent kernel."""
        if self.force_mode:
            return self.mode == "fused_recurrent"
        if torch.is_grad_enabled():
            return False
        if T <= RECURRENT_MAX_TOKENS and not self.training:
            return True
        return self.mode == "fused_recurrent"

    def _read_cache(self, past_key_values, N: int, dtype: torch.dtype):
        """``(kind, (conv_q, conv_k, conv_v), recurrent_state)`` of this layer in the cache; kind is
        None (no cache), "kda" (a KDACache) or "layers" (a cache with fla's interface)."""
        if past_key_values is None:
            return None, (None, None, None), None
        if isinstance(past_key_values, KDACache):
            kind, key = "kda", self._kda_key
            convs = past_key_values.conv_states.get(key, (None, None, None))
            state = past_key_values.recurrent_states.get(key)
        elif _is_layer_cache(past_key_values):
            if self.layer_idx is None:
                raise ValueError("`past_key_values` needs the layer's `layer_idx` (its index in the model's cache), "
                                 "got layer_idx=None")
            kind = "layers"
            entry = past_key_values[self.layer_idx] if len(past_key_values) > self.layer_idx else None
            entry = entry or {}
            convs, state = entry.get("conv_state"), entry.get("recurrent_state")
            convs = (None, None, None) if convs is None else tuple(convs)
        else:
            raise TypeError("`past_key_values` must be a KDACache, a cache with fla's layer-cache interface or None, "
                            f"got {type(past_key_values).__name__}")
        layer = self._kda_key if kind == "kda" else self.layer_idx
        if any(t is not None and not isinstance(t, torch.Tensor) for t in (*convs, state)):
            raise TypeError(f"`cache` holds states for layer {layer} that are not tensors")
        held = {t.shape[0] for t in (*convs, state) if t is not None}
        if held and held != {N}:
            raise ValueError(f"`cache` holds {min(held)} sequences for layer {layer}, but the input has {N} (its batch "
                             "size, or len(cu_seqlens) - 1): use a new cache, or reorder it")
        if state is not None:
            HV, K, V = self.num_v_heads, self.head_k_dim, self.head_v_dim
            want = (N, HV, V, K) if kind == "layers" else (N, HV, K, V)
            dtypes = (torch.float32, torch.float64) if dtype == torch.float64 else (torch.float32,)  # a float64 layer's
            if tuple(state.shape) != want or state.dtype not in dtypes:
                raise ValueError(f"`cache` holds a recurrent state of shape {list(state.shape)} and {state.dtype} for "
                                 f"layer {layer}, but this layer's is {list(want)} float32 (or float64 for float64 "
                                 "inputs): a cache of another model?")
        return kind, convs, state

    @property
    def _kda_key(self):
        return 0 if self.layer_idx is None else self.layer_idx

    def _conv(self, name, x, conv_cache, output_final_state, cu_seqlens, cu_seqlens_cpu, cache_width):
        if not self.has_conv:
            return (x if self.use_short_conv else F.silu(x)), None
        return getattr(self, f"{name}_conv1d")(x, cache=conv_cache, output_final_state=output_final_state,
                                               cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                               cache_width=cache_width)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool | None = False, output_attentions: bool | None = False, *,
                cache: KDACache | None = None, cu_seqlens: torch.Tensor | None = None,
                cu_seqlens_cpu: torch.Tensor | None = None, **kwargs):
        """``hidden_states`` ``[B, T, hidden]`` -> ``(o [B, T, hidden], None, past_key_values)``.

        Args:
            attention_mask: ``[B, T']`` with ``T' >= T``, 1 for a token and 0 for padding; its last
                T columns mark the tokens of this call. Padding is removed before the projections
                (the batch runs as B variable-length sequences) and its outputs are zeros.
            past_key_values: a :class:`KDACache` or a cache with fla's interface (``fla.models.utils.Cache``):
                this layer's states are read from it when present, and written to it with ``use_cache``.
                With fla's cache the states have fla's layouts (convolution ``[N, dim, conv_size]``,
                recurrent ``[N, HV, V, K]``), so fla's layer and this one can share it.
            use_cache: write the new states to ``past_key_values``.
            output_attentions: ignored (no attention weights); the second output is None.
            cache: a :class:`KDACache` to read and update (``past_key_values=cache, use_cache=True``).
            cu_seqlens: ``[N + 1]`` boundaries of a flattened batch (B = 1); it takes precedence over
                ``attention_mask``. ``cu_seqlens_cpu``: its host copy, so that nothing is read back.
            kwargs: ignored.
        """
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            raise TypeError("`attention_mask` must be a [batch, seq_len] tensor or None, got "
                            f"{type(attention_mask).__name__}; pass a cache as `past_key_values=` (with use_cache=True) "
                            "or `cache=`")
        if cache is not None:
            if past_key_values is not None:
                raise ValueError("pass the cache once: as `cache` or as `past_key_values`, not both")
            past_key_values, use_cache = cache, True
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            raise ValueError(f"`hidden_states` must be a [batch, seq_len, hidden_size] tensor, got {hidden_states!r:.80}")
        if hidden_states.shape[-1] != self.hidden_size or not hidden_states.is_floating_point():
            raise ValueError(f"`hidden_states` must be a floating [batch, seq_len, hidden_size={self.hidden_size}] "
                             f"tensor, got shape {list(hidden_states.shape)} and dtype {hidden_states.dtype}")
        if use_cache is not None and not isinstance(use_cache, bool):
            raise TypeError(f"`use_cache` must be a bool or None, got {type_name(use_cache)}: {use_cache!r:.80}")
        B, T, _ = hidden_states.shape
        if cu_seqlens is not None:  # shapes, dtypes, devices (the values below, where they are used)
            cu_seqlens_checked(cu_seqlens, cu_seqlens_cpu, B, T, hidden_states, False, "hidden_states")
        elif cu_seqlens_cpu is not None:
            raise ValueError("`cu_seqlens_cpu` was given without `cu_seqlens`")
        indices = None
        if attention_mask is not None and cu_seqlens is None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
                raise ValueError(f"`attention_mask` must be [batch, seq_len] = [{B}, >= {T}] with 1 for tokens and 0 for "
                                 f"padding, got shape {list(attention_mask.shape)}")
            keep = attention_mask[:, attention_mask.shape[1] - T:].to(hidden_states.device) != 0
            indices = keep.flatten().nonzero().squeeze(1)
            cu_seqlens = F.pad(keep.sum(-1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
            hidden_states = hidden_states.reshape(B * T, -1).index_select(0, indices)[None]
        x = hidden_states
        Bx, Tx = x.shape[:2]
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        N = Bx if cu_seqlens is None else cu_seqlens.shape[0] - 1
        kind, (conv_q, conv_k, conv_v), state = self._read_cache(past_key_values, N, x.dtype)
        write = kind is not None and bool(use_cache)
        layers_layout = kind == "layers"
        conv_width = self.conv_size if layers_layout else None
        recurrent = self._recurrent(T)
        host = cu_seqlens_cpu
        if cu_seqlens is not None and not torch.compiler.is_compiling() and (
                not recurrent or (write and self.has_conv and self.conv_size > 1)  # chunk_kda, the conv cache
                or cu_seqlens.device.type == "cpu"):  # (the convolution indexes by them: no device read)
            host = seqlens.host_values(cu_seqlens, cu_seqlens_cpu, Tx)  # read once (or the host copy), checked
        q, conv_q = self._conv("q", self.q_proj(x), conv_q, write, cu_seqlens, host, conv_width)
        k, conv_k = self._conv("k", self.k_proj(x), conv_k, write, cu_seqlens, host, conv_width)
        v, conv_v = self._conv("v", self.v_proj(x), conv_v, write, cu_seqlens, host, conv_width)
        g = self.f_proj(x)
        beta = self.b_proj(x)
        q, k = q.view(Bx, Tx, H, K), k.view(Bx, Tx, H, K)
        v, g = v.view(Bx, Tx, HV, V), g.view(Bx, Tx, HV, K)
        kw = dict(
            initial_state=state, output_final_state=write, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval, A_log=self.A_log,
            dt_bias=self.dt_bias, lower_bound=self.lower_bound, state_v_first=layers_layout, cu_seqlens=cu_seqlens,
        )
        if recurrent:
            o, state = fused_recurrent_kda(q, k, v, g, beta, **kw)
        else:  # with a lower bound in [-5, 0) every gate lies in [lower_bound, 0): the safe gate's kernels apply
            safe = self.safe_gate or (self.lower_bound is not None and -5.0 <= self.lower_bound < 0.0)
            o, state = chunk_kda(q, k, v, g, beta, safe_gate=safe, chunk_size=self.chunk_size,
                                 cu_seqlens_cpu=host if cu_seqlens is not None else None, **kw)
        if write:
            if kind == "kda":
                past_key_values.conv_states[self._kda_key] = (conv_q, conv_k, conv_v)
                past_key_values.recurrent_states[self._kda_key] = state
            else:
                convs = (conv_q, conv_k, conv_v) if self.has_conv else None
                past_key_values.update(recurrent_state=state, conv_state=convs, layer_idx=self.layer_idx, offset=T)
        o = self.o_norm(o, self.g_proj(x).view(Bx, Tx, HV, V))
        o = self.o_proj(o.reshape(Bx, Tx, HV * V))
        if indices is not None:
            o = o.new_zeros(B * T, o.shape[-1]).index_copy(0, indices, o[0]).view(B, T, -1)
        return o, None, past_key_values
