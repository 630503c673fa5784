"""`simpletuner demo`: write the demo (simpletuner.testing.demo_data), train on it, show before | after."""

from __future__ import annotations

import argparse

from simpletuner.cli.arguments import add_log_level_argument
from simpletuner.cli.train import main as train_main  # light: torch comes once training starts
from simpletuner.testing.demo_data import VALIDATION_PROMPT, write_before_after, write_demo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``simpletuner demo``'s options."""
    parser.add_argument(
        "--dir", default="demo_run", help="folder for model, data, config and output (default: demo_run)"
    )
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    add_log_level_argument(parser)


def run(args: argparse.Namespace) -> int:
    """``simpletuner demo``: write the demo, train on it, show before | after; returns the exit code."""
    # Imported here: write_demo (tests, benchmarks) needs neither torch nor the trainer's start.
    import torch

    from simpletuner.training.cpu_threads import settle_cpu_threads

    # The tiny model is built here, before the trainer decides (and logs) the thread count: on a busy
    # CPU host torch's one thread per core makes even that slow.
    settle_cpu_threads(None, is_cuda=torch.cuda.is_available())
    config = write_demo(args.dir, max_train_steps=args.steps)
    print(f"demo: model, data and config written under {config.parent}")
    # --overwrite: a demo re-run starts afresh (its caches are re-used); `train` on its config extends it
    # a Ctrl-C names `train` on the config as the way to resume: `simpletuner demo` again would start over
    resume = f"simpletuner train --config {config}"
    code = train_main(
        ["--config", str(config), "--log-level", args.log_level, "--overwrite", "--resume-command", resume]
    )
    if code == 0:
        out = config.parent / "output"
        print(f"demo: LoRA at {out / 'pytorch_lora_weights.safetensors'}; all samples in {out / 'validation'}")
        side_by_side = write_before_after(out, prompt=VALIDATION_PROMPT)
        if side_by_side is not None:
            print(f"demo: before | after training (same seed and prompt): {side_by_side}")
    return code
