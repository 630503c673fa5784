"""The ``simpletuner`` command: train, estimate, demo, cache, diagnose, config-path, zoo, push, convert, export, ui.

Each sub-command is a module of this package with ``add_arguments(parser)`` and ``run(args) -> exit code``
(the arguments several share: :mod:`.arguments`); this module lists them in :data:`COMMANDS`, builds the parser and
dispatches. Only the module of the command asked for is imported, so ``simpletuner --help`` and
``simpletuner train --help`` stay quick (no torch).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One ``simpletuner`` sub-command: the module that declares and runs it, and its line in ``--help``."""

    module: str
    help: str
    #: The module also runs on its own (``python -m simpletuner.cli.train``, as ``simpletuner/train.py``;
    #: ``gh200_diagnostic.py``; ``python -m simpletuner.cli.cache``) and says "simpletuner NAME: error: unrecognized
    #: arguments" there; the others leave unknown arguments to ``simpletuner``'s own parser.
    standalone: bool = False


COMMANDS: dict[str, Command] = {
    "train": Command(
        "simpletuner.cli.train",
        "train from a JSON config (single process; use accelerate launch for several); see `simpletuner train -h`",
        standalone=True,
    ),
    "estimate": Command(
        "simpletuner.cli.estimate",
        "memory needed to train a config, the batch split that fits a GPU (--apply writes it), presets",
    ),
    "demo": Command("simpletuner.cli.demo", "write a tiny model + shapes dataset and train a LoRA on CPU"),
    "cache": Command(
        "simpletuner.cli.cache",
        "verify or clear a config's latent / text-embedding caches (see `simpletuner cache -h`)",
        standalone=True,
    ),
    "diagnose": Command(
        "simpletuner.cli.diagnose",
        "check a GH200 / GB10 (or any) machine, as gh200_diagnostic.py (see `simpletuner diagnose -h`)",
        standalone=True,
    ),
    "config-path": Command(
        "simpletuner.cli.config_path",
        "print the path of a bundled config file (Accelerate YAMLs, presets, examples), also when installed",
    ),
    "zoo": Command("simpletuner.cli.zoo", "write a tiny random-weight diffusers pipeline folder"),
    "push": Command(
        "simpletuner.cli.push",
        "upload a finished run (weights, model card, validation images) or one checkpoint to the Hugging Face Hub",
    ),
    "convert": Command(
        "simpletuner.cli.convert",
        "write a SimpleTuner config.json (+ multidatabackend.json) as a native config, with the mapping report",
    ),
    "export": Command(
        "simpletuner.cli.export",
        "write a finished run's LoRA with kohya's or ComfyUI's key names (--format kohya|comfyui)",
    ),
    "ui": Command(
        "simpletuner.cli.ui",
        "a web UI on 127.0.0.1: runs, live charts and pictures, new run / demo, stop, resume, compare",
    ),
}

#: The distribution (pyproject.toml's name; "simpletuner" on the package index is another project).
DISTRIBUTION = "simpletuner-gh200"


def version_string() -> str:
    """``simpletuner --version``: the installed distribution's version, else the package's own."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{DISTRIBUTION} {version(DISTRIBUTION)}"
    except PackageNotFoundError:  # a checkout on sys.path, or an older install under another name
        from simpletuner import __version__

        return f"{DISTRIBUTION} {__version__} (source)"


def build_parser(command: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """``simpletuner``'s parser and its sub-parsers by name; only ``command``'s has its arguments."""
    parser = argparse.ArgumentParser(prog="simpletuner", description="Diffusion-model fine-tuning.")
    parser.add_argument("--version", action="version", version=version_string())
    sub = parser.add_subparsers(dest="command", required=True)
    subparsers = {name: sub.add_parser(name, help=entry.help) for name, entry in COMMANDS.items()}
    if command in COMMANDS:
        _module(command).add_arguments(subparsers[command])
    return parser, subparsers


def _module(command: str):
    return importlib.import_module(COMMANDS[command].module)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # simpletuner's own options take no value, so the first word that is not an option names the command
    command = next((word for word in argv if not word.startswith("-")), None)
    parser, subparsers = build_parser(command)
    args, unknown = parser.parse_known_args(argv)
    assert command is not None, "argparse exits when no command is given"
    if unknown:
        reporter = subparsers[command] if COMMANDS[command].standalone else parser
        reporter.error(f"unrecognized arguments: {' '.join(unknown)}")
    return _module(command).run(args)
