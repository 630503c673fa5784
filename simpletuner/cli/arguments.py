"""The arguments several ``simpletuner`` commands share (the command-module protocol: :mod:`simpletuner.cli`).

A command module (``cli/train.py``, ``cli/estimate.py``, ``cli/cache.py``, ...) exposes

- ``add_arguments(parser)``: its options (and its description) on the parser it is given, the
  ``simpletuner NAME`` sub-parser or its own parser when it also runs on its own;
- ``run(args) -> int``: the work, from the parsed arguments; returns the exit code
  (:mod:`simpletuner.exit_codes`).

It imports only the standard library, so building a parser stays cheap (``simpletuner --help`` loads no torch).
"""

from __future__ import annotations

import argparse

#: The choices of ``--log-level``.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_config_arguments(parser: argparse.ArgumentParser, *, config_help: str, set_help: str, required: bool) -> None:
    """``--config`` (the training JSON) and ``--set KEY=VALUE`` (repeatable, into ``args.overrides``).

    Each command words the help for what it does with the config.
    """
    parser.add_argument("--config", required=required, help=config_help)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=set_help,
    )


def add_log_level_argument(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """``--log-level`` (default INFO), the level our log lines start from."""
    parser.add_argument("--log-level", default="INFO", choices=list(LOG_LEVELS), help=help)
