"""Memory estimator: how long an estimate takes, and how close it is to a real CPU step.

Times ``estimate_memory`` (median of --repeats, after one warm-up call that pays the imports)
for the tiny SD model and for an SD1.5-size config-only folder (no weights), and compares the
tiny model's estimated activations with one real training step on CPU measured by the torch
profiler (``measure_cpu_step``, the same measurement as tests/test_memory_estimator.py).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python scripts/bench_estimate.py [--repeats 3]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

#: (label, config overrides, micro-batch) compared against a real CPU step of the tiny model.
TINY_CASES = [
    ("lora fp32", {"mixed_precision": "no"}, 2),
    ("lora bf16", {"mixed_precision": "bf16"}, 2),
    ("lora bf16 + ckpt", {"mixed_precision": "bf16", "gradient_checkpointing": True}, 4),
    ("lora fp32 + ckpt", {"mixed_precision": "no", "gradient_checkpointing": True}, 2),
    ("full fp32", {"training_type": "full", "mixed_precision": "no"}, 8),
]
#: SD1.5-size cases timed (config-only folder, 512 px).
SD15_CASES = [
    ("lora bf16", {"mixed_precision": "bf16"}, 1),
    ("lora bf16 + ckpt", {"mixed_precision": "bf16", "gradient_checkpointing": True}, 4),
    ("full fp32", {"training_type": "full", "mixed_precision": "no"}, 1),
]
SD15_TARGET_S = 60.0
TOLERANCE = 0.10


def _config(model: Path, data: Path, out: Path, resolution: int, alignment: int, **overrides):
    from simpletuner.configuration import validate_config

    raw = {
        "pretrained_model_name_or_path": str(model),
        "output_dir": str(out),
        "datasets": [{"id": "d", "type": "local", "instance_data_dir": str(data)}],
        "max_train_steps": 1,
        "resolution": resolution,
        "aspect_bucket_alignment": alignment,
        **overrides,
    }
    return validate_config(raw)


def _timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--usable-gib", type=float, default=80.0, help="usable device memory for the SD1.5 table (H100: 80)"
    )
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from simpletuner.memory.estimator import GiB, estimate_memory
    from simpletuner.memory.measure import measure_cpu_step
    from simpletuner.testing.config_only import write_sd15_config_only
    from simpletuner.testing.zoo import TINY_SD_ALIGNMENT, TINY_SD_RESOLUTION, write_tiny_sd

    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, repeats {args.repeats}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tiny = write_tiny_sd(tmp / "tiny")
        sd15 = write_sd15_config_only(tmp / "sd15")

        warm_start = time.perf_counter()
        estimate_memory(_config(tiny, tmp, tmp / "out", TINY_SD_RESOLUTION, TINY_SD_ALIGNMENT))
        print(f"first call (imports, warm-up): {time.perf_counter() - warm_start:.2f} s\n")

        print("tiny SD, estimate vs one real CPU step (torch.profiler allocation events), activations in KiB")
        print(f"{'case':<20}{'batch':>6}{'estimate s':>12}{'estimated':>12}{'measured':>12}{'error':>9}")
        worst = 0.0
        for label, overrides, batch in TINY_CASES:
            cfg = _config(tiny, tmp, tmp / "out", TINY_SD_RESOLUTION, TINY_SD_ALIGNMENT, **overrides)
            seconds, est = _timed(lambda c=cfg, b=batch: estimate_memory(c, b, device_kind="cpu"), args.repeats)
            real = measure_cpu_step(cfg, batch)
            error = est.activations / real.activations - 1
            worst = max(worst, abs(error))
            print(
                f"{label:<20}{batch:>6}{seconds:>12.2f}{est.activations / 1024:>12.1f}"
                f"{real.activations / 1024:>12.1f}{error:>+9.1%}"
            )

        print("\nSD1.5-size UNet (config-only folder, no weights), 512 px")
        print(f"{'case':<20}{'batch':>6}{'estimate s':>12}{'activations GiB':>17}{'total GiB':>11}")
        slowest, tables = 0.0, []
        for label, overrides, batch in SD15_CASES:
            cfg = _config(sd15, tmp, tmp / "out", 512, 64, **overrides)
            seconds, est = _timed(lambda c=cfg, b=batch: estimate_memory(c, b), args.repeats)
            slowest = max(slowest, seconds)
            tables.append(est.table(int(args.usable_gib * GiB)))
            print(f"{label:<20}{batch:>6}{seconds:>12.2f}{est.activations / GiB:>17.2f}{est.total / GiB:>11.2f}")
        print()
        for table in tables:
            print(table, end="\n\n")

    ok_time, ok_error = slowest < SD15_TARGET_S, worst <= TOLERANCE
    print(
        f"target: SD1.5 estimate < {SD15_TARGET_S:.0f} s: slowest median {slowest:.2f} s -> "
        f"{'PASS' if ok_time else 'FAIL'}"
    )
    print(
        f"target: tiny model within {TOLERANCE:.0%}: worst activation error {worst:.1%} -> "
        f"{'PASS' if ok_error else 'FAIL'}"
    )
    return 0 if ok_time and ok_error else 1


if __name__ == "__main__":
    sys.exit(main())
