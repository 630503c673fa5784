"""The ``simpletuner`` command: train, estimate, demo, cache, diagnose, config-path, zoo."""

from __future__ import annotations

import argparse
import sys


def _cmd_train(args) -> int:
    from simpletuner.train import _is_single_process, end_process  # one parser: train.py's
    from simpletuner.train import main as train_main

    code = train_main(args.args)
    if not _is_single_process():  # a rank of `accelerate launch`: ends as train.py's ranks do
        end_process(code)
    return code


def _cmd_estimate(args) -> int:
    from simpletuner.memory.cli import run

    return run(args)


def _cmd_demo(args) -> int:
    from simpletuner.demo import VALIDATION_PROMPT, write_before_after, write_demo
    from simpletuner.train import main as train_main

    config = write_demo(args.dir, max_train_steps=args.steps)
    print(f"demo: model, data and config written under {config.parent}")
    # --overwrite: a demo re-run starts afresh (its caches are re-used); `train` on its config extends it
    code = train_main(["--config", str(config), "--log-level", args.log_level, "--overwrite"])
    if code == 0:
        out = config.parent / "output"
        print(f"demo: LoRA at {out / 'pytorch_lora_weights.safetensors'}; all samples in {out / 'validation'}")
        side_by_side = write_before_after(out, prompt=VALIDATION_PROMPT)
        if side_by_side is not None:
            print(f"demo: before | after training (same seed and prompt): {side_by_side}")
    return code


def _cmd_cache(args) -> int:
    from simpletuner.caching.admin import main as cache_main

    return cache_main(args.args)


def _cmd_diagnose(args) -> int:
    from simpletuner.gh200.diagnostic import main as diagnose_main  # the code behind gh200_diagnostic.py

    return diagnose_main(args.args, prog="simpletuner diagnose")


def _cmd_config_path(args) -> int:
    from simpletuner.resources import print_config_path

    return print_config_path(args.name, list_all=args.list)


def _cmd_zoo(args) -> int:
    from simpletuner.models.zoo import write_tiny_model

    path = write_tiny_model(args.family, args.out)
    print(f"wrote tiny {args.family} pipeline to {path}")
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="simpletuner", description="Diffusion-model fine-tuning.")
    parser.add_argument("--version", action="version", version=version_string())
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train",
        add_help=False,
        help="train from a JSON config (single process; use accelerate launch for several); see `simpletuner train -h`",
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="--config cfg.json [--set KEY=VALUE] [--preset NAME] ...")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "estimate",
        help="memory needed to train a config, the batch split that fits a GPU (--apply writes it), presets",
        description=(
            "Estimate the GPU memory one training process needs (no GPU required), plan the largest micro-batch "
            "that fits (--target-effective-batch, --apply), explain presets (--preset, --list-presets), or measure "
            "real steps on a GPU (--profile). Exit codes: 0 done, 1 does not fit, 2 bad input (config, flags, preset, "
            "PYTORCH_CUDA_ALLOC_CONF keys stock PyTorch rejects), 70 internal error (a bug in simpletuner: the "
            "traceback and what to report are printed)."
        ),
    )
    p.add_argument("--config", help="training JSON to estimate")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key for the estimate, as in `simpletuner train`",
    )
    p.add_argument(
        "--gpu",
        default="auto",
        metavar="auto|NAME",
        help="auto (default): this machine's GPU; NAME: a card from the table "
        "(h100, a100-80gb, rtx4090, gb10, gh200, ...)",
    )
    p.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GB",
        help="the card's memory in GiB: overrides NAME's, or alone means a generic card of that size",
    )
    p.add_argument(
        "--num-processes",
        type=int,
        default=1,
        metavar="N",
        help="processes (GPUs) training together; splits the effective batch (default: 1)",
    )
    p.add_argument(
        "--target-effective-batch",
        type=int,
        metavar="N",
        help="auto-config: the largest micro-batch that fits and the accumulation that gives N samples per step",
    )
    p.add_argument(
        "--safety-margin",
        type=float,
        metavar="F",
        help="plan to use at most this share of usable memory (default: 0.85)",
    )
    p.add_argument(
        "--apply",
        action="store_true",
        help="write the plan into --config (backup <file>.backup first; prints the diff); "
        "without --target-effective-batch the config's own effective batch is kept; with --preset, "
        "write the preset's values for the keys the config does not set",
    )
    p.add_argument(
        "--profile", action="store_true", help="run real training steps on this GPU and compare with the estimate"
    )
    p.add_argument(
        "--profile-steps", type=int, default=3, metavar="N", help="optimizer steps for --profile (default: 3)"
    )
    p.add_argument(
        "--preset",
        metavar="NAME",
        help="explain a preset; with --config, show how the config differs from "
        "it; with --config and --apply, write it into the config (keys the config sets win)",
    )
    p.add_argument(
        "--list-presets",
        action="store_true",
        help="list the presets (config/presets/, bundled in the package when installed) with the machine and workload each was made for",
    )
    p.add_argument("--presets-dir", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_estimate)

    p = sub.add_parser("demo", help="write a tiny model + shapes dataset and train a LoRA on CPU")
    p.add_argument("--dir", default="demo_run", help="folder for model, data, config and output (default: demo_run)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "cache",
        help="verify or clear a config's latent / text-embedding caches (see `simpletuner cache -h`)",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="verify|clear --config cfg.json [...]")
    p.set_defaults(func=_cmd_cache)

    p = sub.add_parser(
        "diagnose",
        help="check a GH200 / GB10 (or any) machine, as gh200_diagnostic.py (see `simpletuner diagnose -h`)",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="[--json] [--oversubscription-scale S] [--force]")
    p.set_defaults(func=_cmd_diagnose)

    p = sub.add_parser(
        "config-path",
        help="print the path of a bundled config file (Accelerate YAMLs, presets, examples), also when installed",
        description="Print where a file of simpletuner's config folder is: config/ in a checkout, inside the "
        "package when installed from a wheel. E.g. accelerate launch --config_file "
        '"$(simpletuner config-path accelerate_config_gh200.yaml)" -m simpletuner.train --config cfg.json',
    )
    p.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        help="accelerate_config_gh200.yaml, presets/gh200.json, examples/sd15_lora.json, a file name that "
        "occurs once, or gh200 / gh200_fsdp for the Accelerate YAMLs; none: the folder itself",
    )
    p.add_argument("--list", action="store_true", help="print the path of every bundled file")
    p.set_defaults(func=_cmd_config_path)

    p = sub.add_parser("zoo", help="write a tiny random-weight diffusers pipeline folder")
    p.add_argument("--family", default="sd")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_zoo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # train.py's own parser, so `simpletuner train -h` shows the train options
        return _cmd_train(argparse.Namespace(args=argv[1:]))
    if argv[:1] == ["cache"]:  # its own parser, so `simpletuner cache -h` shows the cache options
        return _cmd_cache(argparse.Namespace(args=argv[1:]))
    if argv[:1] == ["diagnose"]:  # likewise: gh200_diagnostic.py's own parser, flags and exit codes
        return _cmd_diagnose(argparse.Namespace(args=argv[1:]))
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
