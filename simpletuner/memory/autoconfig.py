"""Auto-config: the largest micro-batch that fits, the accumulation that keeps the effective batch.

:func:`plan_batch` searches the micro-batches that split the target effective batch exactly, with and
without gradient checkpointing, each estimate made once (:class:`EstimateCache`); the micro-batch is also
capped by the largest aspect bucket (:func:`scan_data_cap`). The rules and their reasons:
documentation/MEMORY.md, "Auto-config".
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from simpletuner.configuration.cache_paths import trained_datasets
from simpletuner.data_backend.buckets import bucket_name
from simpletuner.data_backend.local import LocalDataBackend
from simpletuner.data_backend.metadata import build_metadata
from simpletuner.memory import estimate_store
from simpletuner.memory.advice import (
    DDP_BUCKETS,
    VALIDATION_MODELS,
    does_not_fit_message,
    format_bytes,
    suggest_switches,
)
from simpletuner.memory.components import validation_model_bytes
from simpletuner.memory.estimator import MemoryBreakdown, estimate_memory

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

DEFAULT_SAFETY_MARGIN = 0.85


class DoesNotFit(ValueError):
    """Even the smallest plan does not fit; the message says what dominates and what would help."""

    def __init__(self, message: str, breakdown: MemoryBreakdown, total: int, budget: int):
        super().__init__(message)
        self.breakdown, self.total, self.budget = breakdown, total, budget


# --- what the run holds besides the denoiser ----------------------------------------------------
def extra_bytes(
    config: "TrainingConfig", breakdown: MemoryBreakdown, num_processes: int = 1, validation_bytes: int | None = None
) -> dict[str, int]:
    """What the run keeps on each GPU beside the denoiser's breakdown, by name (zero rows left out).

    ``validation models``: see :func:`.components.validation_model_bytes` (pass it to avoid rebuilding); with
    ``low_vram`` only what exceeds the activations they replace on the GPU while sampling.
    ``DDP gradient buckets``: with several processes, DistributedDataParallel copies gradients
    into buckets for the all-reduce (Accelerate's default ``gradient_as_bucket_view=False``):
    one more copy of the gradients.
    """
    extras = {}
    validation = validation_model_bytes(config) if validation_bytes is None else validation_bytes
    if validation and config.low_vram:
        # They visit the GPU only while sampling, when no training activations are held.
        validation = max(0, validation - breakdown.activations)
    if validation:
        extras[VALIDATION_MODELS] = validation
    if num_processes > 1:
        extras[DDP_BUCKETS] = breakdown.gradients
    return extras


# --- cached estimates ----------------------------------------------------------------------------
EstimateFn = Callable[["TrainingConfig", int], MemoryBreakdown]


def _default_estimate(config: "TrainingConfig", batch_size: int) -> MemoryBreakdown:
    return estimate_memory(config, batch_size, device_kind="cuda")


@dataclass
class Estimate:
    """One estimated candidate: the breakdown, the extras and their sum."""

    micro_batch_size: int
    gradient_checkpointing: bool
    breakdown: MemoryBreakdown
    extras: dict[str, int]
    seconds: float
    cached: bool = False  # read from the estimate cache (simpletuner/memory/estimate_store.py), not remade

    @property
    def total(self) -> int:
        return self.breakdown.total + sum(self.extras.values())


class EstimateCache:
    """Estimates of one config per ``(micro-batch, checkpointing)``, each made once.

    ``estimate_fn`` defaults to :func:`estimate_memory` for CUDA, also kept on disk between runs
    (:mod:`.estimate_store`); tests pass a cheap one. Share one cache between plans for several memory sizes.
    """

    def __init__(self, config: "TrainingConfig", num_processes: int = 1, estimate_fn: EstimateFn | None = None):
        self.config, self.num_processes = config, num_processes
        self.estimate_fn = estimate_fn or _default_estimate
        self._done: dict[tuple[int, bool], Estimate] = {}
        self._validation_bytes: int | None = None

    def __call__(self, micro_batch_size: int, gradient_checkpointing: bool) -> Estimate:
        key = (micro_batch_size, gradient_checkpointing)
        if key not in self._done:
            variant = self.config.model_copy(update={"gradient_checkpointing": gradient_checkpointing})
            start = time.perf_counter()
            on_disk = self.estimate_fn is _default_estimate  # tests' own estimates are not kept
            stored = estimate_store.lookup(variant, micro_batch_size) if on_disk else None
            if stored is not None:
                breakdown, self._validation_bytes = stored
            else:
                breakdown = self.estimate_fn(variant, micro_batch_size)
                if self._validation_bytes is None:
                    self._validation_bytes = validation_model_bytes(self.config) or 0
                if on_disk:
                    estimate_store.keep(variant, micro_batch_size, breakdown, self._validation_bytes)
            extras = extra_bytes(variant, breakdown, self.num_processes, self._validation_bytes)
            seconds, cached = time.perf_counter() - start, stored is not None
            self._done[key] = Estimate(micro_batch_size, gradient_checkpointing, breakdown, extras, seconds, cached)
        return self._done[key]

    @property
    def made(self) -> list[Estimate]:
        """Every estimate made so far, in the order made."""
        return list(self._done.values())


# --- what the data allows --------------------------------------------------------------------------
@dataclass(frozen=True)
class DataCap:
    """The largest aspect bucket of the config's datasets, which caps the micro-batch.

    ``largest``: samples (repeats included) in the fullest ``(dataset, bucket)`` group, the rule
    :class:`~simpletuner.data_backend.BucketSampler` applies; ``where``: that group, in words.
    ``largest`` is None when the datasets could not be scanned here; ``reason`` says why.
    """

    largest: int | None
    where: str = ""
    reason: str = ""
    group_sizes: tuple[int, ...] = ()  # every (dataset, bucket) group's sample count

    def micro_batch_limit(self, num_processes: int) -> int | None:
        """The largest micro-batch per process the largest bucket fills; None when unknown."""
        return None if self.largest is None else self.largest // num_processes

    def describe(self) -> str:
        if self.largest is None:
            return f"unknown ({self.reason})"
        return f"the largest bucket ({self.where}) holds {self.largest} samples"

    def as_dict(self) -> dict[str, Any]:
        return {"largest_bucket": self.largest, "where": self.where, "reason": self.reason or None}


def scan_data_cap(config: "TrainingConfig") -> DataCap:
    """Scan the config's datasets as ``train`` would (image headers only: sizes, captions, buckets;
    nothing is decoded or staged) and return the largest bucket. The cap is unknown, with the
    reason, when the config has no datasets or a dataset's folder is not on this machine or the
    scan refuses it (``train`` would refuse it too)."""
    if not config.datasets:
        return DataCap(None, reason="the config has no datasets here (data_backend_config not found?)")
    groups: Counter[tuple[str, tuple[int, int]]] = Counter()
    for dataset_cfg in trained_datasets(config):  # `disabled` / `probability: 0` ones are never read
        root = Path(dataset_cfg.instance_data_dir).expanduser()
        if not root.is_dir():
            return DataCap(None, reason=f"dataset {dataset_cfg.id!r}: {root} is not a folder on this machine")
        try:
            # Local reads for every type: an in_memory dataset's headers are the same files, unstaged.
            metadata = build_metadata(LocalDataBackend(root, dataset_cfg.id), dataset_cfg, config, seed=config.seed)
        except (ValueError, ImportError) as exc:
            return DataCap(None, reason=f"the dataset scan failed, and train would stop on it too: {exc}")
        groups.update((s.dataset_id, s.bucket) for s in metadata.samples)
    (dataset_id, bucket), largest = max(groups.items(), key=lambda kv: (kv[1], kv[0]))
    return DataCap(largest, f"dataset {dataset_id!r}, {bucket_name(bucket)}", group_sizes=tuple(groups.values()))


class DataTooSmall(ValueError):
    """No micro-batch the target allows is filled by the largest bucket (on every process)."""


# --- the search ----------------------------------------------------------------------------------
def divisors(n: int) -> list[int]:
    """Sorted divisors of ``n`` (n >= 1)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def largest_fitting(candidates: list[int], fits: Callable[[int], bool]) -> int | None:
    """The largest of the sorted ``candidates`` for which ``fits`` holds, assuming it holds for a
    prefix (memory grows with the micro-batch); the largest is tried first. None when none fits."""
    if not candidates:
        return None
    if fits(candidates[-1]):
        return candidates[-1]
    lo, hi = 0, len(candidates) - 2  # the answer lies in candidates[lo..hi], or nowhere
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            best, lo = candidates[mid], mid + 1
        else:
            hi = mid - 1
    return best


@dataclass(frozen=True)
class RampTarget:
    """The accumulation ramp of ``gh200_optimizations``: the effective batch grows from initial to target."""

    initial: int
    target: int

    def windows(self, per_micro_batch: int) -> tuple[int, int]:
        """Accumulation at the ramp's start and end with ``per_micro_batch`` samples per micro-step (all processes)."""
        return self.initial // per_micro_batch, self.target // per_micro_batch


def config_ramp(config: "TrainingConfig") -> RampTarget | None:
    """The config's accumulation ramp, or None when it does not ramp."""
    opts = config.gh200_optimizations
    if not opts.enable_batch_size_rampup:
        return None
    initial, target = opts.initial_effective_batch_size, opts.target_effective_batch_size
    assert initial is not None and target is not None  # the config's rules require both with the ramp on
    return RampTarget(initial, target)


def current_effective_batch(config: "TrainingConfig", num_processes: int = 1) -> int:
    """Samples per optimizer step the config trains with (the ramp's target when it ramps)."""
    ramp = config_ramp(config)
    if ramp is not None:
        return ramp.target
    return config.train_batch_size * config.gradient_accumulation_steps * num_processes


def micro_batch_candidates(target: int, num_processes: int = 1, ramp: RampTarget | None = None) -> list[int]:
    """Micro-batches that split ``target`` exactly over ``num_processes``; with a ramp, also those
    its start allows (the ramp needs both ends to be multiples of the micro-batch, and its start
    to hold at least one micro-batch on every process)."""
    if target < 1 or num_processes < 1:
        raise ValueError(f"the effective batch and the process count must be >= 1, got {target} and {num_processes}")
    if target % num_processes:
        raise ValueError(
            f"an effective batch of {target} does not split over {num_processes} processes; use a multiple of "
            f"{num_processes} (e.g. {max(num_processes, target // num_processes * num_processes)})"
        )
    candidates = divisors(target // num_processes)
    if ramp is not None:
        candidates = [m for m in candidates if ramp.initial % m == 0 and m * num_processes <= ramp.initial]
    return candidates


@dataclass
class Plan:
    """What :func:`plan_batch` chose, and what it looked at."""

    micro_batch_size: int
    gradient_accumulation_steps: int  # with a ramp: the window at the ramp's target
    gradient_checkpointing: bool
    effective_batch_size: int
    num_processes: int
    usable_bytes: int
    safety_margin: float
    estimate: Estimate  # the chosen candidate
    candidates: list[int]
    tried: list[Estimate]  # every candidate the search looked at, in order
    without_checkpointing: Estimate | None = None  # when checkpointing is chosen: the best plan without it
    ramp: RampTarget | None = None
    notes: list[str] = field(default_factory=list)
    data: DataCap | None = None  # the largest bucket; None: not looked at (the caller passed none)
    capped_by_data: list[int] = field(default_factory=list)  # micro-batches left out: the data cannot fill them
    #: Whether a candidate fits (a managed_memory mode's rule); None: its total within the budget.
    fits_fn: Callable[[Estimate], bool] | None = None

    @property
    def budget_bytes(self) -> int:
        return int(self.safety_margin * self.usable_bytes)

    def fits(self, estimate: Estimate) -> bool:
        """Whether ``estimate`` fits this plan's rule (by default: its total within the budget)."""
        return estimate.total <= self.budget_bytes if self.fits_fn is None else self.fits_fn(estimate)

    @property
    def ramp_windows(self) -> tuple[int, int] | None:
        """Accumulation at the ramp's start and end, with this micro-batch."""
        return None if self.ramp is None else self.ramp.windows(self.micro_batch_size * self.num_processes)

    def config_updates(self) -> dict[str, Any]:
        """Top-level config keys this plan sets (accumulation is the ramp's business when it ramps)."""
        updates: dict[str, Any] = {"train_batch_size": self.micro_batch_size}
        if self.ramp is None:
            updates["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        updates["gradient_checkpointing"] = self.gradient_checkpointing
        return updates

    def as_dict(self) -> dict[str, Any]:
        alt = self.without_checkpointing
        return {
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "gradient_checkpointing": self.gradient_checkpointing,
            "effective_batch_size": self.effective_batch_size,
            "num_processes": self.num_processes,
            "usable_bytes": self.usable_bytes,
            "safety_margin": self.safety_margin,
            "budget_bytes": self.budget_bytes,
            "total_bytes": self.estimate.total,
            "extras": dict(self.estimate.extras),
            "estimate": self.estimate.breakdown.as_dict(),
            "candidates": list(self.candidates),
            "tried": [
                {
                    "micro_batch_size": e.micro_batch_size,
                    "gradient_checkpointing": e.gradient_checkpointing,
                    "total_bytes": e.total,
                    "fits": self.fits(e),
                }
                for e in self.tried
            ],
            "without_checkpointing": None
            if alt is None
            else {"micro_batch_size": alt.micro_batch_size, "total_bytes": alt.total},
            "ramp": None if self.ramp is None else self._ramp_dict(self.ramp),
            "config_updates": self.config_updates(),
            "notes": list(self.notes),
            "data_cap": None
            if self.data is None
            else {
                **self.data.as_dict(),
                "micro_batch_limit": self.data.micro_batch_limit(self.num_processes),
                "left_out": list(self.capped_by_data),
                "limited": self.is_capped_by_data,
            },
        }

    def _ramp_dict(self, ramp: RampTarget) -> dict[str, Any]:
        windows = ramp.windows(self.micro_batch_size * self.num_processes)
        return {"initial": ramp.initial, "target": ramp.target, "windows": list(windows)}

    @property
    def is_capped_by_data(self) -> bool:
        """Whether the data, not memory, stopped the micro-batch: larger candidates were left out
        and the largest one the data fills was chosen."""
        kept = [m for m in self.candidates if m not in self.capped_by_data]
        return bool(self.capped_by_data) and self.micro_batch_size == kept[-1]


def resolve_target(config: "TrainingConfig", target: int | None, num_processes: int) -> int:
    """The effective batch to plan for: ``target``, else the config's own; with a ramp, its target
    (a different ``target`` is refused: the ramp's numbers are the user's to change)."""
    ramp = config_ramp(config)
    if ramp is not None:
        if target is not None and target != ramp.target:
            raise ValueError(
                f"this config ramps the effective batch from {ramp.initial} to {ramp.target} "
                f"(gh200_optimizations.enable_batch_size_rampup): the ramp decides the accumulation, so the plan keeps "
                f"its target. Pass --target-effective-batch {ramp.target}, or change "
                f"gh200_optimizations.initial_/target_effective_batch_size in the config first"
            )
        return ramp.target
    return current_effective_batch(config, num_processes) if target is None else target


def plan_batch(
    config: "TrainingConfig",
    usable_bytes: int,
    target_effective_batch: int | None = None,
    *,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    num_processes: int = 1,
    estimates: EstimateCache | None = None,
    data: DataCap | None = None,
    fits: Callable[[Estimate], bool] | None = None,
) -> Plan:
    """The largest micro-batch (and its accumulation) that trains ``config`` under
    ``safety_margin x usable_bytes``; :class:`DoesNotFit` when micro-batch 1 with checkpointing
    does not fit either. ``target_effective_batch`` defaults to the config's (the ramp's target
    when it ramps).

    ``data`` (:func:`scan_data_cap`) leaves out micro-batches larger than the largest bucket
    fills on every process (``train`` would refuse them); :class:`DataTooSmall` when it fills none.
    ``fits`` replaces the rule "the total within the budget" (a managed_memory mode's HBM and CPU
    budgets: :func:`simpletuner.memory.managed_plan.mode_fits`).
    """
    budget = _budget_bytes(safety_margin, usable_bytes)
    estimates = estimates or EstimateCache(config, num_processes)
    if estimates.num_processes != num_processes:
        raise ValueError("the estimate cache was made for another process count")
    target = resolve_target(config, target_effective_batch, num_processes)
    ramp = config_ramp(config)
    candidates, capped = _search_candidates(target, num_processes, ramp, data)
    search = _Search(estimates, fits if fits is not None else lambda estimate: estimate.total <= budget)
    choice = search.choose(candidates)
    if choice is None:
        smallest = search.lookup(candidates[0], True)
        raise DoesNotFit(
            does_not_fit_message(config, smallest, budget, usable_bytes, safety_margin, even=True),
            smallest.breakdown,
            smallest.total,
            budget,
        )
    micro, use_checkpointing, best_off = choice
    plan = Plan(
        micro_batch_size=micro,
        gradient_accumulation_steps=target // (micro * num_processes),
        gradient_checkpointing=use_checkpointing,
        effective_batch_size=target,
        num_processes=num_processes,
        usable_bytes=usable_bytes,
        safety_margin=safety_margin,
        estimate=search.lookup(micro, use_checkpointing),
        candidates=candidates,
        tried=list(search.consulted.values()),
        without_checkpointing=search.lookup(best_off, False) if use_checkpointing and best_off else None,
        ramp=ramp,
        data=data,
        capped_by_data=capped,
        fits_fn=fits,
    )
    plan.notes = _plan_notes(plan)
    return plan


def _budget_bytes(safety_margin: float, usable_bytes: int) -> int:
    if not 0 < safety_margin <= 1:
        raise ValueError(f"--safety-margin must be in (0, 1], got {safety_margin}")
    if usable_bytes <= 0:
        raise ValueError(f"usable memory must be positive, got {usable_bytes} bytes")
    return int(safety_margin * usable_bytes)


def _search_candidates(
    target: int, num_processes: int, ramp: RampTarget | None, data: DataCap | None
) -> tuple[list[int], list[int]]:
    """The micro-batches to search, and those left out because the largest bucket cannot fill them."""
    candidates = micro_batch_candidates(target, num_processes, ramp)
    if not candidates:
        assert ramp is not None  # without a ramp, micro-batch 1 always splits the target
        raise ValueError(
            f"no micro-batch splits both ends of the ramp ({ramp.initial} -> {ramp.target}) over {num_processes} "
            "process(es); make initial_effective_batch_size a multiple of the process count"
        )
    limit = None if data is None else data.micro_batch_limit(num_processes)
    if data is None or limit is None:
        return candidates, []
    capped = [m for m in candidates if m > limit]
    candidates = [m for m in candidates if m <= limit]
    if not candidates:
        raise DataTooSmall(
            f"no micro-batch fits the data: {data.describe()}, and train needs one bucket to hold micro-batch x "
            f"{num_processes} process(es) = at least {num_processes} samples; add images of that shape (or "
            "`repeats`), or train on fewer processes"
        )
    return candidates, capped


class _Search:
    """The binary searches of one plan: estimates come from the shared cache, and the ones this plan
    looked at are kept in order (:attr:`Plan.tried`)."""

    def __init__(self, estimates: EstimateCache, fits: Callable[[Estimate], bool]):
        self.estimates, self.fits = estimates, fits
        self.consulted: dict[tuple[int, bool], Estimate] = {}

    def lookup(self, micro_batch_size: int, checkpointing: bool) -> Estimate:
        estimate = self.estimates(micro_batch_size, checkpointing)
        self.consulted.setdefault((micro_batch_size, checkpointing), estimate)
        return estimate

    def largest(self, candidates: list[int], checkpointing: bool) -> int | None:
        """The largest of ``candidates`` that fits with ``checkpointing``; None when none does."""
        return largest_fitting(candidates, lambda m: self.fits(self.lookup(m, checkpointing)))

    def choose(self, candidates: list[int]) -> tuple[int, bool, int | None] | None:
        """``(micro-batch, checkpointing, largest micro-batch without checkpointing)``: the largest that fits,
        with checkpointing only when that one needs it; None when nothing fits."""
        best_off = self.largest(candidates, checkpointing=False)
        best_on = None
        if best_off != candidates[-1]:  # checkpointing can only help with what does not fit without it
            best_on = self.largest([m for m in candidates if best_off is None or m > best_off], checkpointing=True)
        if best_on is not None and (best_off is None or best_on > best_off):
            return best_on, True, best_off
        return None if best_off is None else (best_off, False, best_off)


def _plan_notes(plan: Plan) -> list[str]:
    notes = []
    if plan.gradient_checkpointing:
        alt = plan.without_checkpointing
        if alt is None:
            notes.append("gradient checkpointing: needed (no micro-batch fits without it)")
        else:
            notes.append(
                f"gradient checkpointing: needed for micro-batch {plan.micro_batch_size}; without it micro-batch "
                f"{alt.micro_batch_size} fits ({format_bytes(alt.total)}, accumulation "
                f"{plan.effective_batch_size // (alt.micro_batch_size * plan.num_processes)}), which skips the "
                "recomputation (about a third more compute per sample): compare samples/s of both"
            )
    else:
        notes.append("gradient checkpointing: not needed (off: no recomputation)")
    validation = plan.estimate.extras.get(VALIDATION_MODELS, 0)
    kept = (
        f"; validation_prompt is set, so they stay loaded for validation images ({format_bytes(validation)}, counted)"
        if validation
        else ""
    )
    notes.append(
        "cached embeddings: always on in this trainer: latents and text embeddings are encoded once before "
        f"training and the VAE and text encoder are released before the denoiser trains{kept}"
    )
    notes.append("weight offload (low_vram): not needed; this trainer has no offload mode")
    notes += _data_notes(plan)
    ramp = plan.ramp
    per_process = plan.effective_batch_size // plan.num_processes
    if ramp is not None and not plan.is_capped_by_data and plan.micro_batch_size == plan.candidates[-1] < per_process:
        notes.append(
            f"the ramp's start (initial_effective_batch_size {ramp.initial}) caps the micro-batch at "
            f"{plan.candidates[-1]}: a larger start allows larger micro-batches, if they fit"
        )
    if len(plan.candidates) <= 2 and plan.effective_batch_size > 2 and ramp is None and not plan.capped_by_data:
        notes.append(
            f"an effective batch of {plan.effective_batch_size} splits only as "
            f"{' or '.join(f'{m} x {plan.effective_batch_size // (m * plan.num_processes)}' for m in plan.candidates)} "
            "(micro-batch x accumulation): a target with more divisors (a power of two) gives the search more choices"
        )
    return notes


def _data_notes(plan: Plan) -> list[str]:
    data = plan.data
    if data is None:
        return []
    if data.largest is None:
        return [
            f"data cap: {data.describe()}: the micro-batch is not checked against the buckets; train needs one "
            f"aspect bucket to hold micro-batch x processes samples ({plan.micro_batch_size * plan.num_processes} "
            "here): run the estimate where the datasets are to check"
        ]
    limit = data.micro_batch_limit(plan.num_processes)
    if plan.is_capped_by_data:
        line = (
            f"data cap: limited the micro-batch to {plan.micro_batch_size}: {data.describe()}, and train needs one "
            f"bucket to fill micro-batch x {plan.num_processes} process(es); micro-batch "
            f"{', '.join(map(str, plan.capped_by_data))} left out (not estimated); more images per aspect "
            "ratio allow more"
        )
    else:
        line = f"data cap: {data.describe()}: micro-batches up to {limit} per process; not the limit here"
    need = plan.micro_batch_size * plan.num_processes
    never = sum(n for n in data.group_sizes if n < need)
    if never:
        line += (
            f"; at micro-batch {plan.micro_batch_size}, {never} sample(s) in buckets smaller than {need} are never "
            "trained on"
        )
    return [line]


__all__ = [
    "DDP_BUCKETS",
    "DEFAULT_SAFETY_MARGIN",
    "VALIDATION_MODELS",
    "DataCap",
    "DataTooSmall",
    "DoesNotFit",
    "Estimate",
    "EstimateCache",
    "Plan",
    "RampTarget",
    "current_effective_batch",
    "divisors",
    "extra_bytes",
    "largest_fitting",
    "micro_batch_candidates",
    "plan_batch",
    "scan_data_cap",
    "suggest_switches",
]
