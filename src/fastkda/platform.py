"""Platform facts, read once. Code and tests ask here instead of probing torch.cuda themselves."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

__all__ = [
    "device",
    "device_platform",
    "IS_NVIDIA",
    "IS_NVIDIA_HOPPER",
    "IS_NVIDIA_BLACKWELL",
    "IS_AMD",
    "IS_INTEL",
    "HAS_TRITON",
    "TRITON_MAX_DIM",
    "triton_interpret",
    "is_gpu_tensor",
    "device_name",
    "resolve_device",
    "capturing",
    "sm_count",
    "dependent_launch",
]


def _detect() -> tuple[str, str]:
    """(torch device type, vendor platform) of the best accelerator present, else ('cpu', 'cpu')."""
    if torch.cuda.is_available():
        return "cuda", ("amd" if torch.version.hip else "nvidia")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu", "intel"
    return "cpu", "cpu"


device, device_platform = _detect()

IS_NVIDIA = device_platform == "nvidia"
IS_AMD = device_platform == "amd"
IS_INTEL = device_platform == "intel"
_CC = torch.cuda.get_device_capability() if IS_NVIDIA else (0, 0)
IS_NVIDIA_HOPPER = IS_NVIDIA and _CC[0] == 9
IS_NVIDIA_BLACKWELL = IS_NVIDIA and _CC[0] == 10

HAS_TRITON = importlib.util.find_spec("triton") is not None
TRITON_MAX_DIM = 256  # the widest K and V the Triton kernels take


def triton_interpret() -> bool:
    """True when Triton kernels run in its interpreter (CPU tensors allowed)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def is_gpu_tensor(t: torch.Tensor) -> bool:
    return t.device.type in ("cuda", "xpu")


@functools.lru_cache(maxsize=None)
def device_name(dev: str = device) -> str:
    if dev.startswith("cuda"):
        return torch.cuda.get_device_name()
    if dev.startswith("xpu"):
        return torch.xpu.get_device_name()
    import platform as _p

    return _p.processor() or _p.machine()


def resolve_device(dev=None) -> torch.device:
    """``dev`` as a torch.device with its index: None is this machine's accelerator (the CPU
    without one), and a bare "cuda" the current CUDA device."""
    dev = torch.device(device if dev is None else dev)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def capturing(dev: torch.device) -> bool:
    """Whether the current stream of ``dev`` is being captured into a CUDA graph."""
    return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()


NOMINAL_SMS = 132  # an H200's: what sm_count answers for devices that do not say (the interpreter's CPU)


@functools.lru_cache(maxsize=None)
def sm_count(dev: torch.device) -> int:
    """Streaming multiprocessors of CUDA device ``dev``; NOMINAL_SMS elsewhere, so that launch
    choices that follow the SM count are the same under the interpreter as on an H200."""
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return NOMINAL_SMS


def dependent_launch(dev: torch.device) -> bool:
    """Whether compiled kernels on ``dev`` take programmatic dependent launches (NVIDIA sm_90 and
    later; never in the Triton interpreter, which has no inline assembly)."""
    return not triton_interpret() and _sm90(dev)


@functools.lru_cache(maxsize=None)
def _sm90(dev: torch.device) -> bool:
    """An NVIDIA sm_90+ device, with a Triton that has the grid dependency controls."""
    if dev.type != "cuda" or not IS_NVIDIA or torch.cuda.get_device_capability(dev)[0] < 9:
        return False
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True
