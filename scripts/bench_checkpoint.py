"""Checkpoint figures: save and load seconds and sizes for the tiny models, and resume-to-first-step.

    python scripts/bench_checkpoint.py [--repeats 5]

Saves go through the trainer's own ``save_checkpoint`` (temp folder, fsync, marker, rename); loads
through ``Trainer._resume``. "Resume to first step" is a fresh Trainer from construction to the
end of its first optimizer step after resuming, with warm caches, imports excluded.
"""

from __future__ import annotations

import argparse
import logging
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

import orjson  # noqa: E402
import torch  # noqa: E402

from simpletuner.configuration import validate_config  # noqa: E402
from simpletuner.state import StateTracker  # noqa: E402
from simpletuner.testing.demo_data import write_demo  # noqa: E402
from simpletuner.training.trainer import Trainer  # noqa: E402


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


def measure(raw: dict, repeats: int) -> dict[str, float]:
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    trainer.train()  # fills caches, trains max_train_steps
    saves, loads = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        path = trainer.save_checkpoint()
        saves.append(time.perf_counter() - start)
    resume_raw = dict(raw, resume_from_checkpoint=str(path), max_train_steps=raw["max_train_steps"] + 1)
    firsts = []
    for _ in range(repeats):
        start = time.perf_counter()
        resumed = Trainer(StateTracker(validate_config(resume_raw), resume_raw))
        resumed.setup()  # resumes from the checkpoint
        batches = resumed.data.iterate(resumed.sampler, resumed.accelerator.device)
        resumed.train_step([next(batches)])
        firsts.append(time.perf_counter() - start)
        load_start = time.perf_counter()
        resumed._resume()  # the load alone, timed on the set-up trainer
        loads.append(time.perf_counter() - load_start)
    return {
        "size_mb": _folder_bytes(path) / 1e6,
        "save_s": statistics.median(saves),
        "load_s": statistics.median(loads),
        "resume_to_first_step_s": statistics.median(firsts),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    logging.disable(logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = orjson.loads(write_demo(Path(tmp), num_images=24).read_bytes())
        base.update(max_train_steps=2, validation_prompt=None, validation_steps=None, checkpointing_steps=None)
        for name, extra in (("tiny SD LoRA r16", {}), ("tiny SD full fine-tune", {"training_type": "full"})):
            raw = dict(base, output_dir=str(Path(tmp) / name.replace(" ", "_")), **extra)
            rows.append((name, measure(raw, args.repeats)))
    print(
        f"median of {args.repeats}; {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}"
    )
    print("| run | checkpoint size (MB) | save (s) | load (s) | resume to first step (s) |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows:
        print(
            f"| {name} | {r['size_mb']:.2f} | {r['save_s']:.3f} | {r['load_s']:.3f} | "
            f"{r['resume_to_first_step_s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
