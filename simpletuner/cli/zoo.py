"""``simpletuner zoo --family NAME --out DIR``: write a tiny random-weight pipeline folder
(:mod:`simpletuner.testing.zoo`)."""

from __future__ import annotations

import argparse

from simpletuner.testing.zoo import TINY_MODELS, write_tiny_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``simpletuner zoo``'s options (``--help`` lists the families)."""
    parser.description = (
        "Write a tiny random-weight diffusers pipeline folder (configs, tokenizers and weights; seconds on a CPU) "
        "to try a config or the trainer on: its images are noise, it is no model to fine-tune."
    )
    parser.add_argument(
        "--family",
        default="sd",
        choices=list(TINY_MODELS),
        help="the model family (model_family in a config), or a variant: wan22 (Wan 2.2's two experts), "
        "wan22_i2v, wan22_ti2v, qwen_image_edit, flux_kontext (default: sd)",
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="the folder to write (pretrained_model_name_or_path)"
    )


def run(args: argparse.Namespace) -> int:
    """``simpletuner zoo``: write the tiny pipeline of ``--family`` into ``--out``; returns the exit code."""
    path = write_tiny_model(args.family, args.out)
    print(f"wrote tiny {args.family} pipeline to {path}")
    return 0
