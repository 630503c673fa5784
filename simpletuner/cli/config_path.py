"""``simpletuner config-path [NAME] [--list]``: where a bundled config file is (:mod:`simpletuner.resources`)."""

from __future__ import annotations

import argparse
import sys

from simpletuner.resources import ACCELERATE_CONFIGS, accelerate_config, config_dir, config_file, list_config_files


def print_config_path(name: str | None, list_all: bool = False, stream=None) -> int:
    """``simpletuner config-path [NAME] [--list]``: print one path (or the folder, or every file); exit code."""
    stream = stream if stream is not None else sys.stdout
    if list_all:
        root = config_dir()
        for rel in list_config_files():
            print(root / rel, file=stream)
        return 0
    if name is None:
        print(config_dir(), file=stream)
        return 0
    try:
        path = accelerate_config(name) if name in ACCELERATE_CONFIGS else config_file(name)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path, file=stream)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``simpletuner config-path``'s options."""
    parser.description = (
        "Print where a file of simpletuner's config folder is: config/ in a checkout, inside the "
        "package when installed from a wheel. E.g. accelerate launch --config_file "
        '"$(simpletuner config-path accelerate_config_gh200.yaml)" -m simpletuner.train --config cfg.json'
    )
    parser.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        help="accelerate_config_gh200.yaml, presets/gh200.json, examples/sd15_lora.json, a file name that "
        "occurs once, or gh200 / gh200_fsdp for the Accelerate YAMLs; none: the folder itself",
    )
    parser.add_argument("--list", action="store_true", help="print the path of every bundled file")


def run(args: argparse.Namespace) -> int:
    """``simpletuner config-path`` from the parsed arguments; returns the exit code."""
    return print_config_path(args.name, list_all=args.list)
