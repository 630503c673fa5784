"""Trainer overhead: steps/s of our training loop vs a minimal hand-written Accelerate loop.

Both train the same LoRA on the same tiny SD model from the same cached batches, in one process,
alternating runs so machine noise hits both alike. Reports the median of several runs.

    python scripts/bench_trainer_overhead.py [--steps 60] [--repeats 5] [--batch-size 4]
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from simpletuner.configuration import validate_config  # noqa: E402
from simpletuner.state import StateTracker  # noqa: E402
from simpletuner.testing.demo_data import write_demo  # noqa: E402
from simpletuner.training.trainer import Trainer  # noqa: E402

_RUNS = itertools.count()


def make_trainer(config_path: Path, batch_size: int, steps: int) -> Trainer:
    """A set-up trainer of the demo config in an output folder of its own: one that is only set up
    keeps its ``output_dir`` lock until it is collected, and the next one must not wait for it."""
    import orjson

    raw = orjson.loads(config_path.read_bytes())
    raw.update(
        train_batch_size=batch_size,
        max_train_steps=steps,
        validation_prompt=None,
        checkpointing_steps=None,
        logging_steps=steps,
        output_dir=str(config_path.parent / f"output-{next(_RUNS)}"),
    )
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    trainer.setup()
    return trainer


def run_ours(trainer: Trainer, steps: int) -> float:
    """The trainer's hot path: read the batch from the cache, then train_step (as train() does)."""
    batches = trainer.data.iterate(trainer.sampler, trainer.accelerator.device)
    pending = []
    start = time.perf_counter()
    for _ in range(steps):
        pending.append(trainer.train_step([next(batches)]).loss)
    torch.stack(pending).tolist()
    return steps / (time.perf_counter() - start)


def run_minimal(trainer: Trainer, steps: int) -> float:
    """A hand-written loop: pre-read batches, inline DDPM loss, AdamW, no bookkeeping."""
    acc = trainer.accelerator
    model = acc.unwrap_model(trainer.model)
    sched = trainer.spec.load_noise_scheduler()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model, opt = acc.prepare(model, opt)
    batches = trainer.data.iterate(trainer.sampler, acc.device)
    data = [next(batches) for _ in range(steps)]  # reading is not counted for the minimal loop
    gen = torch.Generator().manual_seed(0)
    pending = []
    start = time.perf_counter()
    for b in data:
        noise = torch.randn(b.latents.shape, generator=gen)
        t = torch.randint(0, 1000, (b.latents.shape[0],), generator=gen)
        pred = model(sched.add_noise(b.latents, noise, t), t, b.conditioning["prompt_embeds"]).sample
        loss = F.mse_loss(pred, noise)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pending.append(loss.detach())
    torch.stack(pending).tolist()
    return steps / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    with tempfile.TemporaryDirectory() as tmp:
        config = write_demo(Path(tmp), num_images=48)
        ours, minimal = [], []
        for _ in range(args.repeats):
            trainer = make_trainer(config, args.batch_size, args.steps)
            run_ours(trainer, 5)  # warm-up
            ours.append(run_ours(trainer, args.steps))
            trainer = make_trainer(config, args.batch_size, args.steps)
            run_minimal(trainer, 5)
            minimal.append(run_minimal(trainer, args.steps))
    mo, mm = statistics.median(ours), statistics.median(minimal)
    print(f"tiny SD LoRA, batch {args.batch_size}, {args.steps} steps x {args.repeats} runs, median steps/s")
    print("| ours (steps/s) | minimal Accelerate loop (steps/s) | ratio | machine |")
    print("|---:|---:|---:|---|")
    print(
        f"| {mo:.1f} | {mm:.1f} | {mo / mm:.2f}x | {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} |"
    )
    print("all runs (ours):", [f"{x:.1f}" for x in ours])
    print("all runs (minimal):", [f"{x:.1f}" for x in minimal])
    return 0


if __name__ == "__main__":
    sys.exit(main())
