"""``gh200_optimizations.managed_memory``: which memory a run takes from the managed pool, checked
before anything loads.

``caches`` (default): only ``unified_memory`` caches (:mod:`.uvm`); ``frozen_weights``: also the frozen
weights (:mod:`.managed_weights`); ``all``: every CUDA allocation of the process, bounded at
``oversubscription_ratio`` x the GPU's memory (the stock-PyTorch form of the ai-toolkit GH200 fork's
``use_uvm``). :func:`check_managed_memory` refuses, with every reason at once, what cannot work here;
:func:`start_managed_memory` then routes allocations for ``all``. The checks: documentation/GH200_OPTIMIZATION.md,
"What is checked at start".
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from simpletuner.configuration.alloc_conf import ALLOC_CONF_VAR
from simpletuner.gh200.uvm import set_batch_advice
from simpletuner.hardware.host import hbm_in_host_memory
from simpletuner.hardware.runtime import UnifiedMemoryRuntime, get_runtime

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

logger = logging.getLogger(__name__)

MODES = ("caches", "frozen_weights", "all")
#: What ``all`` adds to PYTORCH_CUDA_ALLOC_CONF where neither the environment nor ``cuda_allocator`` sets
#: the key (read from PyTorch's CUDACachingAllocator.cpp; a GPU has to confirm, scripts/gpu_probe.py):
#: routing every allocation to the pool keeps a "capture" open for the whole run, and while one is open the
#: allocator frees no cached block before an out-of-memory error except through ``max_split_size_mb``
#: (cached blocks of at least that size are released and the allocation retried); with
#: ``release_lock_on_cudamalloc`` the allocator's lock is not held while the pool's Python allocation
#: callback runs, so a thread holding the GIL and waiting for that lock cannot deadlock with it.
ALL_MODE_ALLOCATOR: dict[str, bool | int] = {"max_split_size_mb": 256, "release_lock_on_cudamalloc": True}
#: Share of what the machine can back that ``all`` leaves to the OS, datasets staged in RAM and the
#: caches when no ``oversubscription_ratio`` is given, and the most a given ratio may claim.
RESERVE_FRACTION = 0.10
GiB = 1 << 30


def _gib(nbytes: int | float) -> str:
    return f"{nbytes / GiB:.1f} GiB"


class _Device(Protocol):
    """What :func:`backable_bytes` reads of a device: a :class:`~simpletuner.hardware.runtime.DeviceMemoryInfo`, or
    a machine being planned for."""

    @property
    def integrated(self) -> bool: ...


def backable_bytes(
    info: _Device, free_device_bytes: int, available_host_bytes: int | None, hbm_in_host: bool = False
) -> int | None:
    """The most managed memory this machine can back: available CPU memory, plus the free GPU memory
    where that is separate from it (a discrete GPU; GH200 in CDMM mode), counted once where the OS already
    counts it (integrated GB10; GH200 in NUMA mode: ``hbm_in_host``); None when the CPU side is unknown."""
    if available_host_bytes is None:
        return None
    return available_host_bytes if info.integrated or hbm_in_host else available_host_bytes + free_device_bytes


@dataclass(frozen=True)
class ManagedMemoryPlan:
    """What a run takes from the managed pool, as decided at start (recorded in gh200_runtime.json)."""

    mode: str
    device: str | None = None  # the device kind, in words
    pool_limit_bytes: int | None = None  # ``all``: the pool's bound
    backable_bytes: int | None = None  # ``all``: what the machine can back, before the reserve
    oversubscription_ratio: float | None = None  # ``all``: the bound over the GPU's memory
    prefetch_blocks_ahead: int = 0  # ``frozen_weights``
    forced: bool = False  # on a discrete GPU, by force_managed_memory

    @property
    def places_frozen_weights(self) -> bool:
        """Whether the frozen weights are moved into managed memory when the model is built (``all``
        needs no move: every allocation, the weights' included, already comes from the pool)."""
        return self.mode == "frozen_weights"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        if self.mode == "caches":
            return "managed_memory caches: only unified_memory caches use managed memory"
        if self.mode == "frozen_weights":
            ahead = (
                f"prefetched {self.prefetch_blocks_ahead} block(s) ahead"
                if self.prefetch_blocks_ahead
                else "read in place (no prefetch)"
            )
            return f"managed_memory frozen_weights: frozen weights live in CPU memory, {ahead}, on a {self.device}"
        assert self.pool_limit_bytes is not None and self.backable_bytes is not None  # a checked "all" plan
        return (
            f"managed_memory all: every CUDA allocation comes from the managed pool, bounded at "
            f"{_gib(self.pool_limit_bytes)} ({self.oversubscription_ratio:.2f} x the GPU's memory; the machine backs "
            f"about {_gib(self.backable_bytes)}), on a {self.device}"
        )


def _alloc_settings(config: TrainingConfig, environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Allocator key -> (value, where it came from): the environment, overridden by ``cuda_allocator``."""
    found: dict[str, tuple[str, str]] = {}
    for item in filter(None, (environ.get(ALLOC_CONF_VAR) or "").split(",")):
        key, _, value = item.partition(":")
        found[key.strip()] = (value.strip(), f"{ALLOC_CONF_VAR} in the environment")
    for key, value in (config.cuda_allocator or {}).items():
        found[key] = (str(value), "cuda_allocator in the config")
    return found


def _allocator_problems(config: TrainingConfig, environ: Mapping[str, str]) -> list[str]:
    settings = _alloc_settings(config, environ)
    problems = []
    value, source = settings.get("expandable_segments", ("false", ""))
    if value.lower() in ("true", "1"):
        problems.append(
            f'managed_memory "all" with expandable_segments (set by {source}): every allocation comes from a pool '
            "with its own allocator (cudaMallocManaged), where PyTorch does not use expandable segments, so the "
            "setting could not be honoured. Remove expandable_segments there (scripts/setup_gh200_env.sh sets it "
            f'when {ALLOC_CONF_VAR} is unset: export {ALLOC_CONF_VAR}="" after sourcing it), or use managed_memory '
            '"frozen_weights"'
        )
    value, source = settings.get("backend", ("native", ""))
    if value != "native":
        problems.append(
            f'managed_memory "all" with backend {value} (set by {source}): the managed pool sits on PyTorch\'s '
            'native caching allocator; remove the backend setting or use managed_memory "frozen_weights"'
        )
    return problems


def allocator_settings(
    config: TrainingConfig, environ: Mapping[str, str]
) -> tuple[dict[str, bool | int | float], list[str]]:
    """The ``cuda_allocator`` settings to apply at start, and what ``all`` added to them (one line each).

    ``config.cuda_allocator`` as it is, plus, in ``managed_memory: all``, each key of
    :data:`ALL_MODE_ALLOCATOR` that neither the config nor PYTORCH_CUDA_ALLOC_CONF sets (a value the
    user set is kept, whatever it is)."""
    settings = dict(config.cuda_allocator or {})
    if config.gh200_optimizations.managed_memory != "all":
        return settings, []
    present = _alloc_settings(config, environ)
    added = {key: value for key, value in ALL_MODE_ALLOCATOR.items() if key not in present}
    notes = [
        f'managed_memory "all": {ALLOC_CONF_VAR} gets {key}:{value} (set it in cuda_allocator to choose another '
        "value): "
        + (
            "cached pool blocks of that size or more are released before an out-of-memory error"
            if key == "max_split_size_mb"
            else "the pool's allocation callback runs without the allocator's lock"
        )
        for key, value in added.items()
    ]
    return {**settings, **added}, notes


def frozen_weight_problems(config: TrainingConfig, mode: str) -> list[str]:
    opts = config.gh200_optimizations
    problems: list[str] = []
    if mode != "frozen_weights":
        return problems
    if config.base_model_precision != "no_change":
        problems.append(
            f'managed_memory "frozen_weights" with base_model_precision {config.base_model_precision}: quantised '
            "weights are tensor subclasses that cannot be moved into managed memory piece by piece. Use "
            'managed_memory "all" (their allocations come from the pool as they are made) or base_model_precision '
            "no_change"
        )
    if config.low_vram:
        problems.append(
            'managed_memory "frozen_weights" and low_vram both decide where idle weights live: low_vram copies '
            "them to CPU RAM and back for every validation, frozen_weights keeps them in CPU memory the GPU reads in "
            'place. Set low_vram false (or managed_memory "caches")'
        )
    if config.enable_compile and opts.prefetch_blocks_ahead:
        problems.append(
            'managed_memory "frozen_weights" prefetches from hooks around each block, which torch.compile cannot '
            "trace: set enable_compile false, or prefetch_blocks_ahead 0 (weights read in place)"
        )
    return problems


def managed_memory_problems(
    config: TrainingConfig,
    runtime: UnifiedMemoryRuntime | None = None,
    available_host_bytes: int | None = None,
    environ: Mapping[str, str] | None = None,
    memory_only_numa_bytes: int = 0,
) -> tuple[list[str], ManagedMemoryPlan]:
    """Every reason ``config``'s managed_memory cannot run here, and the plan when there is none
    (``memory_only_numa_bytes``: see :func:`hbm_in_host_memory`)."""
    opts = config.gh200_optimizations
    mode = opts.managed_memory
    if mode == "caches":
        return [], ManagedMemoryPlan("caches")
    runtime = runtime or get_runtime()
    environ = {} if environ is None else environ
    problems = frozen_weight_problems(config, mode)
    if mode == "all":
        problems += _allocator_problems(config, environ)
    reason = runtime.unavailable_reason()
    info = runtime.device_info() if reason is None else None
    if info is None:
        problems.append(
            f"managed_memory {mode!r} needs CUDA managed memory, which is unavailable here: "
            f'{reason or "the runtime reports no device"}. Use managed_memory "caches" on this machine'
        )
        return problems, ManagedMemoryPlan(mode)
    forced = False
    if not info.unified:
        if not opts.force_managed_memory:
            problems.append(
                f"managed_memory {mode!r} on {info.name}, a {info.kind}: managed memory the card cannot hold moves "
                "over PCIe page by page and training can slow by orders of magnitude (GH200 and GB10 read CPU memory "
                'in place). Use managed_memory "caches" here, or set gh200_optimizations.force_managed_memory true '
                "to run it anyway"
            )
        forced = True
    if mode == "frozen_weights":
        return problems, ManagedMemoryPlan(
            mode, info.kind, prefetch_blocks_ahead=opts.prefetch_blocks_ahead, forced=forced
        )
    routing = runtime.routing_problem()
    if routing is not None:
        problems.append(f'managed_memory "all" cannot route every allocation to the managed pool: {routing}')
    free, _ = runtime.mem_get_info()
    hbm_in_host = not info.integrated and hbm_in_host_memory(info.total_bytes, memory_only_numa_bytes)
    backable = backable_bytes(info, free, available_host_bytes, hbm_in_host)
    if backable is None:
        problems.append(
            'managed_memory "all": cannot tell how much memory this machine can back (MemAvailable in /proc/meminfo '
            'is unreadable), so the pool cannot be bounded safely; use managed_memory "frozen_weights"'
        )
        return problems, ManagedMemoryPlan(mode, info.kind, forced=forced)
    most = int(backable * (1 - RESERVE_FRACTION))
    ratio = opts.oversubscription_ratio
    if ratio is None:
        limit, ratio = most, most / info.total_bytes
    else:
        limit = int(ratio * info.total_bytes)
        if limit > most:
            side = (
                "available memory"
                if info.integrated
                else "available memory, the GPU's NUMA node included"
                if hbm_in_host
                else "available CPU memory + free GPU memory"
            )
            problems.append(
                f"oversubscription_ratio {ratio:g} bounds the managed pool at {_gib(limit)} ({ratio:g} x "
                f"{_gib(info.total_bytes)} of GPU memory), but this machine can back about {_gib(backable)} ({side}), "
                f"less a {RESERVE_FRACTION:.0%} reserve for the OS, datasets and caches: {_gib(most)}. The largest "
                f"ratio it backs now is {most / info.total_bytes:.2f}; lower the ratio or free memory"
            )
    return problems, ManagedMemoryPlan(mode, info.kind, limit, backable, round(ratio, 4), forced=forced)


def check_managed_memory(
    config: TrainingConfig,
    runtime: UnifiedMemoryRuntime | None = None,
    available_host_bytes: int | None = None,
    environ: Mapping[str, str] | None = None,
    memory_only_numa_bytes: int = 0,
) -> ManagedMemoryPlan:
    """The run's :class:`ManagedMemoryPlan`.

    Raises:
        ValueError: one line per reason the mode cannot run here (see :func:`managed_memory_problems`).
    """
    problems, plan = managed_memory_problems(config, runtime, available_host_bytes, environ, memory_only_numa_bytes)
    if problems:
        raise ValueError("\n".join(problems))
    return plan


def start_managed_memory(plan: ManagedMemoryPlan, runtime: UnifiedMemoryRuntime | None = None) -> None:
    """Say what the plan does; for ``all``, route every allocation to the bounded pool from now on
    (call before anything is allocated on the GPU: earlier allocations stay outside the pool)."""
    if plan.mode == "caches":
        return
    runtime = runtime or get_runtime()
    if plan.forced:
        logger.warning(
            "force_managed_memory: managed_memory %s on a %s; pages that do not fit the card move over PCIe",
            plan.mode,
            plan.device,
        )
    if plan.mode == "all":
        runtime.route_all_allocations(plan.pool_limit_bytes)
        set_batch_advice(False, 'managed_memory "all": batches come from the pool, whose blocks are reused')
    logger.info("%s", plan.describe())


def stop_managed_memory(plan: ManagedMemoryPlan, runtime: UnifiedMemoryRuntime | None = None) -> None:
    """When training ends: for ``all``, end the routing (later allocations come from PyTorch's own pools;
    what the pool holds stays valid until it is freed) and say what the pool held at its peak."""
    if plan.mode != "all":
        return
    runtime = runtime or get_runtime()
    runtime.end_routing()
    set_batch_advice(True)
    stats = runtime.pool_stats()
    if stats:
        logger.info(
            'managed_memory "all" ended: the pool held at most %s of its %s bound (%d allocation(s) refused)',
            _gib(stats.get("peak_bytes") or 0),
            _gib(stats["limit_bytes"]) if stats.get("limit_bytes") else "unbounded",
            stats.get("num_refused") or 0,
        )


def place_weights(model, plan: ManagedMemoryPlan, runtime=None, prefetch: bool = True):
    """``frozen_weights``: move ``model``'s frozen weights into managed memory (resident in CPU memory,
    the GPU mapped to them) and, with ``prefetch`` and ``prefetch_blocks_ahead`` > 0, start the
    per-block prefetcher, which is returned (None otherwise). Other modes: nothing, None."""
    if not plan.places_frozen_weights:
        return None
    from simpletuner.gh200.managed_weights import WeightPrefetcher, place_frozen_weights

    place_frozen_weights(model, runtime)
    if not prefetch or not plan.prefetch_blocks_ahead:
        return None
    return WeightPrefetcher(model, plan.prefetch_blocks_ahead, runtime)
