"""TREAD step-time gain: one training step (the family's ``training_loss`` with the trainer's model set-up, backward,
AdamW step) of a random-weight transformer, with and without ``tread_config``, in one process.

The mid-size model of the other benchmarks (``bench_mfu.py --size mid``) is a UNet, which TREAD does not route; this
one writes the zoo's tiny pipeline of the family and replaces its transformer by one of ``--size`` (:data:`SIZES`:
``mid`` for a GPU, ``small`` for a CPU, ``tiny`` a smoke run), on a batch of random latents and text embeddings.
Routes: the published examples' (:data:`ROUTES`). bf16 autocast, LoRA rank 16 on the bf16 base, gradient
checkpointing as in the examples (``--no-checkpointing``: off). The two models alternate in rounds of ``--steps``
steps (after ``--warmup`` each, and alternating which goes first), so drift hits both alike; the medians of every
timed step.

    python scripts/bench_tread.py [--family flux|wan] [--size mid|small|tiny] [--batch-size 1] [--rounds 4]
        [--steps 5] [--device cuda]

Prints one JSON object (machine, settings, median step time with and without routing, the speed-up).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from simpletuner.configuration import validate_config  # noqa: E402
from simpletuner.models import get_model_spec  # noqa: E402
from simpletuner.testing.zoo import write_tiny_model  # noqa: E402

#: The transformer's config changes per family and size (the rest stays the tiny zoo model's, so the text and latent
#: widths still fit the tiny encoders), and the resolution. ``mid``: Flux 12 blocks (4 double, 8 single) 1024 wide,
#: Wan 10 blocks at Wan 2.1 1.3B's width (1536), 1024 px (4096 image tokens): a GPU run. ``small``: the same blocks
#: 512 wide at 512 px (1024 tokens): a CPU run. ``tiny``: two Flux / three Wan blocks at 64 px, a smoke run.
SIZES: dict[str, tuple[dict[str, dict[str, Any]], int]] = {
    "mid": (
        {
            "flux": {"num_layers": 4, "num_single_layers": 8, "num_attention_heads": 8, "attention_head_dim": 128},
            "wan": {"num_layers": 10, "num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960},
        },
        1024,
    ),
    "small": (
        {
            "flux": {"num_layers": 4, "num_single_layers": 8, "num_attention_heads": 4, "attention_head_dim": 128},
            "wan": {"num_layers": 10, "num_attention_heads": 4, "attention_head_dim": 128, "ffn_dim": 2048},
        },
        512,
    ),
    "tiny": ({"flux": {"num_layers": 1, "num_single_layers": 1}, "wan": {"num_layers": 3}}, 64),
}
#: Every size but ``tiny``: Flux's rotary axes for 128-wide heads, Wan's time embedding and rotary length.
WIDE: dict[str, dict[str, Any]] = {
    "flux": {"axes_dims_rope": (16, 56, 56)},
    "wan": {"freq_dim": 256, "rope_max_seq_len": 1024},
}
#: The published examples' routes (SimpleTuner's examples/flux.peft-lora+TREAD, wan-1.3b.peft-lora+TREAD), the
#: Wan ones scaled from 30 blocks to the 10 here; ``tiny``: half the tokens from block 1 to the last.
ROUTES = {
    "flux": [{"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": -2}],
    "wan": [
        {"selection_ratio": 0.1, "start_layer_idx": 2, "end_layer_idx": 3},
        {"selection_ratio": 0.25, "start_layer_idx": 4, "end_layer_idx": 4},
        {"selection_ratio": 0.4, "start_layer_idx": 5, "end_layer_idx": 5},
        {"selection_ratio": 0.25, "start_layer_idx": 6, "end_layer_idx": 7},
        {"selection_ratio": 0.1, "start_layer_idx": 8, "end_layer_idx": -2},
    ],
}
TINY_ROUTES = [{"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -1}]


def write_model(family: str, root: Path, size: str) -> Path:
    """The tiny zoo pipeline of ``family`` under ``root``, its transformer replaced by one of ``size``."""
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    folder = write_tiny_model(family, root / f"{family}-{size}")
    cls = FluxTransformer2DModel if family == "flux" else WanTransformer3DModel
    config = dict(cls.load_config(folder, subfolder="transformer"))
    config.update(SIZES[size][0][family])
    config.update(WIDE[family] if size != "tiny" else {})
    torch.manual_seed(0)
    cls.from_config(config).save_pretrained(folder / "transformer", safe_serialization=True)  # fp32: loaded as bf16
    return folder


def make_run(folder: Path, family: str, routes, resolution: int, batch_size: int, checkpointing: bool, device):
    """``(step, denoiser)``: one optimizer step of the prepared denoiser on a fixed random batch."""
    raw = {
        "pretrained_model_name_or_path": str(folder),
        "model_family": family,
        "resolution": resolution,
        "aspect_bucket_alignment": 64,
        "max_train_steps": 1,
        "training_type": "lora",
        "lora_rank": 16,
        "mixed_precision": "bf16",
        "gradient_checkpointing": checkpointing,
        "datasets": [{"id": "d", "type": "local", "instance_data_dir": str(folder)}],
    }
    if routes is not None:
        raw["tread_config"] = {"routes": routes}
    spec = get_model_spec(validate_config(raw, check_files=False))
    torch.manual_seed(0)
    denoiser = spec.prepare_denoiser(spec.load_denoiser(torch.bfloat16), torch.bfloat16).to(device)
    params = [p for p in denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    gen = torch.Generator().manual_seed(1)
    latent_shape, shapes = spec.batch_shapes(batch_size)
    latents = torch.randn(latent_shape, generator=gen).to(device)
    conditioning = {k: torch.randn(s, generator=gen).to(device, torch.bfloat16) for k, s in shapes.items()}
    noise_gen = torch.Generator().manual_seed(2)

    def step() -> float:
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = spec.training_loss(denoiser, latents, conditioning, noise_gen).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return step, denoiser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="flux", choices=sorted(ROUTES))
    parser.add_argument("--size", default="mid", choices=list(SIZES))
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--resolution", type=int, help="default: the size's (mid 1024, small 512, tiny 64)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each model per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--work", help="folder for the model (default: a temporary one)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    routes = TINY_ROUTES if args.size == "tiny" else ROUTES[args.family]
    resolution = args.resolution or SIZES[args.size][1]
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(args.family, Path(args.work or tmp), args.size)
        checkpointing = not args.no_checkpointing
        runs = {
            name: make_run(folder, args.family, r, resolution, args.batch_size, checkpointing, device)[0]
            for name, r in (("without", None), ("with", routes))
        }
        for run in runs.values():
            for _ in range(args.warmup):
                run()
        times: dict[str, list[float]] = {name: [] for name in runs}
        for i in range(args.rounds):
            order = list(runs) if i % 2 == 0 else list(reversed(runs))  # alternate which goes first
            for name in order:
                times[name] += [runs[name]() for _ in range(args.steps)]
    medians = {name: statistics.median(t) for name, t in times.items()}
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    result = {
        "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "family": args.family,
        "size": args.size,
        "batch_size": args.batch_size,
        "resolution": resolution,
        "gradient_checkpointing": checkpointing,
        "routes": routes,
        "timed_steps_each": len(times["with"]),
        "median_step_s_without": round(medians["without"], 4),
        "median_step_s_with": round(medians["with"], 4),
        "speedup": round(medians["without"] / medians["with"], 3),
        "peak_allocated_gib_both_models": round(peak, 2) if peak is not None else None,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
