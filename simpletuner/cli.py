"""The ``simpletuner`` command: train, estimate, demo, cache, zoo."""

from __future__ import annotations

import argparse
import sys


def _cmd_train(args) -> int:
    from simpletuner.train import main as train_main

    argv = ["--config", args.config, "--log-level", args.log_level]
    for item in args.overrides:
        argv += ["--set", item]
    return train_main(argv)


def _cmd_estimate(args) -> int:
    from simpletuner.memory.cli import run

    return run(args)


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


def _cmd_cache(args) -> int:
    from simpletuner.caching.admin import main as cache_main

    return cache_main(args.args)


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

    p = sub.add_parser(
        "estimate",
        help="memory needed to train a config, the batch split that fits a GPU (--apply writes it), presets",
        description=(
            "Estimate the GPU memory one training process needs (no GPU required), plan the largest micro-batch "
            "that fits (--target-effective-batch, --apply), explain presets (--preset, --list-presets), or measure "
            "real steps on a GPU (--profile). Exit codes: 0 done, 1 does not fit, 2 bad input."
        ),
    )
    p.add_argument("--config", help="training JSON to estimate")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key for the estimate, as in `simpletuner train`")
    p.add_argument("--gpu", default="auto", metavar="auto|NAME",
                   help="auto (default): this machine's GPU; NAME: a card from the table "
                        "(h100, a100-80gb, rtx4090, gb10, gh200, ...)")
    p.add_argument("--gpu-memory", type=float, metavar="GB",
                   help="the card's memory in GiB: overrides NAME's, or alone means a generic card of that size")
    p.add_argument("--num-processes", type=int, default=1, metavar="N",
                   help="processes (GPUs) training together; splits the effective batch (default: 1)")
    p.add_argument("--target-effective-batch", type=int, metavar="N",
                   help="auto-config: the largest micro-batch that fits and the accumulation that gives N samples per step")
    p.add_argument("--safety-margin", type=float, metavar="F",
                   help="plan to use at most this share of usable memory (default: 0.85)")
    p.add_argument("--apply", action="store_true",
                   help="write the plan into --config (backup <file>.backup first; prints the diff); "
                        "without --target-effective-batch the config's own effective batch is kept")
    p.add_argument("--profile", action="store_true", help="run real training steps on this GPU and compare with the estimate")
    p.add_argument("--profile-steps", type=int, default=3, metavar="N", help="optimizer steps for --profile (default: 3)")
    p.add_argument("--preset", metavar="NAME", help="explain a preset; with --config, show how the config differs from it")
    p.add_argument("--list-presets", action="store_true", help="list the presets in config/presets/")
    p.add_argument("--presets-dir", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_estimate)

    p = sub.add_parser("demo", help="write a tiny model + shapes dataset and train a LoRA on CPU")
    p.add_argument("--dir", default="demo_run", help="folder for model, data, config and output (default: demo_run)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("cache", help="verify or clear a config's latent / text-embedding caches (see `simpletuner cache -h`)",
                       add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER, help="verify|clear --config cfg.json [...]")
    p.set_defaults(func=_cmd_cache)

    p = sub.add_parser("zoo", help="write a tiny random-weight diffusers pipeline folder")
    p.add_argument("--family", default="sd")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_zoo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["cache"]:  # its own parser, so `simpletuner cache -h` shows the cache options
        return _cmd_cache(argparse.Namespace(args=argv[1:]))
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
