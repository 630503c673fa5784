"""EMA cost: ms per optimizer step of the tiny SD LoRA with ``use_ema`` off and on.

One set-up Trainer of the demo config (``simpletuner demo``'s tiny SD model and shapes dataset) is
timed on its hot path (read the batch from the cache, then ``train_step``, which makes the EMA
update after the optimizer step). The variants (no EMA, an EMA on the CPU, one on the training
device) take turns on it in blocks of ``--steps`` steps, so each is timed on the same model and
machine noise hits all alike; each cell is the median over ``--repeats`` blocks. The EMA update
alone (``EMA.step``) is timed on the same parameters too.

    python scripts/bench_ema.py [--steps 40] [--repeats 7] [--batch-size 4]
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
os.environ.setdefault("TQDM_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from simpletuner.configuration import validate_config  # noqa: E402
from simpletuner.state import StateTracker  # noqa: E402
from simpletuner.testing.demo_data import write_demo  # noqa: E402
from simpletuner.training.ema import EMA  # noqa: E402
from simpletuner.training.trainer import Trainer  # noqa: E402

_RUNS = itertools.count()
VARIANTS = {
    "no EMA": {"use_ema": False},
    "EMA on cpu": {"use_ema": True, "ema_device": "cpu"},
    "EMA on accelerator": {"use_ema": True, "ema_device": "accelerator"},
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_trainer(config_path: Path, batch_size: int, steps: int, overrides: dict) -> Trainer:
    """A set-up trainer of the demo config in an output folder of its own."""
    import orjson

    raw = orjson.loads(config_path.read_bytes())
    raw.update(
        train_batch_size=batch_size,
        max_train_steps=steps,
        validation_prompt=None,
        checkpointing_steps=None,
        logging_steps=steps,
        output_dir=str(config_path.parent / f"output-{next(_RUNS)}"),
        **overrides,
    )
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    trainer.setup()
    return trainer


def ms_per_step(trainer: Trainer, steps: int) -> float:
    """The trainer's hot path, as train() runs it: the batch from the cache, then train_step."""
    batches = trainer.data.iterate(trainer.sampler, trainer.accelerator.device)
    pending = []
    _sync()
    start = time.perf_counter()
    for _ in range(steps):
        pending.append(trainer.train_step([next(batches)]).loss)
    torch.stack(pending).tolist()
    _sync()
    return 1000 * (time.perf_counter() - start) / steps


def ms_per_update(trainer: Trainer, updates: int) -> float:
    """``EMA.step`` alone on the trainer's parameters."""
    ema = trainer.ema
    ema.step(2)  # warm-up
    _sync()
    start = time.perf_counter()
    for i in range(updates):
        ema.step(i + 2)
    _sync()
    return 1000 * (time.perf_counter() - start) / updates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    step_ms = {name: [] for name in VARIANTS}
    update_ms = {name: [] for name in VARIANTS if VARIANTS[name]["use_ema"]}
    total = (len(VARIANTS) * args.repeats + 1) * args.steps
    with tempfile.TemporaryDirectory() as tmp:
        config = write_demo(Path(tmp), num_images=48)
        # One trainer, so every variant trains the same model on the same batches; each variant is
        # its EMA (or none) put in place for a block of steps, the blocks interleaved.
        trainer = make_trainer(config, args.batch_size, total, {"use_ema": True})
        model, device = trainer.accelerator.unwrap_model(trainer.model), trainer.accelerator.device
        emas = {
            name: EMA.for_model(model, trainer.config.model_copy(update=overrides), device)
            if overrides["use_ema"]
            else None
            for name, overrides in VARIANTS.items()
        }
        trainer.ema = None
        ms_per_step(trainer, args.steps)  # warm-up
        for _ in range(args.repeats):
            for name, ema in emas.items():
                trainer.ema = ema
                step_ms[name].append(ms_per_step(trainer, args.steps))
                if ema is not None:
                    update_ms[name].append(ms_per_update(trainer, 200))
        params = sum(p.numel() for p in emas["EMA on cpu"].params)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    base = statistics.median(step_ms["no EMA"])
    print(
        f"tiny SD LoRA ({params} trained parameters), batch {args.batch_size}, {args.repeats} interleaved blocks of "
        f"{args.steps} steps per variant, median ms/step; {device}; {platform.system()} {platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    )
    print("| variant | ms/step | vs no EMA | EMA.step alone (ms) |")
    print("|---|---:|---:|---:|")
    for name in VARIANTS:
        med = statistics.median(step_ms[name])
        alone = f"{statistics.median(update_ms[name]):.3f}" if name in update_ms else "-"
        print(f"| {name} | {med:.2f} | {med / base:.3f}x | {alone} |")
    for name in VARIANTS:
        print(f"all blocks ({name}):", [f"{x:.2f}" for x in step_ms[name]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
