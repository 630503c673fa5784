"""The estimator's two budgets: GPU memory (HBM) and CPU memory (Grace) per ``managed_memory`` mode.

For one :class:`~simpletuner.memory.autoconfig.Estimate`, :func:`mode_table` says what each mode of
``gh200_optimizations.managed_memory`` (:mod:`simpletuner.gh200.managed_memory`) keeps in HBM and in CPU
memory, whether it fits (``safety_margin x`` usable HBM, or the pool bound for ``all``; the CPU budget is
host RAM less :data:`~simpletuner.gh200.managed_memory.RESERVE_FRACTION`; on GB10 both share one budget)
and which is the cheapest that fits: caches, frozen_weights, all, in that order.
See documentation/MEMORY.md, "Managed-memory modes: two budgets, HBM and CPU memory".
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from simpletuner.gh200.managed_memory import MODES, RESERVE_FRACTION, backable_bytes, frozen_weight_problems
from simpletuner.memory.advice import VALIDATION_MODELS
from simpletuner.memory.estimator import GiB

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.memory.autoconfig import Estimate

FITS, TIGHT, NO = "fits", "tight", "no"


def _g(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"


@dataclass(frozen=True)
class Budgets:
    """What a machine offers the modes, in bytes.

    ``usable_bytes``: the GPU's usable memory (HBM on GH200; the one shared memory on GB10);
    ``hbm_budget``: ``safety_margin`` of it; ``cpu_budget``: host RAM (available when known, else
    its total) less the reserve, None when unknown; ``pool_bound``: what ``all`` may allocate,
    None when unknown; ``pool_problem``: why ``all`` is refused here (a ratio the machine cannot back).
    """

    usable_bytes: int
    safety_margin: float
    integrated: bool
    cpu_budget: int | None
    cpu_source: str
    pool_bound: int | None
    pool_source: str
    pool_problem: str | None = None

    @property
    def hbm_budget(self) -> int:
        return int(self.safety_margin * self.usable_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "usable_bytes": self.usable_bytes,
            "safety_margin": self.safety_margin,
            "hbm_budget_bytes": self.hbm_budget,
            "integrated": self.integrated,
            "cpu_budget_bytes": self.cpu_budget,
            "cpu_source": self.cpu_source,
            "pool_bound_bytes": self.pool_bound,
            "pool_source": self.pool_source,
            "pool_problem": self.pool_problem,
        }


def machine_budgets(hw, usable_bytes: int, safety_margin: float, ratio: float | None = None) -> Budgets:
    """The :class:`Budgets` of a unified machine ``hw`` (:class:`~simpletuner.hardware.machine.HardwareInfo`)
    for a config whose ``oversubscription_ratio`` is ``ratio``."""
    integrated = hw.memory_kind.startswith("integrated")
    if hw.host_ram_available_bytes is not None:
        host, source = hw.host_ram_available_bytes, "available host RAM (MemAvailable)"
    elif hw.host_ram_bytes is not None:
        where = "the GPU table's figure" if hw.hypothetical else "MemTotal; MemAvailable unreadable"
        host, source = hw.host_ram_bytes, f"host RAM ({where})"
    else:
        host, source = None, "host RAM unknown"
    keep = 1 - RESERVE_FRACTION
    cpu_budget = None if host is None else int(host * keep)
    cpu_source = f"{source} less a {RESERVE_FRACTION:.0%} reserve"
    hbm = hw.gpu_memory_bytes or usable_bytes
    free = hw.gpu_free_bytes if hw.gpu_free_bytes is not None else hbm
    backable = backable_bytes(types.SimpleNamespace(integrated=integrated), free, host, hw.hbm_in_host_memory)
    most = None if backable is None else int(backable * keep)
    side = "" if integrated else " (the GPU's NUMA node included)" if hw.hbm_in_host_memory else " + free HBM"
    problem = None
    bound: int | None
    if ratio is not None:
        bound, pool_source = int(ratio * hbm), f"oversubscription_ratio {ratio:g} x {_g(hbm)} of GPU memory"
        if most is not None and bound > most:
            problem = (
                f"oversubscription_ratio {ratio:g} bounds the pool at {_g(bound)}, beyond what the machine backs "
                f"({_g(most)}: {source}{side}, less the reserve); the run would refuse it"
            )
    else:
        bound, pool_source = most, f"what the machine backs: {source}{side}, less a {RESERVE_FRACTION:.0%} reserve"
    return Budgets(usable_bytes, safety_margin, integrated, cpu_budget, cpu_source, bound, pool_source, problem)


@dataclass(frozen=True)
class FrozenLayout:
    """The frozen blocks the ``frozen_weights`` prefetcher moves: how many and the largest one's bytes."""

    num_units: int
    largest_unit_bytes: int
    prefetch_blocks_ahead: int

    @property
    def window_bytes(self) -> int:
        """HBM the prefetch window holds: the running block and those prefetched ahead of it."""
        return (self.prefetch_blocks_ahead + 1) * self.largest_unit_bytes if self.num_units else 0


def frozen_layout(config: "TrainingConfig") -> FrozenLayout:
    """The blocks of ``config``'s denoiser as the trainer prepares it (built on ``meta``: no weights;
    :func:`simpletuner.gh200.managed_weights.weight_units`)."""
    from simpletuner.gh200.managed_weights import weight_units
    from simpletuner.memory.estimator import build_meta_denoiser

    units = weight_units(build_meta_denoiser(config))
    ahead = config.gh200_optimizations.prefetch_blocks_ahead
    return FrozenLayout(len(units), max((u.frozen_bytes for u in units), default=0), ahead)


@dataclass(frozen=True)
class ModeRow:
    """One mode's need: bytes in HBM and in CPU memory, and whether (and why not) it fits."""

    mode: str
    hbm_bytes: int
    grace_bytes: int
    status: str  # "fits" (within the margin), "tight" (within usable, over the margin), "no"
    why: str

    @property
    def fits(self) -> bool:
        return self.status == FITS

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "hbm_bytes": self.hbm_bytes,
            "grace_bytes": self.grace_bytes,
            "fits": self.fits,
            "status": self.status,
            "why": self.why,
        }


def _cpu_problem(hbm: int, grace: int, budgets: Budgets) -> str | None:
    if budgets.integrated:
        if budgets.cpu_budget is not None and hbm + grace > budgets.cpu_budget:
            return f"GPU + CPU side {_g(hbm + grace)} (one shared memory) over the {_g(budgets.cpu_budget)} budget"
        return None
    if not grace:
        return None
    if budgets.cpu_budget is None:
        return "CPU memory unknown: cannot check the Grace side"
    if grace > budgets.cpu_budget:
        return f"Grace {_g(grace)} over the {_g(budgets.cpu_budget)} CPU memory budget"
    return None


def _hbm_row(mode: str, hbm: int, grace: int, budgets: Budgets, refused: str | None) -> ModeRow:
    if refused:
        return ModeRow(mode, hbm, grace, NO, f"refused: {refused}")
    problem = _cpu_problem(hbm, grace, budgets)
    if problem:
        return ModeRow(mode, hbm, grace, NO, problem)
    share = f"{100 * hbm / budgets.usable_bytes:.0f}% of usable"
    if hbm > budgets.usable_bytes:
        return ModeRow(mode, hbm, grace, NO, f"HBM over usable ({share})")
    if hbm > budgets.hbm_budget:
        return ModeRow(mode, hbm, grace, TIGHT, f"tight: HBM {share}, over the {budgets.safety_margin:.0%} margin")
    return ModeRow(mode, hbm, grace, FITS, f"fits ({share})")


def mode_rows(
    estimate: "Estimate", layout: FrozenLayout, budgets: Budgets, refused: dict[str, str] | None = None
) -> list[ModeRow]:
    """Each mode's HBM and CPU bytes for ``estimate`` and whether it fits (``refused``: mode -> why
    the run would refuse it with this config), in the order caches, frozen_weights, all."""
    refused = refused or {}
    total, breakdown = estimate.total, estimate.breakdown
    rows = [_hbm_row("caches", total, 0, budgets, refused.get("caches"))]

    frozen = breakdown.weights - breakdown.trainable_weights
    grace = frozen + estimate.extras.get(VALIDATION_MODELS, 0)
    window = min(layout.window_bytes, frozen)
    rows.append(_hbm_row("frozen_weights", total - grace + window, grace, budgets, refused.get("frozen_weights")))

    hbm = min(total, budgets.usable_bytes)
    grace = total - hbm
    why = refused.get("all") or budgets.pool_problem
    if why:
        rows.append(ModeRow("all", hbm, grace, NO, f"refused: {why}"))
    elif budgets.pool_bound is None:
        rows.append(ModeRow("all", hbm, grace, NO, "the pool cannot be bounded: CPU memory unknown"))
    elif total > budgets.pool_bound:
        rows.append(ModeRow("all", hbm, grace, NO, f"pool {_g(total)} over its {_g(budgets.pool_bound)} bound"))
    else:
        problem = _cpu_problem(hbm, grace, budgets)
        status, text = (NO, problem) if problem else (FITS, f"fits (pool {_g(total)} of {_g(budgets.pool_bound)})")
        rows.append(ModeRow("all", hbm, grace, status, text))
    return rows


def cheapest(rows: list[ModeRow]) -> str | None:
    """The first mode that fits, in the order of their speed cost; None when none does."""
    return next((row.mode for row in rows if row.fits), None)


def refusals(config: "TrainingConfig") -> dict[str, str]:
    """Modes the run would refuse for reasons of the config itself (a quantised base, ``low_vram``,
    ``enable_compile`` with prefetching: see :mod:`simpletuner.gh200.managed_memory`)."""
    problems = frozen_weight_problems(config, "frozen_weights")
    return {"frozen_weights": "; ".join(problems)} if problems else {}


@dataclass
class ModeTable:
    """The per-mode table of one estimate on one machine, the config's mode and the cheapest that fits."""

    rows: list[ModeRow]
    config_mode: str
    budgets: Budgets
    layout: FrozenLayout
    machine_name: str
    notes: list[str] = field(default_factory=list)

    @property
    def cheapest(self) -> str | None:
        return cheapest(self.rows)

    def row(self, mode: str) -> ModeRow:
        return next(r for r in self.rows if r.mode == mode)

    @property
    def needs_other_mode(self) -> bool:
        """The config's own mode does not fit, and another does."""
        return self.row(self.config_mode).status == NO and self.cheapest is not None

    def as_dict(self) -> dict[str, Any]:
        return {
            "config_mode": self.config_mode,
            "cheapest": self.cheapest,
            "rows": [r.as_dict() for r in self.rows],
            "budgets": self.budgets.as_dict(),
            "prefetch_window_bytes": self.layout.window_bytes,
            "largest_block_bytes": self.layout.largest_unit_bytes,
            "num_blocks": self.layout.num_units,
            "notes": list(self.notes),
        }

    def lines(self) -> list[str]:
        b = self.budgets
        cpu = "unknown" if b.cpu_budget is None else _g(b.cpu_budget)
        lines = [
            f"managed_memory modes on {self.machine_name}: HBM budget {_g(b.hbm_budget)} ({b.safety_margin:.0%} of "
            f"{_g(b.usable_bytes)} usable); CPU memory budget {cpu} ({b.cpu_source})"
            + (
                "; GB10-style integrated memory: HBM and Grace are one memory, their sum must fit"
                if b.integrated
                else ""
            ),
            f"  {'mode':<16}{'HBM GiB':>9}{'Grace GiB':>11}  fits / why",
        ]
        for row in self.rows:
            marks = ("  <- the config's mode" if row.mode == self.config_mode else "") + (
                "  <- cheapest that fits" if row.mode == self.cheapest else ""
            )
            lines.append(f"  {row.mode:<16}{row.hbm_bytes / GiB:>9.2f}{row.grace_bytes / GiB:>11.2f}  {row.why}{marks}")
        window = self.layout
        lines.append(
            f"  frozen_weights' prefetch window: {window.prefetch_blocks_ahead + 1} x {_g(window.largest_unit_bytes)} "
            f"(prefetch_blocks_ahead {window.prefetch_blocks_ahead} + the running block; largest of "
            f"{window.num_units} blocks); all's pool bound: {'unknown' if b.pool_bound is None else _g(b.pool_bound)} "
            f"({b.pool_source})"
        )
        lines += [f"  {note}" for note in self.notes]
        if self.cheapest is None:
            lines.append("  no mode fits this machine")
        return lines


def mode_fits(mode: str, layout: FrozenLayout, budgets: Budgets, refused: dict[str, str]) -> Callable[..., bool]:
    """``Estimate -> bool``: whether ``mode`` fits that estimate within the margin (for the batch search)."""
    index = MODES.index(mode)
    return lambda estimate: mode_rows(estimate, layout, budgets, refused)[index].fits


@dataclass(frozen=True)
class ModePlanner:
    """Everything the per-mode tables of one config on one unified machine share: computed once
    (the frozen layout builds the denoiser on ``meta``), then applied to each estimate."""

    config: "TrainingConfig"
    machine_name: str
    budgets: Budgets
    layout: FrozenLayout
    refused: dict[str, str]

    @classmethod
    def for_machine(cls, config: "TrainingConfig", hw, usable_bytes: int | None, safety_margin: float):
        """The planner for ``hw`` (a HardwareInfo); None unless it is a unified-memory GPU."""
        if hw is None or usable_bytes is None or not hw.has_gpu or not hw.unified_memory:
            return None
        ratio = config.gh200_optimizations.oversubscription_ratio
        budgets = machine_budgets(hw, usable_bytes, safety_margin, ratio)
        return cls(config, hw.device_name, budgets, frozen_layout(config), refusals(config))

    def table(self, estimate: "Estimate") -> ModeTable:
        rows = mode_rows(estimate, self.layout, self.budgets, self.refused)
        mode = self.config.gh200_optimizations.managed_memory
        return ModeTable(rows, mode, self.budgets, self.layout, self.machine_name)

    def fits(self, mode: str) -> Callable[..., bool] | None:
        """The batch search's rule for ``mode``; None for caches (the search's own: total within the budget)."""
        return None if mode == "caches" else mode_fits(mode, self.layout, self.budgets, self.refused)

    def plan(self, config_estimate: "Estimate", plan_for: Callable[..., Any]) -> tuple[Any, str]:
        """``(plan, mode)``: the batch plan (``plan_for(fits)``, e.g. ``plan_batch`` with the rest of its
        arguments bound) for the cheapest mode that fits the config as it is; when none does, the
        first mode, in order, for which some plan fits. Raises the caches search's
        :class:`~simpletuner.memory.autoconfig.DoesNotFit` (with a note) when none has one."""
        from simpletuner.memory.autoconfig import DoesNotFit

        first = self.table(config_estimate).cheapest
        order = [first, *(m for m in MODES if m != first)] if first else list(MODES)
        failures: dict[str, DoesNotFit] = {}
        for mode in order:
            try:
                return plan_for(self.fits(mode)), mode
            except DoesNotFit as exc:
                failures[mode] = exc
        caches = failures["caches"]
        note = (
            "\nno managed_memory mode fits either (frozen_weights: frozen weights in CPU memory; all: everything in "
            "the managed pool): run the estimate without --apply / --target-effective-batch for the per-mode table"
        )
        raise DoesNotFit(str(caches) + note, caches.breakdown, caches.total, caches.budget) from None


def discrete_note(hw) -> str:
    """The one line a non-unified machine gets instead of the table."""
    kind = "a generic card" if hw is None else f"{hw.device_name} ({hw.memory_kind})"
    return (
        "managed_memory frozen_weights / all: need unified memory (GH200, GB10); this is "
        f"{kind}, so only caches is planned (force_managed_memory runs the others anyway, over PCIe)"
    )


__all__ = [
    "Budgets",
    "FrozenLayout",
    "ModeRow",
    "ModePlanner",
    "ModeTable",
    "cheapest",
    "discrete_note",
    "frozen_layout",
    "machine_budgets",
    "mode_fits",
    "mode_rows",
    "refusals",
]
