"""Benchmark: the dataset metadata scan on a large folder of tiny images (issue 17, "a million files").

Writes ``--num-files`` synthetic tiny images (PNG and JPEG, baseline and progressive, some with an
EXIF orientation, six sizes and aspects; 1,000 per folder, two folder levels; a ``.txt`` caption
next to every third image) into ``--folder`` (reused when it already holds that many), reads every
file once to warm the page cache, then times ``--repeats`` interleaved runs of:

* ``listing``: ``LocalDataBackend.list_files(IMAGE_EXTENSIONS)`` (``os.scandir``);
* ``listing (old)``: the listing as it was before issue 17 (``os.walk`` + ``Path`` + ``is_file``
  per file), kept in this script as the baseline;
* ``listing + headers``: the listing, then every image's size through ``image_size_reader`` (what
  the scan calls: a 64 KiB first read, the PNG/JPEG header parser, Pillow for the rest);
* ``listing + headers (old)``: the old listing, then every size the way it was read before issue 17
  (``isinstance`` check and ``PurePosixPath`` per file, one 256 KiB ``Path.open().read()``,
  ``PIL.Image.open``), kept in this script as the baseline;
* ``scan``: ``build_metadata`` as the trainer calls it (listing, captions, header reads, buckets,
  crop seeds, ``Sample`` objects);
* ``scan (PIL headers)``: the same with every header read by Pillow (today's listing and
  ``Sample``: it isolates the header parser's share).

and reports the median files/s of each. Memory: ``tracemalloc`` of what one ``build_metadata``
result keeps (retained bytes per image) and its peak while scanning, and the resident set growth
(RSS, ``/proc/self/statm``) of the first scan in a fresh process, per image.

    python scripts/bench_scan.py --num-files 100000 --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import io
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path, PurePosixPath

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

from PIL import Image  # noqa: E402

from simpletuner.configuration import validate_config  # noqa: E402
from simpletuner.data_backend import IMAGE_EXTENSIONS, LocalDataBackend, build_metadata  # noqa: E402
from simpletuner.data_backend import images as images_module  # noqa: E402
from simpletuner.data_backend.base import SupportsReadHead  # noqa: E402
from simpletuner.data_backend.images import image_size_reader  # noqa: E402

SIZES = [(64, 64), (96, 64), (64, 96), (128, 72), (72, 128), (80, 80)]
PER_FOLDER = 1000
MARKER = ".bench_scan_complete"


def templates() -> list[tuple[str, bytes]]:
    """(extension, bytes) of the tiny images the folder cycles through."""
    out = []
    for i, size in enumerate(SIZES):
        image = Image.new("RGB", size, (i * 40 % 256, 90, 200))
        for fmt, ext, kwargs in (
            ("PNG", ".png", {}),
            ("JPEG", ".jpg", {"quality": 80}),
            ("JPEG", ".jpeg", {"quality": 80, "progressive": True}),
        ):
            buffer = io.BytesIO()
            if fmt == "JPEG" and i % 2:
                exif = Image.Exif()
                exif[0x0112] = 6  # rotated: width and height swap
                kwargs = {**kwargs, "exif": exif.tobytes()}
            image.save(buffer, fmt, **kwargs)
            out.append((ext, buffer.getvalue()))
    return out


def write_folder(folder: Path, num_files: int) -> None:
    marker = folder / MARKER
    if marker.exists() and marker.read_text().strip() == str(num_files):
        print(f"reusing {folder} ({num_files} images)")
        return
    if folder.exists() and any(folder.iterdir()):
        raise SystemExit(f"{folder} exists and does not hold a complete bench folder of {num_files}; remove it")
    start = time.perf_counter()
    kinds = templates()
    for i in range(num_files):
        sub = folder / f"a{i // (PER_FOLDER * 10):03d}" / f"b{(i // PER_FOLDER) % 10}"
        if i % PER_FOLDER == 0:
            sub.mkdir(parents=True, exist_ok=True)
        ext, data = kinds[i % len(kinds)]
        (sub / f"img_{i:07d}{ext}").write_bytes(data)
        if i % 3 == 0:
            (sub / f"img_{i:07d}.txt").write_text(f"a tiny picture number {i % 97}\n", encoding="utf-8")
    marker.write_text(str(num_files))
    print(f"wrote {num_files} images under {folder} in {time.perf_counter() - start:.1f} s")


def warm(folder: Path) -> None:
    """Read every file once so the runs below see a warm page cache."""
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as handle:
                handle.read()


def old_list_files(root: Path, extensions) -> list[str]:
    """``LocalDataBackend.list_files`` as it was before issue 17 (the listing baseline)."""
    wanted = frozenset(extensions)
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        base = Path(dirpath)
        for name in filenames:
            if name.startswith("."):
                continue
            if os.path.splitext(name)[1].lower() not in wanted:
                continue
            full = base / name
            if not full.is_file():
                continue
            found.append(full.relative_to(root).as_posix())
    found.sort()
    return found


def scan_config(folder: Path):
    raw = {
        "pretrained_model_name_or_path": "unused",
        "max_train_steps": 1,
        "resolution": 64,
        "aspect_bucket_alignment": 16,
        "datasets": [{"id": "bench", "type": "local", "instance_data_dir": str(folder)}],
    }
    config = validate_config(raw, check_files=False)
    return config, config.datasets[0]


def pil_size_reader(backend):
    """The header read as it was before issue 17: Pillow opens every header."""

    def size_of(path):
        head = backend.read_head(path, images_module.HEADER_BYTES)
        try:
            return images_module.read_image_size_pil(head)
        except ValueError:
            if len(head) < images_module.HEADER_BYTES:
                raise
        return images_module.read_image_size_pil(backend.read(path))

    return size_of


def old_image_size_of(backend, root: Path, path: str):
    """``image_size_of`` as it was before issue 17 (the header-scan baseline)."""
    if isinstance(backend, SupportsReadHead) and PurePosixPath(path).suffix.lower() in {".jpg", ".jpeg", ".png"}:
        with root.joinpath(*PurePosixPath(path).parts).open("rb") as handle:
            head = handle.read(images_module.HEADER_BYTES)
        try:
            return images_module.read_image_size_pil(head)
        except ValueError:
            if len(head) < images_module.HEADER_BYTES:
                raise
    return images_module.read_image_size_pil(backend.read(path))


def headers(backend) -> int:
    size_of = image_size_reader(backend)
    return sum(1 for path in backend.list_files(IMAGE_EXTENSIONS) if size_of(path))


def old_headers(backend, root: Path) -> int:
    return sum(1 for path in old_list_files(root, IMAGE_EXTENSIONS) if old_image_size_of(backend, root, path))


def run_scan(folder: Path, pil: bool = False):
    config, cfg = scan_config(folder)
    backend = LocalDataBackend(folder, "bench")
    if not pil:
        return build_metadata(backend, cfg, config, seed=0)
    import simpletuner.data_backend.metadata as metadata_module

    saved = metadata_module.image_size_reader
    metadata_module.image_size_reader = pil_size_reader
    try:
        return build_metadata(backend, cfg, config, seed=0)
    finally:
        metadata_module.image_size_reader = saved


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_child(folder: Path) -> None:
    """Run in a fresh process: RSS growth of one scan whose result is kept."""
    gc.collect()
    before = rss_bytes()
    meta = run_scan(folder)
    gc.collect()
    after = rss_bytes()
    print(f"{after - before} {len(meta.samples)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-files", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=None, help="default: /tmp/simpletuner-bench-scan-<N>")
    parser.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    folder = args.folder or Path(f"/tmp/simpletuner-bench-scan-{args.num_files}")
    if args.rss_child:
        rss_child(folder)
        return
    write_folder(folder, args.num_files)
    warm(folder)
    num = args.num_files

    print(
        f"python {platform.python_version()}, {os.cpu_count()} cores, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, folder {folder}"
    )
    backend = LocalDataBackend(folder, "bench")
    assert backend.list_files(IMAGE_EXTENSIONS) == old_list_files(folder, IMAGE_EXTENSIONS)
    new, old = run_scan(folder), run_scan(folder, pil=True)
    assert new.samples == old.samples and new.bad_files == old.bad_files, "header parser and Pillow disagree"
    assert headers(backend) == old_headers(backend, folder) == num
    del new, old

    cases = {
        "listing": lambda: backend.list_files(IMAGE_EXTENSIONS),
        "listing (old)": lambda: old_list_files(folder, IMAGE_EXTENSIONS),
        "listing + headers": lambda: headers(backend),
        "listing + headers (old)": lambda: old_headers(backend, folder),
        "scan": lambda: run_scan(folder),
        "scan (PIL headers)": lambda: run_scan(folder, pil=True),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            gc.collect()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)

    print(f"\n{num} images, median of {args.repeats} runs (warm page cache)")
    print(f"{'case':<26} {'median s':>9} {'files/s':>10}   runs (s)")
    for name, values in times.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name:<26} {median:>9.2f} {num / median:>10.0f}   {runs}")

    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    meta = run_scan(folder)
    gc.collect()
    retained, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    samples = len(meta.samples)
    child = subprocess.run(
        [sys.executable, __file__, "--rss-child", "--num-files", str(num), "--folder", str(folder)],
        capture_output=True,
        text=True,
        check=True,
    )
    rss_delta, rss_samples = (int(x) for x in child.stdout.split()[-2:])
    print(f"\nmemory ({samples} samples)")
    print(f"{'tracemalloc retained':<26} {(retained - base) / samples:>9.0f} bytes/image")
    print(f"{'tracemalloc peak':<26} {(peak - base) / samples:>9.0f} bytes/image")
    print(f"{'RSS growth (fresh proc)':<26} {rss_delta / rss_samples:>9.0f} bytes/image")


if __name__ == "__main__":
    main()
