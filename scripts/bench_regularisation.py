"""Benchmark: what a regularisation ("parent-student") micro-batch costs against a plain one.

On the tiny SD UNet of the model zoo with a LoRA (``--lora-type standard`` or ``lycoris``), times
one training micro-step — ``spec.training_loss`` then ``backward`` — for a plain batch and for a
regularisation batch (``is_regularisation_data``: one more forward pass, without gradients and
with the adapter switched off, for the target). Runs are interleaved; each figure is the median
over ``--repeats`` runs of the mean of ``--steps`` steps, in ms per step.

    python scripts/bench_regularisation.py --steps 20 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, also when not installed

import torch  # noqa: E402

from simpletuner.configuration import validate_config  # noqa: E402
from simpletuner.models import get_model_spec  # noqa: E402
from simpletuner.testing.zoo import write_tiny_sd  # noqa: E402


def _setup(model_dir: Path, lora_type: str, device: torch.device):
    raw = {
        "pretrained_model_name_or_path": str(model_dir),
        "model_family": "sd",
        "output_dir": str(model_dir.parent / "out"),
        "resolution": 64,
        "aspect_bucket_alignment": 16,
        "max_train_steps": 1,
        "lora_rank": 4,
        "datasets": [{"id": "x", "type": "local", "instance_data_dir": str(model_dir)}],
    }
    if lora_type == "lycoris":
        raw.update(lora_type="lycoris", lycoris={"algo": "locon"})
    spec = get_model_spec(validate_config(raw, check_files=False))
    model = spec.prepare_denoiser(spec.load_denoiser(torch.float32), torch.float32).to(device)
    return spec, model


def _time(spec, model, latents, cond, is_reg: bool, steps: int, device: torch.device) -> float:
    gen = torch.Generator().manual_seed(0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        loss = spec.training_loss(model, latents, cond, gen, is_regularisation_data=is_reg).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="micro-steps per timed run")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per case (median)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lora-type", choices=("standard", "lycoris"), default="standard")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_sd(Path(tmp) / "model")
        spec, model = _setup(model_dir, args.lora_type, device)
        gen = torch.Generator().manual_seed(1)
        latents = torch.randn(args.batch_size, 4, 8, 8, generator=gen).to(device)
        cond = {"prompt_embeds": torch.randn(args.batch_size, 77, 32, generator=gen).to(device)}
        for is_reg in (False, True):  # warm-up
            _time(spec, model, latents, cond, is_reg, 3, device)
        runs: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for is_reg in (False, True):
                runs[is_reg].append(_time(spec, model, latents, cond, is_reg, args.steps, device))
    plain, reg = statistics.median(runs[False]), statistics.median(runs[True])
    print(
        f"device {device} ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, lora_type {args.lora_type}, batch {args.batch_size}, "
        f"{args.steps} steps x {args.repeats} runs"
    )
    print(f"plain step:          {plain:8.2f} ms  (runs: {', '.join(f'{x:.2f}' for x in runs[False])})")
    print(f"regularisation step: {reg:8.2f} ms  (runs: {', '.join(f'{x:.2f}' for x in runs[True])})")
    print(f"ratio: {reg / plain:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
