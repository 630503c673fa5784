"""Benchmark: reading cached latents, one torch.save file per sample vs ShardedTensorStore.

Builds ``--num`` fake SD-1.5 latents at 512 px (fp16, 4x64x64) in a temp folder twice:
(a) one ``torch.save`` file per sample, the common layout, and (b) a ShardedTensorStore
filled through ``TensorCache.fill``. It then reads every latent in shuffled batches of
``--batch-size`` (the same order for both): (a) ``torch.load(path, weights_only=True)``
per sample + ``torch.stack``, (b) ``TensorCache.get_batch``. Each pass is repeated
``--repeats`` times and the median latents/second is reported as a markdown table row.

Both layouts are measured warm: the files were just written, so they sit in the OS page
cache (it cannot be dropped without root). Cold reads from disk favour the sharded
store further (fewer, larger files), so this understates its advantage, if anything.

    python scripts/bench_cache_read.py --num 2000 --repeats 5
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from simpletuner.caching import ShardedTensorStore, TensorCache

LATENT_SHAPE = (4, 64, 64)


def make_latent(index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(index)
    return torch.randn(LATENT_SHAPE, generator=generator).half()


def build_per_file(folder: Path, num: int) -> list[Path]:
    folder.mkdir(parents=True)
    paths = []
    for index in range(num):
        path = folder / f"{index:06d}.pt"
        torch.save(make_latent(index), path)
        paths.append(path)
    return paths


def build_store(folder: Path, num: int) -> tuple[TensorCache, list[str]]:
    cache = TensorCache(ShardedTensorStore(folder), "bench")
    keys = [f"sample{index:06d}" for index in range(num)]
    items = list(zip(keys, range(num)))
    cache.fill(items, lambda indices: [{"latent": make_latent(i)} for i in indices], batch_size=8, desc="store")
    return cache, keys


def batches_of(sequence: list, size: int) -> list[list]:
    return [sequence[start : start + size] for start in range(0, len(sequence), size)]


def time_pass(read_batch, batches: list[list]) -> float:
    """Latents per second for one pass over ``batches``."""
    started = time.perf_counter()
    num_read = 0
    for batch in batches:
        num_read += read_batch(batch).shape[0]
    return num_read / (time.perf_counter() - started)


def median_rate(read_batch, batches: list[list], repeats: int) -> float:
    time_pass(read_batch, batches[: max(1, len(batches) // 10)])  # warm handles and allocator
    return statistics.median(time_pass(read_batch, batches) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num", type=int, default=2000, help="number of latents (default 2000)")
    parser.add_argument("--repeats", type=int, default=5, help="passes per method; the median is reported")
    parser.add_argument("--batch-size", type=int, default=8, help="latents per read batch (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffled read order")
    args = parser.parse_args()
    if args.num < 1 or args.repeats < 1 or args.batch_size < 1:
        raise SystemExit("--num, --repeats and --batch-size must be >= 1")
    logging.basicConfig(level=logging.WARNING)

    order = list(range(args.num))
    random.Random(args.seed).shuffle(order)
    with tempfile.TemporaryDirectory(prefix="bench_cache_read_") as tmp:
        tmp_path = Path(tmp)
        paths = build_per_file(tmp_path / "per_file", args.num)
        cache, keys = build_store(tmp_path / "sharded", args.num)

        # Same shuffled order for both, and a correctness check before timing.
        sample = order[: args.batch_size]
        from_files = torch.stack([torch.load(paths[i], weights_only=True) for i in sample])
        from_store = cache.get_batch([keys[i] for i in sample])["latent"]
        if not torch.equal(from_files, from_store):
            raise SystemExit("the two layouts returned different latents")

        file_batches = batches_of([paths[i] for i in order], args.batch_size)
        key_batches = batches_of([keys[i] for i in order], args.batch_size)
        per_file_rate = median_rate(
            lambda batch: torch.stack([torch.load(path, weights_only=True) for path in batch]),
            file_batches,
            args.repeats,
        )
        sharded_rate = median_rate(lambda batch: cache.get_batch(batch)["latent"], key_batches, args.repeats)
        num_shards = len(cache.store.shard_paths())

    machine = (
        f"{platform.system()} {platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
    print(
        f"\n{args.num} latents fp16 {'x'.join(map(str, LATENT_SHAPE))}, batches of {args.batch_size}, "
        f"shuffled, median of {args.repeats} warm passes; store used {num_shards} shards\n"
    )
    print("| latents | torch.load per file (latents/s) | ShardedTensorStore get_batch (latents/s) | ratio | machine |")
    print("|---:|---:|---:|---:|---|")
    print(
        f"| {args.num} | {per_file_rate:,.0f} | {sharded_rate:,.0f} | {sharded_rate / per_file_rate:.1f}x | {machine} |"
    )


if __name__ == "__main__":
    main()
