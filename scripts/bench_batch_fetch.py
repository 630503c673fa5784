"""Benchmark: random-access batch assembly from an `in_memory` dataset vs a `local` one.

Builds one folder of images (see ``bench_staging.write_dataset``; or ``--data DIR``) as a
``local`` and as an ``in_memory`` dataset through the factory (``build_datasets``),
shuffles the samples and cuts them into batches of ``--batch-size``. One pass assembles
every batch once (each file read once per pass), two ways:

- bytes: ``backend.read(sample.path)`` for each sample (storage cost alone);
- decode: ``load_sample_pixels(dataset, sample)``, what the trainer calls (read, decode,
  resize and crop to the bucket). Decoding dominates on small images.

``local`` is measured warm (files in the page cache) and cold: before each cold pass every
file is evicted with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (after a sync). Whether that
worked is measured with ``mincore`` and printed: it may not as non-root, on tmpfs or on some
network file systems, and then "cold" is warm. Inodes and directory entries stay cached
either way. ``in_memory`` never touches the page cache after staging. Each cell is the
median of ``--repeats`` passes. Target: ``in_memory`` >= 3x ``local`` (cold).

    python scripts/bench_batch_fetch.py --num 2000 --repeats 5 --batch-size 8
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import logging
import mmap
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm is imported: no bars in the tables
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_staging import write_dataset  # noqa: E402

from simpletuner.configuration import validate_config  # noqa: E402
from simpletuner.data_backend import RegisteredDataset, build_datasets, load_sample_pixels  # noqa: E402


def build(root: Path, kind: str, resolution: int, compression: str) -> RegisteredDataset:
    entry = {"id": "bench", "type": kind, "instance_data_dir": str(root)}
    if kind == "in_memory":
        entry["in_memory"] = {"compression": compression}
    raw = {
        "pretrained_model_name_or_path": "unused",
        "max_train_steps": 1,
        "resolution": resolution,
        "datasets": [entry],
    }
    (dataset,) = build_datasets(validate_config(raw, check_files=False))
    return dataset


def evict(paths: list[str]) -> None:
    """Ask the kernel to drop the cached pages of ``paths`` (clean pages only: sync first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(paths: list[str]) -> float | None:
    """Fraction of the pages of ``paths`` in the page cache (``mincore``); None if unmeasurable."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if not size:
            continue
        pages = (size + page - 1) // page
        fd = os.open(path, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vector = (ctypes.c_ubyte * pages)()
                if libc.mincore(address, size, vector) != 0:
                    return None
                resident += sum(v & 1 for v in vector)
            finally:
                libc.munmap(address, size)
        finally:
            os.close(fd)
        total += pages
    return resident / total if total else None


def one_pass(dataset: RegisteredDataset, batches: list[list], decode: bool) -> float:
    """Seconds to assemble every batch once."""
    started = time.perf_counter()
    for batch in batches:
        if decode:
            [load_sample_pixels(dataset, sample) for sample in batch]
        else:
            [dataset.backend.read(sample.path) for sample in batch]
    return time.perf_counter() - started


def measure(local, memory, batches, paths: list[str], repeats: int) -> dict:
    """Median seconds per pass for every (fetch, backend, page cache) cell.

    Repeats go round-robin over the cells, so a burst of load from other processes spreads
    over all of them. Each repeat: evict, local cold pass (which warms the files), local
    warm pass, in_memory pass.
    """
    times: dict = {}
    for decode in (False, True):
        one_pass(memory, batches[:4], decode)  # decoder and allocator warm-up, untimed
    for _ in range(repeats):
        for decode in (False, True):
            mode = "decode" if decode else "bytes"
            evict(paths)
            times.setdefault((mode, "local", "cold"), []).append(one_pass(local, batches, decode))
            times.setdefault((mode, "local", "warm"), []).append(one_pass(local, batches, decode))
            times.setdefault((mode, "in_memory", "-"), []).append(one_pass(memory, batches, decode))
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num", type=int, default=2000, help="images to write (default 2000), each with a .txt")
    parser.add_argument("--data", type=Path, help="use this folder instead of writing one")
    parser.add_argument("--repeats", type=int, default=5, help="passes per cell; the median is reported")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per batch (default 8)")
    parser.add_argument("--resolution", type=int, default=128, help="training resolution for decode (default 128)")
    parser.add_argument("--compression", default="none", help="in_memory codec (default none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffled order")
    args = parser.parse_args()
    if args.num < 1 or args.repeats < 1 or args.batch_size < 1:
        raise SystemExit("--num, --repeats and --batch-size must be >= 1")
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="bench_batch_fetch_") as tmp:
        root = args.data or write_dataset(Path(tmp) / "data", args.num)
        local = build(root, "local", args.resolution, args.compression)
        memory = build(root, "in_memory", args.resolution, args.compression)
        samples = list(local.samples)
        random.Random(args.seed).shuffle(samples)
        batches = [samples[i : i + args.batch_size] for i in range(0, len(samples), args.batch_size)]
        paths = [os.path.join(root, s.path) for s in samples]
        total = sum(os.path.getsize(p) for p in paths)
        os.sync()
        one_pass(local, batches, False)
        resident_warm = resident_fraction(paths)
        evict(paths)
        resident_cold = resident_fraction(paths)
        results = measure(local, memory, batches, paths, args.repeats)

    print_tables(args, results, len(batches), len(samples), total, resident_warm, resident_cold)


def print_tables(args, results, num_batches, num_samples, total, resident_warm, resident_cold) -> None:
    def pct(value):
        return "not measurable" if value is None else f"{value:.0%}"

    effective = resident_cold is not None and resident_cold < 0.05
    machine = f"{platform.system()} {platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} CPUs"
    print(
        f"\n{num_samples} images ({total / 1e6:.1f} MB), {num_batches} shuffled batches of {args.batch_size}, "
        f"resolution {args.resolution}, in_memory codec {args.compression}, "
        f"median of {args.repeats} passes (interleaved); {machine}"
    )
    print(
        f"Page cache: {pct(resident_warm)} of the image pages resident when warm, {pct(resident_cold)} right after "
        f"eviction (euid {os.geteuid()}) -> eviction {'effective' if effective else 'NOT effective: cold = warm'}\n"
    )
    print("| fetch | backend | page cache | ms / batch | batches/s | MB/s | in_memory speed-up |")
    print("|---|---|---|---:|---:|---:|---:|")
    for mode in ("bytes", "decode"):
        ours = results[mode, "in_memory", "-"]
        for (m, backend, cache), seconds in results.items():
            if m != mode:
                continue
            speedup = "-" if backend == "in_memory" else f"{seconds / ours:.1f}x"
            print(
                f"| {mode} | {backend} | {cache} | {seconds / num_batches * 1e3:.3f} | {num_batches / seconds:,.0f} | "
                f"{total / 1e6 / seconds:,.0f} | {speedup} |"
            )
    print("\nTarget: in_memory >= 3x local (cold).")
    for mode in ("bytes", "decode"):
        ratio = results[mode, "local", "cold"] / results[mode, "in_memory", "-"]
        print(f"- {mode}: {ratio:.1f}x -> {'met' if ratio >= 3 else 'NOT met'}")


if __name__ == "__main__":
    main()
