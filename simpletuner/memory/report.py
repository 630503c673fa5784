"""One ``simpletuner estimate`` answer, computed once and then rendered as text or as JSON.

:func:`compute_estimate` does the work (resolves the machine, estimates the config or plans its
batch split, writes the plan with ``--apply``) into an :class:`EstimateReport` (``--profile``'s
:class:`ProfileResult` is added by the command, which runs the trainer: :mod:`simpletuner.cli.profile`);
:meth:`EstimateReport.lines` and :meth:`EstimateReport.as_dict` render it. :func:`resolve_machine`
says which machine an estimate is judged against.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from simpletuner.configuration import validate_config
from simpletuner.hardware import machine as hardware
from simpletuner.memory import managed_plan
from simpletuner.memory.advice import does_not_fit_advice, format_bytes
from simpletuner.memory.apply import ApplyResult, apply_updates, describe_changes
from simpletuner.memory.autoconfig import (
    Estimate,
    EstimateCache,
    Plan,
    plan_batch,
    scan_data_cap,
)
from simpletuner.memory.estimator import GiB

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig
    from simpletuner.memory.estimated_config import EstimatedConfig


def _gib(nbytes: int | None) -> str:
    return "unknown" if nbytes is None else format_bytes(nbytes)


@dataclass
class Machine:
    """The machine an estimate is judged against: detected, from the GPU table, generic, or none."""

    hardware: Any | None  # HardwareInfo, None for a generic --gpu-memory card or no GPU
    usable_bytes: int | None
    kind: str  # "detected", "table", "generic" or "none"
    lines: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "usable_bytes": self.usable_bytes,
            "hardware": None if self.hardware is None else self.hardware.as_dict(),
        }


def resolve_machine(gpu: str | None, gpu_memory_gb: float | None, detect=None) -> Machine:
    """``--gpu auto`` (default): this machine, or a generic card when ``--gpu-memory`` is given;
    ``--gpu NAME``: that card from the table, ``--gpu-memory`` overriding its memory.
    ValueError (listing the known GPUs) for an unknown name."""
    if gpu_memory_gb is not None and gpu_memory_gb <= 0:
        raise ValueError(f"--gpu-memory must be a positive number of GB, got {gpu_memory_gb:g}")
    if gpu in (None, "auto"):
        if gpu_memory_gb is not None:
            usable = int(gpu_memory_gb * GiB)
            return Machine(
                None,
                usable,
                "generic",
                [
                    f"GPU: hypothetical card with {gpu_memory_gb:g} GiB (--gpu-memory; not a table entry: "
                    "no peak FLOPS)",
                ],
            )
        hw = (detect or hardware.detect_hardware)()
        if not hw.has_gpu:
            return Machine(
                hw,
                None,
                "none",
                hw.describe()
                + [
                    "no CUDA device here: the table is what one training process would need on a GPU, without "
                    "headroom. Pass --gpu NAME or --gpu-memory GB to judge it against a card.",
                ],
            )
        lines = hw.describe()
        free, total = hw.gpu_free_bytes, hw.gpu_memory_bytes
        if free is not None and total and hw.usable_memory_bytes and free < 0.9 * total:
            lines.append(
                f"note: {_gib(hw.gpu_free_bytes)} free now; something else holds GPU memory, and the estimate "
                "is judged against the whole"
            )
        return Machine(hw, hw.usable_memory_bytes, "detected", lines + _memory_notes(hw))
    hw = hardware.hardware_for_gpu(gpu, gpu_memory_gb)
    lines = [line for line in hw.describe() if not (line.startswith("host:") and hw.host_ram_bytes is None)]
    return Machine(hw, hw.usable_memory_bytes, "table", lines + _memory_notes(hw))


def _memory_notes(hw) -> list[str]:
    if hw.memory_kind.startswith("integrated"):
        return [
            "shared memory: the OS, datasets staged in RAM (in_memory) and `memory` / `unified_memory` caches use "
            "the same memory as training; the safety margin has to cover them"
        ]
    if hw.unified_memory:
        return [
            "usable is the GPU's own memory (HBM): plan for the HBM; gh200_optimizations.managed_memory can move "
            "frozen weights (frozen_weights) or anything (all) into the host's LPDDR5X, read at the NVLink-C2C's "
            "speed, not the HBM's (the mode table below shows each mode's HBM and Grace use)"
        ]
    return []


def _extras_lines(estimate, usable: int | None) -> list[str]:
    if not estimate.extras:
        return []
    lines = ["beside the denoiser, on the same GPU:"]
    for name, nbytes in estimate.extras.items():
        lines.append(f"  {name:<40}{nbytes / GiB:>8.2f} GiB")
    lines.append(
        f"  {'total with these':<40}{estimate.total / GiB:>8.2f} GiB"
        + (f", headroom {_gib(usable - estimate.total)}" if usable else "")
    )
    return lines


def _verdict(estimate, usable: int, margin: float) -> tuple[bool, str]:
    total = estimate.total
    share = f"{_gib(total)} of {_gib(usable)} usable ({100 * total / usable:.0f}%)"
    if total > usable:
        return False, f"does not fit: {share}"
    if total > margin * usable:
        return True, f"fits, tightly: {share}, above the {margin:.0%} safety margin (allocator spikes may not fit)"
    return True, f"fits: {share}, within the {margin:.0%} safety margin"


def _plan_lines(plan, config, mode: str | None = None) -> list[str]:
    per = f"{plan.micro_batch_size} x {plan.gradient_accumulation_steps} x {plan.num_processes} process" + (
        "es" if plan.num_processes > 1 else ""
    )
    lines = [
        f"auto-config: effective batch {plan.effective_batch_size}, budget {_gib(plan.budget_bytes)} "
        f"({plan.safety_margin:.0%} of {_gib(plan.usable_bytes)} usable)",
        f"  train_batch_size              {plan.micro_batch_size:<6}(was {config.train_batch_size})",
    ]
    if plan.ramp is None:
        lines.append(
            f"  gradient_accumulation_steps   {plan.gradient_accumulation_steps:<6}"
            f"(was {config.gradient_accumulation_steps}; {per} = {plan.effective_batch_size})"
        )
    else:
        start, end = plan.ramp_windows
        lines.append(
            f"  accumulation                  {start} -> {end} (the ramp, "
            f"{plan.ramp.initial} -> {plan.ramp.target} samples per step; gradient_accumulation_steps is ignored)"
        )
    lines.append(
        f"  gradient_checkpointing        {str(plan.gradient_checkpointing).lower():<6}"
        f"(was {str(config.gradient_checkpointing).lower()})"
    )
    if mode in (None, "caches"):
        lines.append(f"  needs {_gib(plan.estimate.total)} of the {_gib(plan.budget_bytes)} budget")
    else:  # the HBM budget is not what the total is held against: the mode table splits it
        lines.append(f"  needs {_gib(plan.estimate.total)} in all, split by managed_memory {mode} (table below)")
    lines += [f"  {note}" for note in plan.notes]
    tried = ", ".join(
        f"{e.micro_batch_size}{'+ckpt' if e.gradient_checkpointing else ''} {e.total / GiB:.2f}"
        f"{'' if plan.fits(e) else ' (over)'}"
        for e in plan.tried
    )
    made = sum(e.seconds for e in plan.tried)
    split = (
        f"both ends of the ramp, {plan.ramp.initial} and {plan.ramp.target},"
        if plan.ramp
        else f"{plan.effective_batch_size}"
    )
    filled = "" if not plan.capped_by_data else " and the largest bucket fills"
    lines.append(
        f"  searched micro-batches {', '.join(map(str, plan.candidates))} (those that split {split} exactly"
        f"{filled}); estimated GiB: {tried} ({made:.1f} s)"
    )
    return lines


@dataclass(frozen=True)
class ProfileResult:
    """Measured peaks of the training steps (bytes) beside the estimate's matching figures."""

    steps: int
    measured_allocated: int  # torch.cuda.max_memory_allocated over the steps
    measured_reserved: int  # torch.cuda.max_memory_reserved over the steps
    measured_outside_allocator: int | None  # device used minus reserved after the steps: context, libraries
    estimated_allocated: int  # total - CUDA context - fragmentation
    estimated_reserved: int  # total - CUDA context
    estimated_outside_allocator: int  # the CUDA context constant
    estimated_total: int
    device_name: str

    @property
    def measured_total(self) -> int | None:
        if self.measured_outside_allocator is None:
            return None
        return self.measured_reserved + self.measured_outside_allocator

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "measured_total": self.measured_total}

    def table(self) -> str:
        rows = [
            ("allocated peak (tensors, workspaces)", self.estimated_allocated, self.measured_allocated),
            ("reserved peak (+ fragmentation)", self.estimated_reserved, self.measured_reserved),
            ("outside the allocator (CUDA context)", self.estimated_outside_allocator, self.measured_outside_allocator),
            ("process total", self.estimated_total, self.measured_total),
        ]
        lines = [
            f"profile: {self.steps} real training steps on {self.device_name}",
            f"{'':<40}{'estimate':>10}{'measured':>10}{'error':>10}",
        ]
        for name, est, meas in rows:
            if meas is None:
                lines.append(f"{name:<40}{est / GiB:>10.2f}{'n/a':>10}")
                continue
            error = f"{100 * (est - meas) / meas:+.1f}%" if meas else "n/a"
            lines.append(f"{name:<40}{est / GiB:>10.2f}{meas / GiB:>10.2f}{error:>10}")
        lines.append("(GiB; error = (estimate - measured) / measured: positive means the estimate is on the safe side)")
        return "\n".join(lines)


@dataclass
class EstimateReport:
    """What ``simpletuner estimate --config`` found: the config's estimate and verdict, or (auto-config)
    the plan and what ``--apply`` wrote."""

    config_path: str
    config: "TrainingConfig"
    machine: Machine
    safety_margin: float
    #: The config as it is (no auto-config): its estimate and how long it took.
    estimate: Estimate | None = None
    seconds: float = 0.0
    #: Against a GPU's memory: whether it fits, the line that says how well, what would help if not.
    fits: bool | None = None
    verdict: str = ""
    advice: str = ""
    profile: ProfileResult | None = None  # --profile: filled in by the command (it runs the trainer)
    #: Auto-config: the plan, the config keys it changes, and what ``--apply`` wrote.
    plan: Plan | None = None
    updates: dict[str, Any] = field(default_factory=dict)
    applied: ApplyResult | None = None
    #: Unified machines: HBM and CPU memory per managed_memory mode (of the estimate, or the plan's);
    #: other GPUs: the line saying the modes need unified memory.
    managed: "managed_plan.ModeTable | None" = None
    managed_note: str | None = None
    picked_mode: str | None = None  # auto-config: the mode the plan was made for

    @property
    def exit_code(self) -> int:
        """1 when the config as it is does not fit the GPU, else 0."""
        return 1 if self.fits is False else 0

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` answer."""
        out: dict[str, Any] = {
            "config": self.config_path,
            "machine": self.machine.as_dict(),
            "safety_margin": self.safety_margin,
        }
        if self.managed is not None:
            out["managed_memory"] = {**self.managed.as_dict(), "picked": self.picked_mode}
        elif self.managed_note is not None:
            out["managed_memory"] = {"unified": False, "note": self.managed_note}
        if self.plan is not None:
            out["plan"] = self.plan.as_dict()
            if self.applied is not None:
                out["applied"] = {
                    "backup": str(self.applied.backup) if self.applied.backup else None,
                    "diff": self.applied.diff,
                    "changed": {k: list(v) for k, v in self.applied.changed.items()},
                }
            return out
        estimate = self.estimate
        assert estimate is not None, "a report holds a plan or an estimate"
        out.update(estimate=estimate.breakdown.as_dict(), extras=estimate.extras, total_bytes=estimate.total)
        out["from_estimate_cache"] = estimate.cached
        usable = self.machine.usable_bytes
        if self.fits is not None and usable is not None:  # fits is judged only against a known memory size
            out.update(fits=self.fits, headroom_bytes=usable - estimate.total)
            if not self.fits:
                out["advice"] = self.advice
        if self.profile is not None:
            out["profile"] = self.profile.as_dict()
        return out

    def lines(self) -> list[str]:
        """The text answer, one line per item."""
        usable = self.machine.usable_bytes
        text = [*self.machine.lines, ""]
        if self.plan is not None:
            return text + self._plan_text(self.plan, usable)
        estimate = self.estimate
        assert estimate is not None, "a report holds a plan or an estimate"
        text += [estimate.breakdown.table(usable), *_extras_lines(estimate, usable)]
        made = (
            "read from the estimate cache: an earlier run estimated the same model folder, config and code "
            "(SIMPLETUNER_ESTIMATE_CACHE=off estimates again); made"
            if estimate.cached
            else f"estimated in {self.seconds:.1f} s,"
        )
        text.append(f"({made} without a GPU; see documentation/MEMORY.md for how far to trust it)")
        text += self._managed_text()
        if self.fits is not None:
            text += ["", self.verdict if self.fits else self.advice]
        if self.profile is not None:
            text += ["", self.profile.table()]
        return text

    def _managed_text(self) -> list[str]:
        if self.managed is None:
            return [] if self.managed_note is None else ["", self.managed_note]
        lines = ["", *self.managed.lines()]
        if self.picked_mode is not None:
            was = self.config.gh200_optimizations.managed_memory
            lines.append(
                f"auto-config planned the batch for managed_memory {self.picked_mode} (was {was})"
                + ("" if self.picked_mode == "caches" else f": each candidate judged by its {self.picked_mode} row")
            )
        return lines

    def _plan_text(self, plan: Plan, usable: int | None) -> list[str]:
        text = _plan_lines(plan, self.config, self.picked_mode if self.managed is not None else None) + [
            "",
            plan.estimate.breakdown.table(usable),
            *_extras_lines(plan.estimate, usable),
            *self._managed_text(),
        ]
        if self.applied is not None:
            if not self.applied.changed:
                return text + ["", f"--apply: {self.config_path} already matches the plan; nothing written"]
            return text + [
                "",
                f"--apply: wrote {self.config_path} (original kept as {self.applied.backup}):",
                *describe_changes(self.applied.changed),
                "",
                self.applied.diff.rstrip("\n"),
            ]
        if self.updates:
            return text + ["", "add --apply to write these values into the config (the original is kept as a .backup)"]
        return text + ["", "the config already has these values"]


def _judge_modes(report: EstimateReport, table) -> None:
    """On a unified machine: the per-mode table, and the verdict for the config's own mode."""
    report.managed = table
    mode, own = table.config_mode, table.row(table.config_mode)
    if table.needs_other_mode:
        report.fits = False
        report.advice = "\n".join(
            filter(None, [report.advice if report.advice else report.verdict, _other_mode_line(report, table)])
        )
        return
    if mode != "caches":
        report.fits = own.status != managed_plan.NO
        report.verdict = f"managed_memory {mode}: {own.why}"
        if not report.fits:
            report.advice = f"does not fit: managed_memory {mode}: {own.why}; no mode fits this machine"
    if own.status == managed_plan.TIGHT and table.cheapest is not None:
        report.verdict += "\n" + _other_mode_line(report, table).replace("does not fit", "fits only tightly", 1)


def _other_mode_line(report: EstimateReport, table) -> str:
    own = table.row(table.config_mode)
    return (
        f"managed_memory {table.config_mode} does not fit ({own.why}), managed_memory {table.cheapest} does: "
        f"`simpletuner estimate --config {report.config_path} --apply` (with the same --gpu / --gpu-memory) writes "
        f'gh200_optimizations.managed_memory "{table.cheapest}" into the config, with the batch plan'
    )


def compute_estimate(args, margin: float, estimated: EstimatedConfig) -> EstimateReport:
    """``simpletuner estimate --config`` (parsed ``args``, checked; ``estimated``: the config read by
    :func:`~simpletuner.memory.estimated_config.read_estimated_config`): estimate the config as it is, or
    with ``--target-effective-batch`` / ``--apply`` plan the largest micro-batch that fits under
    ``margin`` of the GPU's usable memory (and write it)."""
    auto = args.target_effective_batch is not None or args.apply
    loaded = estimated.loaded
    config = loaded.config
    machine = resolve_machine(args.gpu, args.gpu_memory)
    machine.lines.append(estimated.precision_line)
    usable = machine.usable_bytes
    report = EstimateReport(str(args.config), config, machine, margin)
    estimates = EstimateCache(config, args.num_processes)
    modes = managed_plan.ModePlanner.for_machine(config, machine.hardware, usable, margin)
    if modes is None and usable is not None:
        report.managed_note = managed_plan.discrete_note(machine.hardware)
    if not auto:
        start = time.perf_counter()
        report.estimate = estimates(config.train_batch_size, config.gradient_checkpointing)
        report.seconds = time.perf_counter() - start
        if usable is not None:
            report.fits, report.verdict = _verdict(report.estimate, usable, margin)
            if not report.fits:
                report.advice = does_not_fit_advice(config, report.estimate, usable)
            if modes is not None:
                _judge_modes(report, modes.table(report.estimate))
        return report
    if usable is None:
        raise ValueError(
            "auto-config needs a GPU's memory to plan for, and this machine has no CUDA device: "
            "pass --gpu NAME (e.g. --gpu h100, --gpu gb10) or --gpu-memory GB"
        )

    def plan_for(fits=None) -> Plan:
        return plan_batch(
            config,
            usable,
            args.target_effective_batch,
            safety_margin=margin,
            num_processes=args.num_processes,
            estimates=estimates,
            data=data,
            fits=fits,
        )

    data = scan_data_cap(config)
    if modes is None:
        report.plan = plan_for()
    else:
        own = estimates(config.train_batch_size, config.gradient_checkpointing)
        report.plan, report.picked_mode = modes.plan(own, plan_for)
        report.managed = modes.table(report.plan.estimate)
    report.updates = {k: v for k, v in report.plan.config_updates().items() if getattr(config, k) != v}
    if report.picked_mode not in (None, config.gh200_optimizations.managed_memory):
        # Merged into the file's own section: its other keys stay.
        section = loaded.raw.get("gh200_optimizations") or {}
        report.updates["gh200_optimizations"] = {**section, "managed_memory": report.picked_mode}
    if args.apply:
        # The file as it will be must still be a valid config (the candidates are chosen so it is).
        validate_config(
            {**loaded.raw, **report.updates},
            base_dir=Path(args.config).parent,
            source=str(args.config),
            check_files=False,
        )
        report.applied = apply_updates(args.config, report.updates)
    return report
