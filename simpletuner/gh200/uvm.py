"""Unified-memory placement hints for GH200 / GB10, safe everywhere else.

On a GH200 the GPU reaches the Grace CPU's RAM over a 900 GB/s coherent link; on a GB10 CPU
and GPU share one memory. Tensors in CUDA managed memory can live in either place, and two
hints make that cheap: where a tensor should *reside* (latents: CPU RAM, which is large;
text embeddings and masks: GPU memory, which is fast and they are small and reused) and a
*prefetch* that migrates a tensor in bulk before a kernel needs it instead of page by page.

Every function here returns its input unchanged, and does nothing, when hints are off, when
there is no CUDA or no managed-memory support, or when the tensor is not in managed memory
(advice is only legal on managed pointers). Why hints are off is said once, at INFO.

Whether hints are on: :func:`set_uvm_hint_override` (from the config) beats the environment
variable ``SIMPLETUNER_GH200_UVM_HINTS`` (1/0), which beats the default (off).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Literal

import torch

from simpletuner.gh200.runtime import Location, get_runtime

logger = logging.getLogger(__name__)

ENV_VAR = "SIMPLETUNER_GH200_UVM_HINTS"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

_override: bool | None = None
_said: set[str] = set()
_said_lock = threading.Lock()


def _say_once(level: int, message: str, *args: Any) -> None:
    text = message % args if args else message
    with _said_lock:
        if text in _said:
            return
        _said.add(text)
    logger.log(level, text)


def set_uvm_hint_override(value: bool | None) -> None:
    """Force hints on (True) or off (False); None hands the choice back to the environment."""
    global _override
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"set_uvm_hint_override takes True, False or None, not {value!r}")
    _override = value


def _requested() -> tuple[bool, str]:
    """Whether hints are asked for, and by whom."""
    if _override is not None:
        return _override, f"gh200_optimizations / cache_config set them {'on' if _override else 'off'}"
    raw = os.environ.get(ENV_VAR)
    if raw is not None:
        value = raw.strip().lower()
        if value in _TRUE:
            return True, f"{ENV_VAR}={raw}"
        if value in _FALSE:
            return False, f"{ENV_VAR}={raw}"
        _say_once(logging.WARNING, "%s=%r is not 1/0 (or true/false); ignoring it", ENV_VAR, raw)
    return False, f"off by default (set {ENV_VAR}=1 or gh200_optimizations.enable_uvm_hints)"


_decided: tuple[tuple, bool] | None = None  # ((override, env value, runtime), answer): asked per tensor


def gh200_uvm_enabled() -> bool:
    """True when hints are asked for and managed memory is usable here.

    Called for every tensor a unified-memory cache hands out, so the answer is kept until the
    override, the environment variable or the runtime changes.
    """
    global _decided
    key = (_override, os.environ.get(ENV_VAR), id(get_runtime()))
    if _decided is not None and _decided[0] == key:
        return _decided[1]
    answer = _decide()
    _decided = (key, answer)
    return answer


def _decide() -> bool:
    wanted, why = _requested()
    if not wanted:
        _say_once(logging.INFO, "GH200 unified-memory hints are off: %s", why)
        return False
    reason = get_runtime().unavailable_reason()
    if reason is not None:
        _say_once(logging.INFO, "GH200 unified-memory hints are off: %s", reason)
        return False
    return True


def _device_index(device: torch.device | int | str | None) -> Location:
    if device is None:
        return get_runtime().current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    return device.index if device.index is not None else get_runtime().current_device()


def _advisable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() > 0 and gh200_uvm_enabled() and get_runtime().is_managed(t)


def prefer_cpu_residency(t: torch.Tensor) -> torch.Tensor:
    """Advise ``t`` to live in CPU RAM while the GPU keeps a mapping to it; returns ``t``."""
    if _advisable(t):
        runtime = get_runtime()
        runtime.advise(t, "preferred_location", "cpu")
        runtime.advise(t, "accessed_by", runtime.current_device())
    return t


def prefer_gpu_residency(t: torch.Tensor) -> torch.Tensor:
    """Advise ``t`` to live in GPU memory; returns ``t``."""
    if _advisable(t):
        runtime = get_runtime()
        runtime.advise(t, "preferred_location", runtime.current_device())
    return t


def prefetch_to_device(t: torch.Tensor, device: torch.device | int | str | None = None, stream=None) -> torch.Tensor:
    """Start migrating ``t`` to ``device`` (default: the current GPU) on ``stream`` (default:
    the current stream), so kernels queued after it find the pages in place; returns ``t``."""
    if _advisable(t):
        handle = getattr(stream, "cuda_stream", stream)
        get_runtime().prefetch(t, _device_index(device), handle)
    return t


Role = Literal["latent", "embedding", "other"]


def _role(key: str) -> Role:
    name = key.lower()
    if "latent" in name:
        return "latent"
    if "embed" in name or "hidden_states" in name or "mask" in name:
        return "embedding"
    return "other"


def optimize_batch_for_gh200(batch: Any, _role_hint: Role = "other") -> Any:
    """Hint and prefetch every managed tensor of a batch; returns the same structure.

    Dicts, lists and tuples are walked; a tensor's role comes from the nearest key naming it:
    ``*latent*`` -> CPU residency; ``*embed*``, ``*hidden_states*``, ``*mask*`` -> GPU
    residency. Every managed tensor is then prefetched to the current GPU on the current
    stream. Non-managed tensors and other values pass through untouched.
    """
    if isinstance(batch, dict):
        return {k: optimize_batch_for_gh200(v, _role(str(k)) if _role(str(k)) != "other" else _role_hint) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [optimize_batch_for_gh200(v, _role_hint) for v in batch]
        return type(batch)(items) if not hasattr(batch, "_fields") else type(batch)(*items)
    if not _advisable(batch):
        return batch
    if _role_hint == "latent":
        prefer_cpu_residency(batch)
    elif _role_hint == "embedding":
        prefer_gpu_residency(batch)
    return prefetch_to_device(batch)


Prefer = Literal["cpu", "gpu"]


def to_unified(t: torch.Tensor, prefer: Prefer = "cpu") -> torch.Tensor:
    """A copy of ``t`` in managed memory advised to reside on the ``prefer`` side.

    Falls back, saying so once at WARNING, to pinned CPU memory where CUDA works but managed
    memory does not, and to plain CPU memory where there is no CUDA: training goes on.
    """
    runtime = get_runtime()
    reason = runtime.unavailable_reason()
    if reason is None:
        managed = runtime.managed_empty(tuple(t.shape), t.dtype)
        managed.copy_(t)
        if gh200_uvm_enabled():
            if prefer == "cpu":
                prefer_cpu_residency(managed)
                runtime.prefetch(managed, "cpu", None)
            else:
                prefer_gpu_residency(managed)
        return managed
    if runtime.cuda_available():
        _say_once(logging.WARNING, "unified memory unavailable (%s); using pinned CPU memory for the cache", reason)
        return runtime.pin(t.contiguous())
    _say_once(logging.WARNING, "unified memory unavailable (%s); keeping the cache in plain CPU memory", reason)
    return t.clone(memory_format=torch.contiguous_format)


def unified_memory_status() -> dict[str, Any]:
    """What this process can do: managed memory available or why not, hints on, the device."""
    runtime = get_runtime()
    info = runtime.device_info() if runtime.cuda_available() else None
    reason = runtime.unavailable_reason()
    return {
        "managed_memory_available": reason is None,
        "reason": reason,
        "hints_enabled": gh200_uvm_enabled(),
        "device": info.as_dict() if info is not None else None,
    }


def _reset_for_tests() -> None:
    """Forget the override and what was said (tests only)."""
    global _override, _decided
    _override = None
    _decided = None
    with _said_lock:
        _said.clear()
