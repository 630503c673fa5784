"""Benchmark: the trainer's batch assembly from the caches (``CachedData.iterate``), and the GH200
batch hook alone.

Fills real ``memory`` and ``disk`` caches with ``--num`` SD-1.5-sized entries (fp16 latents
4x64x64, fp16 text embeddings 77x768; ``--captions`` distinct captions), then times
``CachedData.iterate`` (what the training loop calls: read the entries, stack, move to the
device, run ``optimize_batch_for_gh200``) over ``--batches`` micro-batches of ``--batch-size``.
It also times ``optimize_batch_for_gh200`` on one prepared batch where it must be a no-op (no
CUDA here, or hints off). Each cell is the median of ``--repeats`` interleaved runs.

    python scripts/bench_batch_assembly.py --batches 2000 --repeats 7

Run it from another checkout (``PYTHONPATH=/path/to/other python scripts/bench_batch_assembly.py``)
to compare two versions on the same machine.
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
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

from simpletuner.caching import open_caches  # noqa: E402
from simpletuner.data_backend.metadata import Sample  # noqa: E402
from simpletuner.data_backend.sampler import BucketSampler  # noqa: E402
from simpletuner.training.batches import CachedData  # noqa: E402

LATENT = (4, 64, 64)
EMBED = (77, 768)


def build(folder: Path, kind: str, num: int, num_captions: int) -> tuple[CachedData, list[Sample]]:
    samples = [
        Sample(
            key=f"ds/{i}.png",
            dataset_id="ds",
            path=f"{i}.png",
            caption=f"caption {i % num_captions}",
            original_size=(512, 512),
            bucket=(512, 512),
            crop_style="center",
            crop_seed=0,
        )
        for i in range(num)
    ]
    vae, text = open_caches(folder, "sd", None, kind, kind, persistent=True)
    latent_keys = {s.key: f"l{i}" for i, s in enumerate(samples)}
    captions = sorted({s.caption for s in samples})
    text_keys = {c: f"t{i}" for i, c in enumerate(captions)}
    vae.fill(
        [(latent_keys[s.key], i) for i, s in enumerate(samples)],
        lambda ids: [{"latents": torch.randn(LATENT).half()} for _ in ids],
        batch_size=64,
    )
    text.fill(
        [(text_keys[c], c) for c in captions],
        lambda cs: [{"prompt_embeds": torch.randn(EMBED).half()} for _ in cs],
        batch_size=64,
    )
    return CachedData(vae, text, latent_keys, text_keys, {}), samples


def time_iterate(data: CachedData, samples: list[Sample], batch_size: int, num_batches: int) -> float:
    """Seconds per batch over ``num_batches`` batches of ``CachedData.iterate``."""
    batches = data.iterate(BucketSampler(samples, batch_size, seed=0), torch.device("cpu"))
    next(batches)  # generator start-up, untimed
    start = time.perf_counter()
    for _ in range(num_batches):
        next(batches)
    return (time.perf_counter() - start) / num_batches


def time_hook(data: CachedData, samples: list[Sample], batch_size: int, calls: int) -> float | None:
    """Seconds per ``optimize_batch_for_gh200`` call on one prepared batch (None: this version has no hook)."""
    from simpletuner.gh200 import uvm

    batch = data.batch(samples[:batch_size], torch.device("cpu"))
    fields = {"latents": batch.latents, "conditioning": batch.conditioning}
    try:
        uvm.optimize_batch_for_gh200(fields, torch.device("cpu"))
    except (TypeError, AttributeError):
        return None
    start = time.perf_counter()
    for _ in range(calls):
        uvm.optimize_batch_for_gh200(fields, torch.device("cpu"))
    return (time.perf_counter() - start) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num", type=int, default=512, help="cached samples (default 512)")
    parser.add_argument("--captions", type=int, default=64, help="distinct captions (default 64)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=2000, help="batches per timed run (default 2000)")
    parser.add_argument("--repeats", type=int, default=7, help="runs per cell; the median is reported")
    parser.add_argument("--kinds", default="memory,disk", help="cache types to measure (default memory,disk)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    kinds = args.kinds.split(",")
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    hook: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench_batch_assembly_") as tmp:
        built = {kind: build(Path(tmp) / kind, kind, args.num, args.captions) for kind in kinds}
        for _ in range(args.repeats):
            for kind in kinds:
                times[kind].append(time_iterate(*built[kind], args.batch_size, args.batches))
            per_call = time_hook(*built[kinds[0]], args.batch_size, 20000)
            if per_call is not None:
                hook.append(per_call)
    import simpletuner

    print(
        f"{args.num} samples, {args.captions} captions, batch {args.batch_size}, {args.batches} batches x "
        f"{args.repeats} runs (median); {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; code: "
        f"{Path(simpletuner.__file__).resolve().parents[1]}"
    )
    print("| cache type | ms / batch (CachedData.iterate) | all runs |")
    print("|---|---:|---|")
    for kind in kinds:
        print(
            f"| {kind} | {statistics.median(times[kind]) * 1e3:.4f} | "
            f"{', '.join(f'{t * 1e3:.4f}' for t in times[kind])} |"
        )
    if hook:
        print(f"optimize_batch_for_gh200 without CUDA: {statistics.median(hook) * 1e6:.2f} us / call (median)")
    else:
        print("optimize_batch_for_gh200 is not on this version's batch path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
