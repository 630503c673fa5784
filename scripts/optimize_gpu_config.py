#!/usr/bin/env python
"""``optimize_gpu_config.py``: the GPU-memory optimizer's flags, run by ``simpletuner estimate``.

A thin wrapper for users who know this script's flags: it translates them and calls the same
code as ``simpletuner estimate`` (:func:`simpletuner.cli.main`); there is no second estimator.

==============================  =====================================================
this script                     ``simpletuner estimate``
==============================  =====================================================
``--auto``                      ``--gpu auto`` (detect this machine's GPU)
``--gpu-memory GB``             ``--gpu-memory GB`` (alone: a generic card of GB GiB)
``--config-path PATH``          ``--config PATH`` (default: ``config/config.json``)
``--target-effective-batch N``  ``--target-effective-batch N`` (the auto-config)
``--apply``                     ``--apply`` (backup ``<file>.backup``, diff)
``--profile``                   ``--profile`` (real steps on this GPU)
anything else                   passed on unchanged (``--safety-margin 0.75``, ``--json``, ...)
==============================  =====================================================

It prints the ``simpletuner estimate`` command it runs, and exits with its code (0 done, 1 does
not fit, 2 bad input, 70 internal error).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

DEFAULT_CONFIG = "config/config.json"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="optimize_gpu_config.py",
        allow_abbrev=False,  # `--gpu h100` is passed on, not read as an abbreviation of --gpu-memory
        description="Find the micro-batch and accumulation that fit a GPU and write them into a config: runs "
        "`simpletuner estimate` with these flags translated. Other `simpletuner estimate` flags "
        "(--safety-margin, --num-processes, --json, --gpu NAME, ...) are passed on unchanged.",
    )
    parser.add_argument(
        "--auto", action="store_true", help="detect this machine's GPU (simpletuner estimate --gpu auto)"
    )
    parser.add_argument(
        "--gpu-memory", metavar="GB", help="the GPU's memory in GiB (alone: a generic card of that size)"
    )
    parser.add_argument(
        "--config-path",
        metavar="PATH",
        default=DEFAULT_CONFIG,
        help=f"the training JSON to optimize (default: {DEFAULT_CONFIG})",
    )
    parser.add_argument(
        "--target-effective-batch",
        metavar="N",
        help="samples per optimizer step to plan for: the largest micro-batch that fits, and the "
        "accumulation that makes N",
    )
    parser.add_argument(
        "--apply", action="store_true", help="write the plan into the config (the original is kept as <file>.backup)"
    )
    parser.add_argument("--profile", action="store_true", help="run real training steps on this GPU and compare")
    return parser


def translate(argv: list[str]) -> list[str]:
    """This script's arguments as ``simpletuner`` arguments (``["estimate", ...]``)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.auto and any(a == "--gpu" or a.startswith("--gpu=") for a in rest):
        parser.error("--auto means --gpu auto: drop one of --auto and --gpu NAME")  # exit 2, bad input
    out = ["estimate", "--config", args.config_path]
    if args.auto:
        out += ["--gpu", "auto"]
    if args.gpu_memory is not None:
        out += ["--gpu-memory", args.gpu_memory]
    if args.target_effective_batch is not None:
        out += ["--target-effective-batch", args.target_effective_batch]
    if args.apply:
        out.append("--apply")
    if args.profile:
        out.append("--profile")
    return out + rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = translate(argv)
    if command[2] == DEFAULT_CONFIG and not Path(DEFAULT_CONFIG).is_file():
        print(
            f"optimize_gpu_config.py: error: no --config-path given, and the default {DEFAULT_CONFIG} does not "
            f"exist in {Path.cwd()}: pass --config-path PATH (a training JSON)",
            file=sys.stderr,
        )
        return 2
    # Run from a checkout without installing: the checkout's own simpletuner comes first.
    root = Path(__file__).resolve().parents[1]
    if (root / "simpletuner" / "__init__.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from simpletuner.cli import main as simpletuner_main

    print("running: simpletuner " + " ".join(shlex.quote(a) for a in command), file=sys.stderr, flush=True)
    return simpletuner_main(command)


if __name__ == "__main__":
    sys.exit(main())
