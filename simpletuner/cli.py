"""The ``simpletuner`` command: train, demo, zoo."""

from __future__ import annotations

import argparse
import sys


def _cmd_train(args) -> int:
    from simpletuner.train import main as train_main

    argv = ["--config", args.config, "--log-level", args.log_level]
    for item in args.overrides:
        argv += ["--set", item]
    return train_main(argv)


def _cmd_demo(args) -> int:
    from simpletuner.demo import write_demo
    from simpletuner.train import main as train_main

    config = write_demo(args.dir, max_train_steps=args.steps)
    print(f"demo: model, data and config written under {config.parent}")
    code = train_main(["--config", str(config), "--log-level", args.log_level])
    if code == 0:
        out = config.parent / "output"
        print(f"demo: LoRA at {out / 'pytorch_lora_weights.safetensors'}; before/after samples in {out / 'validation'}")
    return code


def _cmd_zoo(args) -> int:
    from simpletuner.models.zoo import write_tiny_model

    path = write_tiny_model(args.family, args.out)
    print(f"wrote tiny {args.family} pipeline to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="simpletuner", description="Diffusion-model fine-tuning.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a JSON config (single process; use accelerate launch for several)")
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("demo", help="write a tiny model + shapes dataset and train a LoRA on CPU")
    p.add_argument("--dir", default="demo_run", help="folder for model, data, config and output (default: demo_run)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("zoo", help="write a tiny random-weight diffusers pipeline folder")
    p.add_argument("--family", default="sd")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_zoo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
