"""Ramp overhead: steps/s of Trainer.train() with the GH200 ramp on vs off at the same accumulation.

"On" is a ramp whose initial and target effective batch are equal and whose ramp length covers
the whole run, so it takes its computing branch every window yet yields the same windows as
"off" (fixed `gradient_accumulation_steps`). Both runs train the same LoRA on the same tiny
SD model from the same warm caches; runs alternate; start-up time is subtracted.

    python scripts/bench_ramp_overhead.py [--steps 40] [--repeats 5] [--batch-size 2] [--accumulation 2]

Target: "on" within 2% of "off".
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


def steps_per_second(raw: dict) -> float:
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    start = time.perf_counter()
    result = trainer.train()
    loop = time.perf_counter() - start - sum(trainer.startup_seconds.values())
    return result.global_step / loop


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    logging.disable(logging.INFO)
    effective = args.batch_size * args.accumulation
    with tempfile.TemporaryDirectory() as tmp:
        base = orjson.loads(write_demo(Path(tmp), num_images=48).read_bytes())
        base.update(
            train_batch_size=args.batch_size,
            max_train_steps=args.steps,
            validation_prompt=None,
            validation_steps=None,
            checkpointing_steps=None,
            logging_steps=args.steps,
        )
        off = {**base, "gradient_accumulation_steps": args.accumulation}
        on = {
            **base,
            "gh200_optimizations": {
                "enable_batch_size_rampup": True,
                "initial_effective_batch_size": effective,
                "target_effective_batch_size": effective,
                "batch_rampup_steps": args.steps * args.accumulation * 2,
            },
        }
        steps_per_second({**off, "max_train_steps": 3})  # fills the caches; not measured
        results: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(args.repeats):
            results["off"].append(steps_per_second(off))
            results["on"].append(steps_per_second(on))
    m_off, m_on = statistics.median(results["off"]), statistics.median(results["on"])
    print(
        f"tiny SD LoRA, batch {args.batch_size} x accumulation {args.accumulation}, {args.steps} steps x "
        f"{args.repeats} runs, median optimizer steps/s (target: on within 2% of off)"
    )
    print("| ramp off (steps/s) | ramp on (steps/s) | on / off | machine |")
    print("|---:|---:|---:|---|")
    print(
        f"| {m_off:.2f} | {m_on:.2f} | {m_on / m_off:.3f} | {platform.system()} {platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} |"
    )
    for name, values in results.items():
        print(f"all runs ({name}):", [f"{x:.2f}" for x in values])
    # The end-to-end runs are noisy on a small machine; the ramp's own cost is one window_for
    # call per optimizer step, which can be timed exactly.
    from simpletuner.gh200.ramp import GH200GradientRamp

    ramp = GH200GradientRamp(args.batch_size, effective * 8, 10**9, args.batch_size)
    calls = 200_000
    start = time.perf_counter()
    for seen in range(calls):
        ramp.window_for(seen)
    per_call = (time.perf_counter() - start) / calls
    print(f"window_for: {per_call * 1e6:.2f} us per optimizer step = {per_call * m_off * 100:.4f}% of a step here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
