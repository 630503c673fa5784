"""``simpletuner estimate``: the memory table, auto-config (``--apply``), presets, ``--profile``.

:func:`add_arguments` declares the options (importing nothing heavy, so ``--help`` is quick) and
:func:`run` hands the work to :mod:`simpletuner.cli.estimate_run`; the estimate itself is
computed, then rendered, by :mod:`simpletuner.memory.report`. Exit codes
(:mod:`simpletuner.exit_codes`): 0 done; 1 the config does not fit the GPU (the message says what
dominates and what would help); 2 bad input (config, GPU name, flags, preset, ``--apply`` on a
read-only file, ``--profile`` without a GPU, ``PYTORCH_CUDA_ALLOC_CONF`` keys stock PyTorch
rejects); 70 internal error (a bug: the traceback and what to report are printed; never 1 or 2,
which would be read as a verdict on the input).
"""

from __future__ import annotations

import argparse

from simpletuner.cli.arguments import add_config_arguments
from simpletuner.exit_codes import report_internal_error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``simpletuner estimate``'s options."""
    parser.description = (
        "Estimate the GPU memory one training process needs (no GPU required), plan the largest micro-batch "
        "that fits (--target-effective-batch, --apply), explain presets (--preset, --list-presets), or measure "
        "real steps on a GPU (--profile). Exit codes: 0 done, 1 does not fit, 2 bad input (config, flags, preset, "
        "PYTORCH_CUDA_ALLOC_CONF keys stock PyTorch rejects), 70 internal error (a bug in simpletuner: the "
        "traceback and what to report are printed)."
    )
    add_config_arguments(
        parser,
        required=False,
        config_help="training JSON to estimate",
        set_help="override a config key for the estimate, as in `simpletuner train`",
    )
    parser.add_argument(
        "--gpu",
        default="auto",
        metavar="auto|NAME",
        help="auto (default): this machine's GPU; NAME: a card from the table "
        "(h100, a100-80gb, rtx4090, gb10, gh200, ...)",
    )
    parser.add_argument(
        "--auto",
        action="store_true",
        help="detect this machine's GPU: --gpu auto, the default (the flag of optimize_gpu_config.py, "
        "which the GPU-memory guides run as `optimize_gpu_config.py --auto`)",
    )
    parser.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GB",
        help="the card's memory in GiB: overrides NAME's, or alone means a generic card of that size",
    )
    parser.add_argument(
        "--num-processes",
        type=int,
        default=1,
        metavar="N",
        help="processes (GPUs) training together; splits the effective batch (default: 1)",
    )
    parser.add_argument(
        "--target-effective-batch",
        type=int,
        metavar="N",
        help="auto-config: the largest micro-batch that fits and the accumulation that gives N samples per step",
    )
    parser.add_argument(
        "--safety-margin",
        type=float,
        metavar="F",
        help="plan to use at most this share of usable memory (default: 0.85)",
    )
    parser.add_argument(
        "--apply",
        action="store_true",
        help="write the plan into --config (backup <file>.backup first; prints the diff); "
        "without --target-effective-batch the config's own effective batch is kept; on a GH200 / GB10 also "
        "gh200_optimizations.managed_memory, the cheapest mode that fits (its other keys are kept); with --preset, "
        "write the preset's values for the keys the config does not set",
    )
    parser.add_argument(
        "--profile", action="store_true", help="run real training steps on this GPU and compare with the estimate"
    )
    parser.add_argument(
        "--profile-steps", type=int, default=3, metavar="N", help="optimizer steps for --profile (default: 3)"
    )
    parser.add_argument(
        "--preset",
        metavar="NAME",
        help="explain a preset; with --config, show how the config differs from "
        "it; with --config and --apply, write it into the config (keys the config sets win)",
    )
    parser.add_argument(
        "--list-presets",
        action="store_true",
        help="list the presets (config/presets/, bundled in the package when installed) with the machine and "
        "workload each was made for",
    )
    parser.add_argument("--presets-dir", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    """Run ``simpletuner estimate`` from parsed arguments; returns the exit code.

    0 done, 1 does not fit, 2 bad input; anything unexpected is a bug in simpletuner and ends in
    :func:`simpletuner.exit_codes.report_internal_error` (exit 70, traceback and what to report),
    never in a code that reads as a verdict on the input.
    """
    try:
        # Imported here: `simpletuner estimate --help` declares the options above without torch.
        from simpletuner.cli.estimate_run import run_estimate

        return run_estimate(args)
    except Exception as exc:  # noqa: BLE001 - the last-resort handler: report, never mistake for a verdict
        return report_internal_error(exc, "estimate")
