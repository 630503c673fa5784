"""Entry point: ``accelerate launch simpletuner/train.py --config cfg.json``."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="simpletuner train", description="Train from a JSON config.")
    parser.add_argument("--config", required=True, help="path to the training JSON")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (dotted for nested keys; JSON values), e.g. --set max_train_steps=10")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def run(config_path: str, overrides=(), log_level: str = "INFO"):
    """Load the config, build the run's StateTracker and Trainer, train. Returns the TrainResult."""
    from simpletuner.configuration import load_config
    from simpletuner.state import StateTracker
    from simpletuner.training.trainer import Trainer

    logging.basicConfig(level=getattr(logging, log_level), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded = load_config(config_path, overrides)
    state = StateTracker(loaded.config, loaded.raw)
    return Trainer(state).train()


def main(argv: list[str] | None = None) -> int:
    from simpletuner.configuration import ConfigError
    from simpletuner.training.reliability import RunStopped
    from simpletuner.training.launch import LaunchError

    args = build_parser().parse_args(argv)
    try:
        run(args.config, args.overrides, args.log_level)
    except RunStopped as exc:  # preempted (143/130), non-finite (3), out of memory (4): the message says what next
        print(f"stopped: {exc}", file=sys.stderr)
        return exc.exit_code
    except (ConfigError, ValueError, LaunchError) as exc:  # user errors: the message says what to fix
        if args.log_level == "DEBUG":
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    if __package__ in (None, ""):  # run as a script (accelerate launch simpletuner/train.py)
        import os

        # Replace the script's own folder (which would shadow packages) with the repository root.
        sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
