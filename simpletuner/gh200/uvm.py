"""Unified-memory placement hints for GH200 / GB10, safe everywhere else.

Tensors in CUDA managed memory can live in CPU RAM or GPU memory; these functions advise where a tensor
should reside (latents: CPU RAM; text embeddings and masks: GPU memory) and prefetch it before a kernel
needs it. Every one returns its input unchanged, and does nothing, when hints are off, without CUDA or
managed-memory support, or for a tensor not in managed memory; why hints are off is said once.
Whether hints are on: :func:`set_uvm_hint_override` (from the config) beats ``SIMPLETUNER_GH200_UVM_HINTS``
(alias ``SIMPLETUNER_GH200_ENABLE_UVM_HINTS``), which beats the default (off); hints forced off turn
``unified_memory`` caches into CPU-backed ``memory`` caches. documentation/GH200_OPTIMIZATION.md
("Unified-memory hints", "Each batch: what runs") has the details.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Iterator, Literal, Mapping, Sequence

import torch

from simpletuner.hardware.runtime import Location, get_runtime

logger = logging.getLogger(__name__)

ENV_VAR = "SIMPLETUNER_GH200_UVM_HINTS"
#: The ai-toolkit GH200 fork's name for ENV_VAR (its setup script exports it); read as an alias.
ENV_ALIAS = "SIMPLETUNER_GH200_ENABLE_UVM_HINTS"
ENV_VARS = (ENV_VAR, ENV_ALIAS)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

_override: tuple[bool, str] | None = None  # (hints on?, the setting that said so)
_said: set[str] = set()
_said_lock = threading.Lock()


def _say_once(level: int, message: str, *args: Any) -> None:
    text = message % args if args else message
    with _said_lock:
        if text in _said:
            return
        _said.add(text)
    logger.log(level, text)


def set_uvm_hint_override(value: bool | None, source: str | None = None) -> None:
    """Force hints on (True) or off (False); None hands the choice back to the environment.

    ``source`` names the setting that decided it (e.g. ``"gh200_optimizations.enable_uvm_hints=false"``),
    for the log lines that say why hints are on or off.
    """
    global _override
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"set_uvm_hint_override takes True, False or None, not {value!r}")
    _override = None if value is None else (value, source or f"the config set them {'on' if value else 'off'}")


def env_hint_request(environ: Mapping[str, str] | None = None) -> tuple[bool | None, str]:
    """What the environment asks for: ``(True | False, "NAME=value")``, or ``(None, "")`` when
    neither name holds a 1/0 value (a value that is neither is ignored, with a warning, once).

    Raises:
        ValueError: ``SIMPLETUNER_GH200_UVM_HINTS`` and its alias ``SIMPLETUNER_GH200_ENABLE_UVM_HINTS``
            are both set to values that disagree: no silent winner.
    """
    environ = os.environ if environ is None else environ
    found: list[tuple[str, str, bool]] = []
    for name in ENV_VARS:
        raw = environ.get(name)
        if raw is None:
            continue
        value = raw.strip().lower()
        if value in _TRUE or value in _FALSE:
            found.append((name, raw, value in _TRUE))
        else:
            _say_once(logging.WARNING, "%s=%r is not 1/0 (or true/false); ignoring it", name, raw)
    if not found:
        return None, ""
    if len({wanted for _, _, wanted in found}) > 1:
        (name_a, raw_a, _), (name_b, raw_b, _) = found
        raise ValueError(
            f"environment: {name_a}={raw_a!r} and {name_b}={raw_b!r} disagree about unified-memory hints. "
            f"{name_b} is the ai-toolkit GH200 fork's name for {name_a} (scripts/setup_gh200_env.sh of that fork "
            f"exports it), and simpletuner reads both. Fix: unset one of them (e.g. `unset {name_b}`) or give both "
            "the same value; gh200_optimizations.enable_uvm_hints in the config overrides both"
        )
    return found[0][2], " and ".join(f"{name}={raw}" for name, raw, _ in found)


def _requested() -> tuple[bool, bool, str]:
    """Whether hints are asked for, whether explicitly (config or environment), and by whom."""
    if _override is not None:
        return _override[0], True, _override[1]
    wanted, source = env_hint_request()
    if wanted is not None:
        return wanted, True, source
    return False, False, f"off by default (set {ENV_VAR}=1 or gh200_optimizations.enable_uvm_hints)"


def hints_forced_off() -> str | None:
    """The setting that turned hints off explicitly (config or environment), or None when hints
    are on or only off by default."""
    wanted, explicit, why = _requested()
    return why if explicit and not wanted else None


def unified_caches_fall_back_to_cpu() -> bool:
    """True when a ``unified_memory`` cache must be a CPU-backed ``memory`` cache: hints are
    forced off (seed 002: "setting the flag to false returns to standard CPU-backed caches").
    Says so once, at WARNING, naming both settings and what is used."""
    why = hints_forced_off()
    if why is None:
        return False
    _say_once(
        logging.WARNING,
        "cache_config: caches of type `unified_memory` are CPU-backed `memory` caches in this run, because "
        "unified-memory hints are forced off by %s (hints off means standard CPU caches: no managed memory, no "
        "advice, no prefetch). For managed memory, turn that setting on or remove it.",
        why,
    )
    return True


def cache_type_in_use(kind: str) -> str:
    """The cache type a configured ``kind`` is opened as: ``unified_memory`` is a CPU-backed
    ``memory`` cache while unified-memory hints are forced off (config or environment; the log
    says so once); every other type is itself."""
    if kind != "unified_memory":
        return kind
    return "memory" if unified_caches_fall_back_to_cpu() else kind


def cache_type_used(kind: str) -> str:
    """What a configured ``kind`` really holds its entries in, for the run's record: as
    :func:`cache_type_in_use`, except that a ``unified_memory`` cache where managed memory is not
    usable (no CUDA, no cuda-bindings) is a ``memory`` one in effect: :func:`to_unified` keeps its
    entries in plain (or pinned) CPU memory."""
    kind = cache_type_in_use(kind)
    if kind == "unified_memory" and get_runtime().unavailable_reason() is not None:
        return "memory"
    return kind


_decided: tuple[tuple, bool] | None = None  # ((override, env values, runtime), answer): asked per tensor


def gh200_uvm_enabled() -> bool:
    """True when hints are asked for and managed memory is usable here.

    Called for every tensor a unified-memory cache hands out, so the answer is kept until the
    override, the environment variables or the runtime change.

    Raises:
        ValueError: the two environment names disagree (see :func:`env_hint_request`).
    """
    global _decided
    key = (_override, os.environ.get(ENV_VAR), os.environ.get(ENV_ALIAS), id(get_runtime()))
    if _decided is not None and _decided[0] == key:
        return _decided[1]
    answer = _decide()
    _decided = (key, answer)
    return answer


def _decide() -> bool:
    wanted, explicit, why = _requested()
    if not wanted:  # off by default (an ordinary run): DEBUG; turned off by a setting: INFO
        _say_once(logging.INFO if explicit else logging.DEBUG, "GH200 unified-memory hints are off: %s", why)
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


def _advise_cpu(runtime, t: torch.Tensor, gpu: Location) -> None:
    runtime.advise(t, "preferred_location", "cpu")
    runtime.advise(t, "accessed_by", gpu)


def prefer_cpu_residency(t: torch.Tensor) -> torch.Tensor:
    """Advise ``t`` to live in CPU RAM while the GPU keeps a mapping to it; returns ``t``."""
    if _advisable(t):
        runtime = get_runtime()
        _advise_cpu(runtime, t, runtime.current_device())
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


def _tensors_by_role(value: Any, role: Role) -> Iterator[tuple[torch.Tensor, Role]]:
    """Every tensor in nested dicts / lists / tuples, with the role of the nearest key naming one."""
    if isinstance(value, torch.Tensor):
        yield value, role
    elif isinstance(value, Mapping):
        for key, item in value.items():
            named = _role(str(key))
            yield from _tensors_by_role(item, role if named == "other" else named)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_by_role(item, role)


#: Whether :func:`optimize_batch_for_gh200` advises where a batch's pages live; off while every allocation
#: comes from the managed pool (``managed_memory: all``): advice sticks to the address range, and the pool
#: reuses a freed batch's blocks for activations, which would inherit "preferred CPU".
_batch_advice: tuple[bool, str] = (True, "")


def set_batch_advice(enabled: bool, why: str = "") -> None:
    """Turn per-batch residency advice on or off (prefetch stays); ``why`` is logged once when off."""
    global _batch_advice
    _batch_advice = (enabled, why)
    if not enabled:
        _say_once(logging.INFO, "per-batch residency advice is off (prefetch stays on): %s", why)


def optimize_batch_for_gh200(batch: Any, device: torch.device | int | str | None = None, stream=None) -> Any:
    """Place and prefetch the managed tensors of one prepared batch; returns ``batch`` itself (nothing copied).

    Mappings, lists and tuples are walked; a tensor's role comes from the nearest key naming it:
    ``*latent*`` -> advised to reside in CPU RAM with ``device`` keeping a mapping; ``*embed*``,
    ``*hidden_states*``, ``*mask*`` -> advised to reside on ``device``; others get no advice. Each managed
    allocation is then prefetched to ``device`` (default: the current GPU) on ``stream`` (default: the
    current stream), once. With per-batch advice off (:func:`set_batch_advice`) only the prefetch runs.
    With hints off, without CUDA or managed memory, it returns at once; ordinary tensors are skipped.
    """
    if not gh200_uvm_enabled():
        return batch
    runtime = get_runtime()
    location = _device_index(device)
    gpu = location if location != "cpu" else runtime.current_device()
    handle = getattr(stream, "cuda_stream", stream)
    advise = _batch_advice[0]
    done: set[int] = set()
    for tensor, role in _tensors_by_role(batch, "other"):
        if tensor.numel() == 0 or not runtime.is_managed(tensor):
            continue
        storage = tensor.untyped_storage().data_ptr()
        if storage in done:  # advice and prefetch cover the whole allocation: once is enough
            continue
        done.add(storage)
        if role == "latent" and advise:
            _advise_cpu(runtime, tensor, gpu)
        elif role == "embedding" and advise:
            runtime.advise(tensor, "preferred_location", gpu)
        runtime.prefetch(tensor, location, handle)
    return batch


def stack_unified(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)``, into managed memory when the tensors are managed (the entries of
    a ``unified_memory`` cache), so :func:`optimize_batch_for_gh200` can place the stacked batch;
    an ordinary ``torch.stack`` otherwise."""
    first = tensors[0]
    runtime = get_runtime()
    if runtime.unavailable_reason() is not None or not runtime.is_managed(first):
        return torch.stack(list(tensors))
    out = runtime.managed_empty((len(tensors), *first.shape), first.dtype)
    return torch.stack(list(tensors), out=out)


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
    global _override, _decided, _batch_advice
    _override = None
    _decided = None
    _batch_advice = (True, "")
    with _said_lock:
        _said.clear()
