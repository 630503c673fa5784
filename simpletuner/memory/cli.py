"""``simpletuner estimate``: the memory table, auto-config (``--apply``), presets, ``--profile``.

The arguments are declared in :mod:`simpletuner.cli` (so ``simpletuner --help`` does not import
torch); :func:`run` does the work. Exit codes (:mod:`simpletuner.exit_codes`): 0 done; 1 the config
does not fit the GPU (the message says what dominates and what would help); 2 bad input (config,
GPU name, flags, preset, ``--apply`` on a read-only file, ``--profile`` without a GPU,
``PYTORCH_CUDA_ALLOC_CONF`` keys stock PyTorch rejects); 70 internal error (a bug: the traceback
and what to report are printed; never 1 or 2, which would be read as a verdict on the input).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from simpletuner.memory.advice import format_bytes
from simpletuner.memory.estimator import GiB


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
    from simpletuner.memory.hardware import detect_hardware, hardware_for_gpu

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
                    f"GPU: hypothetical card with {gpu_memory_gb:g} GiB (--gpu-memory; not a table entry: no peak FLOPS)",
                ],
            )
        hw = (detect or detect_hardware)()
        if not hw.has_gpu:
            return Machine(
                hw,
                None,
                "none",
                hw.describe()
                + [
                    "no CUDA device here: the table is what one training process would need on a GPU, without headroom. "
                    "Pass --gpu NAME or --gpu-memory GB to judge it against a card.",
                ],
            )
        lines = hw.describe()
        if hw.gpu_free_bytes is not None and hw.usable_memory_bytes and hw.gpu_free_bytes < 0.9 * hw.gpu_memory_bytes:
            lines.append(
                f"note: {_gib(hw.gpu_free_bytes)} free now; something else holds GPU memory, and the estimate "
                "is judged against the whole"
            )
        return Machine(hw, hw.usable_memory_bytes, "detected", lines + _memory_notes(hw))
    hw = hardware_for_gpu(gpu, gpu_memory_gb)
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
            "usable is the GPU's own memory (HBM); managed memory can spill into the host's LPDDR5X, at the "
            "NVLink-C2C's speed, not the HBM's: plan for the HBM"
        ]
    return []


# --- presets ---------------------------------------------------------------------------------------
def _presets(args) -> int:
    from simpletuner.memory import presets as P

    directory = args.presets_dir or P.PRESETS_DIR
    if args.list_presets:
        found = P.load_presets(directory)
        if args.json:
            _print_json(
                [
                    {
                        "name": p.name,
                        "hardware": p.hardware,
                        "model_family": p.model_family,
                        "workload": p.workload,
                        "description": p.description,
                        "gpu": p.gpu,
                        "gpu_memory_gb": p.gpu_memory_gb,
                    }
                    for p in found
                ]
            )
            return 0
        width = max((len(p.name) for p in found), default=0) + 2
        for p in found:
            print(f"{p.name:<{width}}{p.hardware}")
            print(f"{'':<{width}}made for: {p.workload} (model_family {p.model_family})")
        print(f"\n`simpletuner estimate --preset NAME` explains one; presets live in {directory}")
        return 0
    preset = P.load_preset(args.preset, directory)
    if not args.config:
        if args.apply:
            raise ValueError(f"--preset {preset.name} --apply writes the preset into a config: add --config CFG.json")
        if args.json:
            _print_json(
                {
                    "name": preset.name,
                    "hardware": preset.hardware,
                    "model_family": preset.model_family,
                    "workload": preset.workload,
                    "description": preset.description,
                    "gpu": preset.gpu,
                    "gpu_memory_gb": preset.gpu_memory_gb,
                    "settings": preset.settings,
                    "why": preset.why,
                }
            )
        else:
            print("\n".join(P.explain_preset(preset)))
        return 0
    if args.apply:
        return _apply_preset(args, preset)
    from simpletuner.configuration import load_config

    loaded = load_config(args.config, args.overrides, check_files=False)
    differences = P.compare_with_preset(preset, loaded.config, loaded.raw)
    try:
        P.check_preset_fits(preset, loaded.raw)
        fit_note = None
    except ValueError as exc:
        fit_note = str(exc)
    if args.json:
        _print_json(
            {
                "preset": preset.name,
                "model_family": preset.model_family,
                "workload": preset.workload,
                "fits_model_family": fit_note is None,
                "differences": [
                    {
                        "key": d.key,
                        "config": d.config_value,
                        "preset": d.preset_value,
                        "config_is_default": d.is_default,
                        "same": d.is_same,
                        "why": preset.why[d.key],
                    }
                    for d in differences
                ],
            }
        )
    else:
        lines = P.describe_comparison(preset, differences, args.config)
        if fit_note:
            lines += ["", f"note: {fit_note}"]
        else:
            lines += [
                "",
                f"  write the preset's values for the keys the config does not set: simpletuner estimate "
                f"--preset {preset.name} --config {args.config} --apply",
            ]
        print("\n".join(lines))
    return 0


def _apply_preset(args, preset) -> int:
    """``--preset NAME --config cfg.json --apply``: write the preset's values for the keys the config
    does not set into the file (backup, minimal edit, diff: :mod:`simpletuner.memory.apply`)."""
    from pathlib import Path

    from simpletuner.configuration import load_config, validate_config
    from simpletuner.memory import presets as P
    from simpletuner.memory.apply import apply_updates, check_writable, describe_changes

    if args.overrides:
        raise ValueError(
            "--apply writes the preset into the config file, and --set changes would not be written: "
            "put them in the file first"
        )
    path = Path(args.config)
    check_writable(path)
    raw = load_config(path, check_files=False).raw  # the config's own problems first
    merged, lines = P.apply_preset(raw, preset)
    # The file as it will be must still be a valid config.
    validate_config(merged, base_dir=path.parent, source=f"{path} with preset {preset.name}", check_files=False)
    updates = {k: v for k, v in merged.items() if k not in raw or raw[k] != v}
    result = apply_updates(path, updates)
    if args.json:
        _print_json(
            {
                "preset": preset.name,
                "config": str(path),
                "effective": lines,
                "applied": {
                    "backup": str(result.backup) if result.backup else None,
                    "diff": result.diff,
                    "changed": {k: list(v) for k, v in result.changed.items()},
                },
            }
        )
        return 0
    text = list(lines)
    if not result.changed:
        text += [
            "",
            f"--apply: {path} already has every value of preset {preset.name} or sets its own; nothing written",
        ]
    else:
        text += [
            "",
            f"--apply: wrote {path} (original kept as {result.backup}):",
            *describe_changes(result.changed),
            "",
            result.diff.rstrip("\n"),
        ]
    text += [
        "",
        f"check that it fits: simpletuner estimate --config {path}"
        + (f" --gpu {preset.gpu}" if preset.gpu else "")
        + (f" --gpu-memory {preset.gpu_memory_gb:g}" if preset.gpu_memory_gb is not None else ""),
    ]
    print("\n".join(text))
    return 0


# --- estimate / auto-config ------------------------------------------------------------------------
def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


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


def _plan_lines(plan, config) -> list[str]:
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
    lines.append(f"  needs {_gib(plan.estimate.total)} of the {_gib(plan.budget_bytes)} budget")
    lines += [f"  {note}" for note in plan.notes]
    tried = ", ".join(
        f"{e.micro_batch_size}{'+ckpt' if e.gradient_checkpointing else ''} {e.total / GiB:.2f}"
        f"{'' if e.total <= plan.budget_bytes else ' (over)'}"
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


def _precision_in_force(config_path: str, overrides: list[str]) -> tuple[str, list[str]]:
    """The precision a training run of this config would use, as ``train`` decides it without a
    launcher (the config, else ACCELERATE_MIXED_PRECISION), a line saying so, and the ``--set``
    items that bring the environment's launcher settings in. A launch line is not known here, so
    a config that leaves the precision to it is estimated as fp32, and the line says how to ask."""
    import os

    from simpletuner.configuration.launcher import resolve_launcher_settings
    from simpletuner.configuration.loader import read_raw_config

    raw = read_raw_config(config_path, overrides)
    launch = resolve_launcher_settings(raw, os.environ, None, config_source=str(config_path))
    setting = launch.settings.get("mixed_precision")
    if setting is not None:
        return f"precision: {setting.value} ({setting.source})", launch.overrides
    return (
        "precision: no (fp32): the config leaves mixed_precision to the launch, and estimate cannot see a "
        "launch line; a launch asking for bf16 (`accelerate launch --mixed_precision bf16`, or the GH200 "
        "Accelerate config) trains in bf16: estimate that with --set mixed_precision=bf16"
    ), launch.overrides


def _estimate(args) -> int:
    from simpletuner.configuration import load_config
    from simpletuner.memory.advice import does_not_fit_advice
    from simpletuner.memory.apply import apply_updates, describe_changes
    from simpletuner.memory.autoconfig import DEFAULT_SAFETY_MARGIN, EstimateCache, plan_batch

    auto = args.target_effective_batch is not None or args.apply
    if args.apply and args.overrides:
        raise ValueError(
            "--apply writes the plan into the config file, and --set changes would not be written: "
            "put them in the file first"
        )
    if args.profile:
        import torch

        if not torch.cuda.is_available():
            from simpletuner.memory.profile import NeedsGPU

            raise NeedsGPU(
                "--profile runs real training steps and needs a CUDA GPU; there is none on this machine. "
                "The estimate alone works anywhere: drop --profile"
            )
        if auto:
            raise ValueError(
                "--profile measures the config as it is; run auto-config (--target-effective-batch / "
                "--apply) separately"
            )
    margin = DEFAULT_SAFETY_MARGIN if args.safety_margin is None else args.safety_margin
    if not 0 < margin <= 1:
        raise ValueError(f"--safety-margin must be in (0, 1], got {margin:g}")
    if args.num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {args.num_processes}")
    if args.apply:
        from pathlib import Path

        from simpletuner.memory.apply import check_writable

        check_writable(Path(args.config))  # before minutes of estimating, not after
    precision_line, launch_overrides = _precision_in_force(args.config, args.overrides)
    loaded = load_config(args.config, [*args.overrides, *launch_overrides], check_files=False)
    config = loaded.config
    machine = resolve_machine(args.gpu, args.gpu_memory)
    machine.lines.append(precision_line)
    if auto and machine.usable_bytes is None:
        raise ValueError(
            "auto-config needs a GPU's memory to plan for, and this machine has no CUDA device: "
            "pass --gpu NAME (e.g. --gpu h100, --gpu gb10) or --gpu-memory GB"
        )
    estimates = EstimateCache(config, args.num_processes)
    out: dict[str, Any] = {"config": str(args.config), "machine": machine.as_dict(), "safety_margin": margin}
    text: list[str] = [*machine.lines, ""]
    code = 0
    if not auto:
        start = time.perf_counter()
        estimate = estimates(config.train_batch_size, config.gradient_checkpointing)
        text += [estimate.breakdown.table(machine.usable_bytes), *_extras_lines(estimate, machine.usable_bytes)]
        out.update(estimate=estimate.breakdown.as_dict(), extras=estimate.extras, total_bytes=estimate.total)
        text.append(
            f"(estimated in {time.perf_counter() - start:.1f} s, without a GPU; see documentation/MEMORY.md "
            "for how far to trust it)"
        )
        if machine.usable_bytes is not None:
            fits, verdict = _verdict(estimate, machine.usable_bytes, margin)
            out.update(fits=fits, headroom_bytes=machine.usable_bytes - estimate.total)
            if fits:
                text += ["", verdict]
            else:
                advice = does_not_fit_advice(config, estimate, machine.usable_bytes)
                out["advice"] = advice
                text += ["", advice]
                code = 1
        if args.profile:
            from simpletuner.memory.profile import profile_training

            result = profile_training(args.config, args.overrides, estimate.breakdown, args.profile_steps)
            out["profile"] = result.as_dict()
            text += ["", result.table()]
    else:
        from simpletuner.memory.autoconfig import scan_data_cap

        plan = plan_batch(
            config,
            machine.usable_bytes,
            args.target_effective_batch,
            safety_margin=margin,
            num_processes=args.num_processes,
            estimates=estimates,
            data=scan_data_cap(config),
        )
        out["plan"] = plan.as_dict()
        text += _plan_lines(plan, config) + [
            "",
            plan.estimate.breakdown.table(machine.usable_bytes),
            *_extras_lines(plan.estimate, machine.usable_bytes),
        ]
        updates = {k: v for k, v in plan.config_updates().items() if getattr(config, k) != v}
        if args.apply:
            from pathlib import Path

            from simpletuner.configuration import validate_config

            # The file as it will be must still be a valid config (the candidates are chosen so it is).
            validate_config(
                {**loaded.raw, **updates}, base_dir=Path(args.config).parent, source=str(args.config), check_files=False
            )
            result = apply_updates(args.config, updates)
            out["applied"] = {
                "backup": str(result.backup) if result.backup else None,
                "diff": result.diff,
                "changed": {k: list(v) for k, v in result.changed.items()},
            }
            if not result.changed:
                text += ["", f"--apply: {args.config} already matches the plan; nothing written"]
            else:
                text += [
                    "",
                    f"--apply: wrote {args.config} (original kept as {result.backup}):",
                    *describe_changes(result.changed),
                    "",
                    result.diff.rstrip("\n"),
                ]
        elif updates:
            text += ["", "add --apply to write these values into the config (the original is kept as a .backup)"]
        else:
            text += ["", "the config already has these values"]
    if args.json:
        _print_json(out)
    else:
        print("\n".join(text))
    return code


class BadEnvironment(ValueError):
    """The environment would make training fail (one message per problem)."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def check_environment() -> None:
    """``PYTORCH_CUDA_ALLOC_CONF``: keys stock PyTorch rejects raise :class:`BadEnvironment`; keys not
    known to be accepted are printed as warnings."""
    from simpletuner.configuration.alloc_conf import ALLOC_CONF_VAR, check_alloc_conf

    check = check_alloc_conf(os.environ.get(ALLOC_CONF_VAR))
    for line in check.warnings():
        print(f"warning: {line}", file=sys.stderr)
    if check.errors():
        raise BadEnvironment(check.errors())


def _run(args) -> int:
    from simpletuner.configuration import ConfigError
    from simpletuner.exit_codes import BAD_INPUT, DOES_NOT_FIT
    from simpletuner.memory.apply import ApplyError
    from simpletuner.memory.autoconfig import DoesNotFit
    from simpletuner.memory.profile import NeedsGPU, ProfileOutOfMemory

    try:
        if args.list_presets and args.apply:
            raise ValueError(
                "--list-presets lists presets; --apply writes one: use --preset NAME --config CFG.json --apply"
            )
        if args.config:
            check_environment()  # before minutes of estimating, as the trainer checks it before loading anything
        if args.list_presets or args.preset:
            if args.target_effective_batch is not None or args.profile:
                raise ValueError(
                    "--preset / --list-presets show presets (and --apply writes one); plan or profile a "
                    "config in a separate run"
                )
            return _presets(args)
        if not args.config:
            raise ValueError("give --config CFG.json (or --preset NAME / --list-presets)")
        return _estimate(args)
    except (DoesNotFit, ProfileOutOfMemory) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return DOES_NOT_FIT
    except BadEnvironment as exc:
        for line in exc.lines:
            print(f"error: {line}", file=sys.stderr)
        return BAD_INPUT
    except (ConfigError, ApplyError, NeedsGPU, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT


def run(args) -> int:
    """Run ``simpletuner estimate`` from parsed arguments; returns the exit code.

    0 done, 1 does not fit, 2 bad input; anything unexpected is a bug in simpletuner and ends in
    :func:`simpletuner.exit_codes.report_internal_error` (exit 70, traceback and what to report),
    never in a code that reads as a verdict on the input.
    """
    try:
        return _run(args)
    except Exception as exc:  # noqa: BLE001 - the last-resort handler: report, never mistake for a verdict
        from simpletuner.exit_codes import report_internal_error

        return report_internal_error(exc, "estimate")
