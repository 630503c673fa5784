"""MFU benchmark: N optimizer steps through the real trainer (``simpletuner train``), then the median
of the figures it logs (MFU, TFLOPS, samples/s, step time, peak memory) over the steps after warm-up.

The trainer logs one window per step here (``logging_steps=1``) to ``output_dir/metrics.jsonl``;
MFU is there only where the trainer knows the GPU's peak (the GPU table or ``--peak-tflops``), so
on CPU, or on a card the table lacks, it is reported as "unknown", as the trainer says it.

    python scripts/bench_mfu.py --work DIR [--size mid|tiny] [--steps 12] [--warmup 2] [--batch-size 4]
    python scripts/bench_mfu.py --config CFG.json --work DIR ...      # an existing config instead

``--size mid`` writes an SD-1.5-like random-weight pipeline (UNet at reduced width, ~140 M
parameters, 512 px) with a synthetic dataset; ``tiny`` the zoo's tiny SD model (64 px, CPU-fast).
``--write-only`` writes model, data and config and prints ``{"config": PATH}``.
Prints one JSON object; exit code 0 when the run finished, 1 when it failed (the log tail says why).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("mfu", "tflops", "samples_per_s", "step_time_s", "peak_memory_gib", "data_wait_share")
#: (resolution, bucket alignment, images) per size: the mid UNet halves 3 times after the VAE's /8.
SIZES = {"tiny": (64, 16, 24), "mid": (512, 64, 16)}


def write_mid_sd(out_dir: str | Path, seed: int = 0) -> Path:
    """An SD-1.5-like pipeline with random weights: the UNet's four levels at 0.4x SD 1.5's width
    (~140 M parameters, ~550 MB fp32), a small CLIP text encoder (256 wide, 2 layers), a small VAE."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from simpletuner.testing.zoo import save_sd_pipeline, tiny_clip_tokenizer

    torch.manual_seed(seed)
    tokenizer = tiny_clip_tokenizer()
    text = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    unet = UNet2DConditionModel(
        sample_size=64,
        in_channels=4,
        out_channels=4,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=256,
        attention_head_dim=8,
    )
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 32, 32, 32),
        latent_channels=4,
        norm_num_groups=16,
        sample_size=512,
        layers_per_block=1,
    )
    return save_sd_pipeline(Path(out_dir), unet, vae, CLIPTextModel(text), tokenizer)


def write_bench_config(root: str | Path, size: str = "mid", batch_size: int = 4, mixed_precision: str = "bf16") -> Path:
    """Model (unless already there), shapes dataset and a LoRA config under ``root``; returns the config path."""
    from simpletuner.testing.demo_data import write_shapes_dataset
    from simpletuner.testing.zoo import write_tiny_model

    if size not in SIZES:
        raise ValueError(f"--size must be one of {', '.join(SIZES)}, not {size!r}")
    resolution, alignment, num_images = SIZES[size]
    root = Path(root).resolve()
    model = root / f"model-{size}"
    if not (model / "model_index.json").exists():
        write_mid_sd(model) if size == "mid" else write_tiny_model("sd", model)
    data = write_shapes_dataset(root / "data", num_images=num_images, sizes=((resolution, resolution),))
    config = {
        "pretrained_model_name_or_path": str(model),
        "model_family": "sd",
        "output_dir": str(root / "output"),
        "resolution": resolution,
        "aspect_bucket_alignment": alignment,
        "train_batch_size": batch_size,
        "max_train_steps": 10,
        "learning_rate": 1e-4,
        "lr_scheduler": "constant",
        "training_type": "lora",
        "lora_rank": 16,
        "mixed_precision": mixed_precision,
        "logging_steps": 1,
        "seed": 42,
        "cache_config": {"cache_dir": str(root / "cache")},
        "datasets": [{"id": "shapes", "type": "local", "instance_data_dir": str(data), "caption_strategy": "textfile"}],
    }
    path = root / f"config-{size}.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def train_command(
    config: Path,
    output_dir: Path,
    steps: int,
    batch_size: int = 4,
    mixed_precision: str = "bf16",
    peak_tflops: float | None = None,
) -> list[str]:
    """``simpletuner train`` of ``config`` for ``steps`` steps, one log window per step, nothing else."""
    sets = {
        "max_train_steps": steps,
        "train_batch_size": batch_size,
        "gradient_accumulation_steps": 1,
        "mixed_precision": mixed_precision,
        "num_train_epochs": None,
        "logging_steps": 1,
        "validation_prompt": None,
        "validation_prompts": None,
        "checkpointing_steps": None,
        "resume_from_checkpoint": None,
        "report_to": "none",
        "output_dir": str(output_dir),
    }
    cmd = [sys.executable, "-m", "simpletuner.cli", "train", "--config", str(config), "--overwrite"]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={json.dumps(value)}"]
    if peak_tflops is not None:
        cmd += ["--peak-tflops", str(peak_tflops)]
    return cmd


def child_env(environ) -> dict:
    """The training run's environment: offline, the checkout first on PYTHONPATH and the caller's
    PYTHONPATH after it (a site folder of carried wheels, say), never replaced."""
    pythonpath = os.pathsep.join(p for p in (str(ROOT), environ.get("PYTHONPATH")) if p)
    return {**environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": pythonpath}


def summarize(rows: list[dict], warmup: int) -> dict:
    """The median of each logged figure over the windows after step ``warmup`` (all windows when
    there are no others); a figure no window has (MFU without a known peak) is "unknown"."""
    kept = [r for r in rows if r.get("step", 0) > warmup] or rows
    out: dict = {"steps_measured": len(kept)}
    for name in FIGURES:
        values = [r[name] for r in kept if isinstance(r.get(name), (int, float))]
        out[name] = statistics.median(values) if values else "unknown"
    return out


def read_metrics(path: Path) -> list[dict]:
    """The windows of ``metrics.jsonl``: one JSON object a line (step, the figures, a timestamp)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="folder for model, data, caches and the run's output")
    parser.add_argument("--config", help="train this config instead of writing one (its output_dir is replaced)")
    parser.add_argument("--size", default="mid", choices=sorted(SIZES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians (default: 2)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--mixed-precision", default="bf16", choices=("no", "fp16", "bf16"))
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense peak, where the trainer's table lacks it")
    parser.add_argument("--timeout", type=float, default=None, help="seconds the training run may take")
    parser.add_argument("--write-only", action="store_true", help="write model, data and config; print the path")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup})")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    config = (
        Path(args.config) if args.config else write_bench_config(work, args.size, args.batch_size, args.mixed_precision)
    )
    if args.write_only:
        print(json.dumps({"config": str(config)}))
        return 0
    output_dir = work / "mfu-output"
    cmd = train_command(config, output_dir, args.steps, args.batch_size, args.mixed_precision, args.peak_tflops)
    env = child_env(os.environ)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout, cwd=ROOT)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, log = 124, f"timed out after {args.timeout} s\n{exc.stdout or ''}{exc.stderr or ''}"
    seconds = time.perf_counter() - start
    metrics = output_dir / "metrics.jsonl"
    rows = read_metrics(metrics) if metrics.exists() else []
    result = {
        "status": "ok" if rc == 0 and rows else "failed",
        "returncode": rc,
        "seconds": round(seconds, 2),
        "config": str(config),
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_size": args.batch_size,
        "mixed_precision": args.mixed_precision,
        **summarize(rows, args.warmup),
    }
    if result["status"] != "ok":
        result["log_tail"] = log[-3000:]
    print(json.dumps(result, indent=2, default=str))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
