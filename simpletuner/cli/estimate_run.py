"""What ``simpletuner estimate`` does once its options are parsed (:mod:`simpletuner.cli.estimate`
declares them and keeps ``estimate --help`` free of torch): presets, the estimate and auto-config
(computed, then rendered, by :mod:`simpletuner.memory.report`), and ``--profile`` (:mod:`simpletuner.cli.profile`).

Presets and a refused config need the configuration layer only: torch, the hardware probe and the model
libraries are imported in :func:`_estimate`, once the flags are checked and the config is read.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from simpletuner.configuration import ConfigError, load_config, validate_config
from simpletuner.configuration.alloc_conf import ALLOC_CONF_VAR, check_alloc_conf
from simpletuner.exit_codes import BAD_INPUT, DOES_NOT_FIT
from simpletuner.memory import presets as P
from simpletuner.memory.apply import ApplyError, apply_updates, check_writable, describe_changes
from simpletuner.memory.estimated_config import read_estimated_config


# --- presets ---------------------------------------------------------------------------------------
def _presets(args) -> int:
    """``--list-presets``, ``--preset NAME`` (explained), ``--preset NAME --config CFG`` (compared; ``--apply``)."""
    directory = args.presets_dir or P.PRESETS_DIR
    if args.list_presets:
        return _list_presets(args, directory)
    preset = P.load_preset(args.preset, directory)
    if not args.config:
        if args.apply:
            raise ValueError(f"--preset {preset.name} --apply writes the preset into a config: add --config CFG.json")
        return _explain_preset(args, preset)
    if args.apply:
        return _apply_preset(args, preset)
    return _compare_with_preset(args, preset)


def _preset_facts(preset) -> dict[str, Any]:
    """What ``--json`` says of a preset, listed or explained."""
    keys = ("name", "hardware", "model_family", "workload", "description", "gpu", "gpu_memory_gb")
    return {key: getattr(preset, key) for key in keys}


def _list_presets(args, directory) -> int:
    found = P.load_presets(directory)
    if args.json:
        _print_json([_preset_facts(p) for p in found])
        return 0
    width = max((len(p.name) for p in found), default=0) + 2
    for p in found:
        print(f"{p.name:<{width}}{p.hardware}")
        print(f"{'':<{width}}made for: {p.workload} (model_family {p.model_family})")
    print(f"\n`simpletuner estimate --preset NAME` explains one; presets live in {directory}")
    return 0


def _explain_preset(args, preset) -> int:
    if args.json:
        _print_json({**_preset_facts(preset), "settings": preset.settings, "why": preset.why})
    else:
        print("\n".join(P.explain_preset(preset)))
    return 0


def _compare_with_preset(args, preset) -> int:
    """How the config differs from the preset, and whether the preset is made for its model family."""
    loaded = load_config(args.config, args.overrides, check_files=False)
    differences = P.compare_with_preset(preset, loaded.config, loaded.raw)
    try:
        P.check_preset_fits(preset, loaded.raw)
        fit_note = None
    except ValueError as exc:
        fit_note = str(exc)
    if args.json:
        rows = [
            {
                "key": d.key,
                "config": d.config_value,
                "preset": d.preset_value,
                "config_is_default": d.is_default,
                "same": d.is_same,
                "why": preset.why[d.key],
            }
            for d in differences
        ]
        _print_json(
            {
                "preset": preset.name,
                "model_family": preset.model_family,
                "workload": preset.workload,
                "fits_model_family": fit_note is None,
                "differences": rows,
            }
        )
        return 0
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


def _check_options(args) -> float | None:
    """The option combinations ``estimate --config`` refuses (ValueError); the safety margin asked for (None:
    the default)."""
    if args.apply and args.overrides:
        raise ValueError(
            "--apply writes the plan into the config file, and --set changes would not be written: "
            "put them in the file first"
        )
    if args.profile and (args.target_effective_batch is not None or args.apply):
        raise ValueError(
            "--profile measures the config as it is; run auto-config (--target-effective-batch / --apply) separately"
        )
    if args.safety_margin is not None and not 0 < args.safety_margin <= 1:
        raise ValueError(f"--safety-margin must be in (0, 1], got {args.safety_margin:g}")
    if args.num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {args.num_processes}")
    if args.apply:
        check_writable(Path(args.config))  # before minutes of estimating, not after
    return args.safety_margin


def _estimate(args) -> int:
    """``estimate --config``: check the flags, read the config, compute the report, then print it as text or
    JSON. 1 when it does not fit (or ``--profile`` ran out of memory); 2 for ``--profile`` without a GPU."""
    margin = _check_options(args)
    estimated = read_estimated_config(args.config, args.overrides)
    # Imported once the config is known good: torch, the hardware probe, and (on a miss in the estimate
    # cache) the model libraries.
    import torch

    from simpletuner.cli.profile import NeedsGPU, ProfileOutOfMemory, profile_training
    from simpletuner.memory.autoconfig import DEFAULT_SAFETY_MARGIN, DoesNotFit
    from simpletuner.memory.report import compute_estimate

    try:
        if args.profile and not torch.cuda.is_available():
            raise NeedsGPU(
                "--profile runs real training steps and needs a CUDA GPU; there is none on this machine. "
                "The estimate alone works anywhere: drop --profile"
            )
        report = compute_estimate(args, DEFAULT_SAFETY_MARGIN if margin is None else margin, estimated)
        if args.profile:  # real training steps, measured against the estimate
            assert report.estimate is not None, "--profile refuses auto-config: the report holds the config's estimate"
            report.profile = profile_training(
                args.config, args.overrides, report.estimate.breakdown, args.profile_steps
            )
    except (DoesNotFit, ProfileOutOfMemory) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return DOES_NOT_FIT
    except NeedsGPU as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    if args.json:
        _print_json(report.as_dict())
    else:
        print("\n".join(report.lines()))
    return report.exit_code


class BadEnvironment(ValueError):
    """The environment would make training fail (one message per problem)."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


def check_environment() -> None:
    """``PYTORCH_CUDA_ALLOC_CONF``: keys stock PyTorch rejects raise :class:`BadEnvironment`; keys not
    known to be accepted are printed as warnings."""
    check = check_alloc_conf(os.environ.get(ALLOC_CONF_VAR))
    for line in check.warnings():
        print(f"warning: {line}", file=sys.stderr)
    if check.errors():
        raise BadEnvironment(check.errors())


def run_estimate(args) -> int:
    """The command's work; an expected failure prints one line and returns its exit code."""
    try:
        if args.auto and args.gpu != "auto":
            raise ValueError(f"--auto means --gpu auto: drop one of --auto and --gpu {args.gpu}")
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
    except BadEnvironment as exc:
        for line in exc.lines:
            print(f"error: {line}", file=sys.stderr)
        return BAD_INPUT
    except (ConfigError, ApplyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
