"""Benchmark: staging a dataset in RAM (GH200InMemoryBackend) against the raw read speed of `cat`.

Writes ``--num`` real-format images with Pillow (JPEG and PNG, 64-256 px, each with a
caption ``.txt``) to a temp folder, or uses ``--data DIR``. It then measures

- the physical ceiling: every file read with ``cat`` to /dev/null (``xargs -0 -n 256 -P w
  cat``, one row per worker count), and
- for reference, Python ``read_bytes()`` of every file with all results kept: unlike ``cat``
  it must fault in fresh memory for every byte, as staging must;
- staging: ``GH200InMemoryBackend(root, compression=c, num_workers=w)`` per codec and worker
  count, timed around the constructor (listing, stat, read, compress). By default only
  files that compress are compressed (here: captions of 1 KiB or more, so none: they are
  short), so each codec is also run with ``compress_encoded_images`` to show its cost on
  every byte.

Both run warm: the files are read once first, so they are in the OS page cache; this
measures the CPU cost of staging, not the disk. Each cell is the median of ``--repeats``.
Targets: staging with ``none`` >= 80% of the ``cat`` speed at the same worker count;
``lz4`` takes < 20% more time than ``none``.

    python scripts/bench_staging.py --num 2000 --repeats 5 --workers 1,2
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm is imported: no bars in the tables

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from simpletuner.data_backend.in_memory import GH200InMemoryBackend  # noqa: E402

CODECS = ("none", "lz4", "zlib", "snappy")


def write_dataset(folder: Path, num: int, seed: int = 0) -> Path:
    """``num`` images (alternating JPEG / PNG, 64-256 px, smooth gradients + noise) + captions."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for index in range(num):
        width, height = (int(v) for v in rng.integers(64, 257, size=2))
        y, x = np.mgrid[0:height, 0:width]
        base = rng.integers(0, 256, size=3)
        pixels = (base + 0.5 * x[..., None] + 0.3 * y[..., None] + rng.normal(0, 12, (height, width, 3))) % 256
        image = Image.fromarray(pixels.astype(np.uint8))
        name = f"{index:06d}"
        if index % 2:
            image.save(folder / f"{name}.png")
        else:
            image.save(folder / f"{name}.jpg", quality=90)
        (folder / f"{name}.txt").write_text(f"a gradient picture number {index}, {width}x{height} pixels")
    os.sync()  # clean pages, so a later eviction (bench_batch_fetch) can drop them
    return folder


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def cat_seconds(files: list[Path], workers: int) -> float:
    """Seconds for ``xargs cat`` to read every file to /dev/null with ``workers`` processes."""
    listing = b"\0".join(os.fsencode(p) for p in files)
    started = time.perf_counter()
    subprocess.run(
        ["xargs", "-0", "-n", "256", "-P", str(workers), "cat"], input=listing, stdout=subprocess.DEVNULL, check=True
    )
    return time.perf_counter() - started


def python_read_seconds(files: list[Path]) -> float:
    """Seconds to read every file into fresh memory, kept (one thread): staging without the backend."""
    started = time.perf_counter()
    kept = [p.read_bytes() for p in files]
    seconds = time.perf_counter() - started
    del kept
    return seconds


def staging_seconds(root: Path, codec: str, workers: int, images: bool) -> tuple[float, GH200InMemoryBackend]:
    started = time.perf_counter()
    backend = GH200InMemoryBackend(
        root, "bench", compression=codec, num_workers=workers, compress_encoded_images=images
    )
    return time.perf_counter() - started, backend


def staging_run(root: Path, codec: str, workers: int, images: bool) -> tuple[float, float]:
    """Seconds to stage ``root`` once, and the stored/raw ratio."""
    seconds, backend = staging_seconds(root, codec, workers, images)
    return seconds, backend.report.ratio


def interleaved_medians(runs: dict, repeats: int) -> dict:
    """Median result per key of ``runs`` (key -> callable returning seconds or (seconds, extra)).

    Repeats go round-robin over the keys, so a burst of load from other processes spreads
    over every cell instead of landing on one.
    """
    results: dict = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            result = run()
            results[key].append(result if isinstance(result, tuple) else (result, 1.0))
    return {key: (statistics.median(r[0] for r in rs), rs[-1][1]) for key, rs in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num", type=int, default=2000, help="images to write (default 2000), each with a .txt")
    parser.add_argument("--data", type=Path, help="use this folder instead of writing one")
    parser.add_argument("--repeats", type=int, default=5, help="runs per cell; the median is reported")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codecs (default all)")
    args = parser.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    codecs = args.codecs.split(",")
    if args.num < 1 or args.repeats < 1 or min(workers) < 1:
        raise SystemExit("--num, --repeats and --workers must be >= 1")
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory(prefix="bench_staging_") as tmp:
        root = args.data or write_dataset(Path(tmp) / "data", args.num)
        files = all_files(root)
        total = sum(p.stat().st_size for p in files)
        cat_seconds(files, 1)  # warm the page cache
        runs = {("cat", w): functools.partial(cat_seconds, files, w) for w in workers}
        runs["kept"] = functools.partial(python_read_seconds, files)
        for w in workers:
            for c in codecs:
                for images in (False, True) if c != "none" else (False,):
                    runs[c, w, images] = functools.partial(staging_run, root, c, w, images)
        medians = interleaved_medians(runs, args.repeats)
        cat = {w: medians["cat", w][0] for w in workers}
        kept = medians["kept"][0]
        staged = {key: value for key, value in medians.items() if len(key) == 3}

    machine = f"{platform.system()} {platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} CPUs"
    where = root if args.data else "a temp folder"
    print(
        f"\n{len(files)} files ({total / 1e6:.1f} MB; images + captions) under {where}, "
        f"warm page cache, median of {args.repeats} (runs interleaved); {machine}\n"
    )
    print("| method | workers | seconds | MB/s | files/s | stored/raw | speed vs cat |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for w in workers:
        print_row(f"`cat` to /dev/null (xargs -P {w})", w, cat[w], 1.0, total, len(files), "100%")
    print_row(
        "Python read_bytes() of every file, all kept",
        1,
        kept,
        1.0,
        total,
        len(files),
        f"{cat[1] / kept:.0%}" if 1 in cat else "-",
    )
    for w in workers:
        for c in codecs:
            for images in (False, True):
                if (c, w, images) in staged:
                    seconds, ratio = staged[c, w, images]
                    name = f"staging, {c}" + (" + compress_encoded_images" if images else "")
                    print_row(name, w, seconds, ratio, total, len(files), f"{cat[w] / seconds:.0%}")
    print(
        "\nStaging time includes listing the folder (LocalDataBackend.list_files: os.walk + a stat per file); "
        "`cat` is handed the file list and pays one process start per 256 files."
    )
    print("Targets: staging `none` >= 80% of `cat` speed at the same worker count; `lz4` < 1.20x the time of `none`.")
    for w in workers:
        if ("none", w, False) not in staged:
            continue
        none = staged["none", w, False][0]
        share = cat[w] / none
        print(f"- workers {w}: none at {share:.1%} of cat -> {'met' if share >= 0.8 else 'NOT met'}")
        for images in (False, True):
            if ("lz4", w, images) in staged:
                slower = staged["lz4", w, images][0] / none
                what = "lz4 on every file (compress_encoded_images)" if images else "lz4 (captions only)"
                print(
                    f"- workers {w}: {what} takes {slower:.2f}x the time of none -> "
                    f"{'met' if slower < 1.2 else 'NOT met'}"
                )


def print_row(name: str, workers: int, seconds: float, ratio: float, total: int, num_files: int, versus: str) -> None:
    print(
        f"| {name} | {workers} | {seconds:.3f} | {total / 1e6 / seconds:,.0f} | {num_files / seconds:,.0f} | "
        f"{ratio:.3f} | {versus} |"
    )


if __name__ == "__main__":
    main()
