"""A dataset staged whole in CPU RAM at start-up (GH200 / GB10: no disk I/O while training).

``GH200InMemoryBackend`` lists the folder with ``LocalDataBackend`` (an object store URL with
``ObjectStoreBackend``), reads every file once on ``num_workers`` threads and keeps the bytes in a
table that never changes afterwards, so any number of threads may read at once. Encoded images
(JPEG/PNG/WebP) and clips (MP4/WebM/MOV/MKV/GIF) are kept as they are (re-compressing them gains
~0%); other files (captions, raw arrays) are stored with the chosen codec unless they are tiny or it
would not make them smaller. It answers every question as ``LocalDataBackend``
(``ObjectStoreBackend``) would for the folder (the objects) as it was when staged.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple, Sequence

from tqdm.auto import tqdm

from simpletuner.configuration.dataset_sections import url_protocol
from simpletuner.data_backend.base import (
    ANIMATED_IMAGE_EXTENSIONS,
    ENCODED_MEDIA_EXTENSIONS,
    IMAGE_EXTENSIONS,
    VIDEO_FILE_EXTENSIONS,
    normalize_extensions,
)
from simpletuner.data_backend.codecs import Codec, get_codec
from simpletuner.data_backend.local import LocalDataBackend
from simpletuner.faults import fault_point

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

logger = logging.getLogger(__name__)

#: Upper bound of the default loader thread count (a Grace CPU has 72 cores).
MAX_DEFAULT_WORKERS = 72
#: Files smaller than this are stored as-is: a codec would save at most a few hundred bytes
#: (about the bookkeeping of one entry) and each call hands the GIL to another loader thread.
MIN_COMPRESS_BYTES = 1024
#: Unreadable files named in a warning or error.
NUM_FAILED_SHOWN = 5
_GB = 10**9
_MB = 10**6
_AS_IS = get_codec("none")


def default_num_workers() -> int:
    """``min(72, os.cpu_count())``: loader threads when ``num_workers`` is not set."""
    return min(MAX_DEFAULT_WORKERS, os.cpu_count() or 1)


class _Entry(NamedTuple):
    """One staged file: its stored bytes, the codec that stored them, its size, and its identity when read
    (``"{size}:{mtime_ns}"`` from disk, ``"{size}:{etag}"`` from an object store)."""

    data: bytes
    codec: Codec
    size: int
    identity: str


@dataclass(frozen=True)
class StagingReport:
    """What staging did: files and bytes held, time taken, and the files it could not read.

    ``files`` counts staged files (unreadable ones excluded), ``images`` and ``clips`` those that
    are training media (the rest: captions and other files); ``raw_bytes`` is their content
    size, ``stored_bytes`` what is held in RAM; ``failed`` lists ``(path, reason)``.
    """

    files: int
    raw_bytes: int
    stored_bytes: int
    seconds: float
    workers: int
    codec: str
    failed: tuple[tuple[str, str], ...] = ()
    images: int | None = None  # None: not counted (every file is reported as a file)
    clips: int = 0

    @property
    def ratio(self) -> float:
        """``stored_bytes / raw_bytes`` (1.0 for an empty dataset)."""
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0

    @property
    def mb_per_s(self) -> float:
        """Raw megabytes (10**6 bytes) staged per second."""
        return self.raw_bytes / _MB / self.seconds if self.seconds > 0 else float("inf")

    def summary(self, dataset_id: str) -> str:
        """One log line: ``staged dataset 'x': 600 images (+600 captions and other files), 512.0 MB -> 498.3 MB
        (ratio 0.97, lz4) in 2.1 s, 244 MB/s, 8 workers`` (KB and KB/s for small sets)."""
        line = (
            f"staged dataset {dataset_id!r}: {self._counts()}, {_amount(self.raw_bytes)} -> "
            f"{_amount(self.stored_bytes)} (ratio {self.ratio:.2f}, {self.codec}) in {self.seconds:.1f} s, "
            f"{_rate(self.raw_bytes, self.seconds)}, {self.workers} workers"
        )
        if self.failed:
            line += f"; {len(self.failed)} unreadable file(s) left out"
        return line

    def _counts(self) -> str:
        if self.images is None:
            return f"{self.files} files"
        media = [f"{self.images} images"] if self.images or not self.clips else []
        media += [f"{self.clips} clips"] if self.clips else []
        other = self.files - self.images - self.clips
        return " and ".join(media) + (f" (+{other} captions and other files)" if other else "")


def _amount(nbytes: float) -> str:
    """Bytes as MB (10**6) with one decimal, or as KB (10**3) below 1 MB, where "0.1 MB" and "0 MB/s" say little."""
    return f"{nbytes / _MB:.1f} MB" if nbytes >= _MB else f"{nbytes / 1000:.0f} KB"


def _rate(nbytes: int, seconds: float) -> str:
    """``269 MB/s``; ``2.5 MB/s`` below 10 MB/s; ``330 KB/s`` below 1 MB/s."""
    per_s = nbytes / seconds if seconds > 0 else 0.0
    if per_s >= 10 * _MB:
        return f"{per_s / _MB:.0f} MB/s"
    return f"{per_s / _MB:.1f} MB/s" if per_s >= _MB else f"{per_s / 1000:.0f} KB/s"


def _media_counts(paths: Iterable[str]) -> tuple[int, int]:
    """``(images, clips)`` among ``paths`` by extension (an animated GIF / WebP counts as an image here)."""
    suffixes = [os.path.splitext(p)[1].lower() for p in paths]
    images = sum(s in IMAGE_EXTENSIONS or s in ANIMATED_IMAGE_EXTENSIONS for s in suffixes)
    return images, sum(s in VIDEO_FILE_EXTENSIONS for s in suffixes)


def _read_file(full: str) -> tuple[bytes, os.stat_result]:
    """The bytes of ``full`` and the stat of the open file (so the identity matches the bytes).

    ``os.open``/``os.read`` rather than ``open()``: no buffer objects, ~30% faster on small
    files. The content is the file's first ``st_size`` bytes at the ``fstat``, matching the
    identity; only files that report size 0 (procfs, some FUSE) or read short are read to EOF.
    """
    fd = os.open(full, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        data = os.read(fd, st.st_size) if st.st_size else b""
        if len(data) < st.st_size or not st.st_size:
            data += _read_rest(fd)
        return data, st
    finally:
        os.close(fd)


def _read_rest(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 24):
        chunks.append(chunk)
    return b"".join(chunks)


def _reason(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "no such file (removed while staging)"
    return exc.strerror or str(exc) or type(exc).__name__


def _gb(num_bytes: int | float) -> str:
    return f"{num_bytes / _GB:.3g} GB"


def _parallel_map(fn: Callable[[Any], Any], items: Sequence, num_workers: int, on_done: Callable[[list], None]) -> list:
    """``[fn(item) for item in items]`` computed on ``num_workers`` threads, in item order.

    Each thread claims the next chunk of items from a shared cursor until none is left. (One
    ``submit`` per item would not do: ThreadPoolExecutor reuses an idle thread rather than
    start a new one, so fast items leave most of the pool unstarted.) ``on_done(results)``
    runs under a lock after every chunk; an exception from it or ``fn`` stops every thread
    and is raised here.
    """
    num_threads = max(1, min(num_workers, len(items)))
    chunk = max(1, min(64, len(items) // (num_threads * 8)))
    results: list = [None] * len(items)
    cursor = itertools.count(0, chunk)
    lock = threading.Lock()
    stop = threading.Event()

    def work() -> None:
        try:
            while not stop.is_set():
                with lock:
                    start = next(cursor)
                if start >= len(items):
                    return
                done = [fn(item) for item in items[start : start + chunk]]
                results[start : start + len(done)] = done
                with lock:
                    on_done(done)
        except BaseException:
            stop.set()
            raise

    with ThreadPoolExecutor(num_threads, thread_name_prefix="stage") as pool:
        futures = [pool.submit(work) for _ in range(num_threads)]
        try:
            for future in futures:
                future.result()
        finally:
            stop.set()
    return results


class GH200InMemoryBackend:
    """Every file under ``root`` (or of ``source``, an ``ObjectStoreBackend``) held in RAM, staged in the
    constructor, addressed by relative POSIX path like ``LocalDataBackend``.

    Unreadable files are left out and listed in ``report.failed``; ``identity`` is ``"{size}:{mtime_ns}"`` as
    read, so caches agree with a ``local`` run. ``compression``: lz4, zlib, snappy or none; ``memory_limit_gb``
    (10**9 bytes) is checked before any read and against the compressed size while staging.

    Raises ValueError (not a folder, an unknown codec, over the memory limit, ``max_bad_image_fraction``
    unreadable) or ImportError (the codec's library is missing).
    """

    def __init__(
        self,
        root: str | Path,
        id: str,
        *,
        compression: str = "none",
        compress_encoded_images: bool = False,
        num_workers: int | None = None,
        memory_limit_gb: float | None = None,
        max_bad_image_fraction: float = 0.05,
        source: Any = None,
    ):
        self._source = source  # an ObjectStoreBackend, or None: the folder `root` on disk
        self._local = LocalDataBackend(root, id) if source is None else None
        self.root = self._local.root if self._local is not None else source.root
        self.id = id
        self.codec = get_codec(compression)
        self.compress_encoded_images = compress_encoded_images
        self.num_workers = default_num_workers() if num_workers is None else num_workers
        if self.num_workers < 1:
            raise ValueError(f"dataset {id!r}: num_workers must be at least 1, got {num_workers}")
        self.memory_limit_gb = memory_limit_gb
        self.max_bad_image_fraction = max_bad_image_fraction
        self._root_str = str(self.root)
        self._entries, self.report = self._stage()
        self._paths = tuple(self._entries)
        self._failed = dict(self.report.failed)

    def __repr__(self) -> str:
        return f"GH200InMemoryBackend(id={self.id!r}, root={str(self.root)!r}, files={len(self._paths)})"

    # --- staging ---
    def _codec_for(self, path: str) -> Codec:
        if not self.compress_encoded_images and os.path.splitext(path)[1].lower() in ENCODED_MEDIA_EXTENSIONS:
            return _AS_IS
        return self.codec

    def _stage(self) -> tuple[MappingProxyType, StagingReport]:
        started = time.perf_counter()
        paths = (self._local or self._source).list_files()
        to_load = paths
        failed: list[tuple[str, str]] = []
        if self.memory_limit_gb is not None:  # the estimate needs sizes; a stat per file otherwise saved
            sizes, failed = self._stat_all(paths)
            self._check_estimate(sizes, self.memory_limit_gb)
            to_load = list(sizes)
        entries, read_failed = self._load_all(to_load)
        failed = sorted(failed + read_failed)
        self._check_failures(len(paths), failed)
        images, clips = _media_counts(entries)
        report = StagingReport(
            files=len(entries),
            images=images,
            clips=clips,
            raw_bytes=sum(e.size for e in entries.values()),
            stored_bytes=sum(len(e.data) for e in entries.values()),
            seconds=time.perf_counter() - started,
            workers=self.num_workers,
            codec=self.codec.name,
            failed=tuple(failed),
        )
        logger.info(report.summary(self.id))
        return MappingProxyType(entries), report

    def _full(self, path: str) -> str:
        """The file system path of a listed ``path`` (already known to be inside the root)."""
        return os.path.join(self._root_str, path)

    def _stat_all(self, paths: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
        """Sizes on disk of ``paths`` (in order) and the files that could not be stat'ed."""

        def stat_one(path: str) -> int | str:
            try:
                if self._source is not None:
                    return self._source.size(path)  # from its listing: no request
                return os.stat(self._full(path)).st_size
            except OSError as exc:
                return _reason(exc)

        results = _parallel_map(stat_one, paths, self.num_workers, on_done=lambda _: None)
        sizes = {p: r for p, r in zip(paths, results) if isinstance(r, int)}
        return sizes, [(p, r) for p, r in zip(paths, results) if isinstance(r, str)]

    def _check_estimate(self, sizes: dict[str, int], limit_gb: float) -> None:
        """Raise before any read when the bytes to hold certainly exceed ``limit_gb`` (``memory_limit_gb``)."""
        limit = limit_gb * _GB
        total = sum(sizes.values())
        if total <= limit:
            return
        as_is = sum(n for p, n in sizes.items() if self._codec_for(p).name == "none")
        if as_is > limit or as_is == total:
            raise ValueError(
                f"dataset {self.id!r}: staging {len(sizes)} files under {self.root} needs an estimated "
                f"{_gb(total)} of RAM ({_gb(as_is)} of it kept uncompressed), more than "
                f"in_memory.memory_limit_gb={self.memory_limit_gb} ({_gb(limit)}). Raise `in_memory.memory_limit_gb`, "
                "set `in_memory.compression` to lz4, zlib or snappy (shrinks captions and raw formats; JPEG/PNG/WebP "
                'stay as they are unless `compress_encoded_images`), or use type "local" to read from disk'
            )
        logger.info(
            "dataset %r: %s on disk exceeds memory_limit_gb=%s before compression; "
            "checking the compressed size while staging",
            self.id,
            _gb(total),
            self.memory_limit_gb,
        )

    def _load_all(self, paths: list[str]) -> tuple[dict[str, _Entry], list[tuple[str, str]]]:
        """Read and store every file of ``paths`` on the loader threads, with a progress bar."""
        limit = None if self.memory_limit_gb is None else self.memory_limit_gb * _GB
        totals = {"stored": 0, "files": 0}
        with tqdm(total=len(paths), desc=f"staging {self.id}", unit="file", disable=None) as bar:

            def on_done(done: list[tuple[str, _Entry | str]]) -> None:
                bar.update(len(done))
                totals["files"] += len(done)
                totals["stored"] += sum(len(e.data) for _, e in done if isinstance(e, _Entry))
                if limit is not None and totals["stored"] > limit:
                    raise ValueError(self._over_limit_after_compression(totals["files"], len(paths)))

            results = _parallel_map(self._load_one, paths, self.num_workers, on_done)
        entries = {p: e for p, e in results if isinstance(e, _Entry)}
        return entries, [(p, e) for p, e in results if isinstance(e, str)]

    def _load_one(self, path: str) -> tuple[str, _Entry | str]:
        """``(path, entry)``, or ``(path, reason)`` when the file cannot be read."""
        fault_point("staging:file")  # tests: a signal while the loader threads read
        try:
            if self._source is not None:
                data = self._source.read(path)  # whole (after its retries) or an error, never part
                identity = self._source.identity(path)
            else:
                data, st = _read_file(self._full(path))
                identity = f"{len(data)}:{st.st_mtime_ns}"
        except OSError as exc:
            return path, _reason(exc)
        codec = self._codec_for(path) if len(data) >= MIN_COMPRESS_BYTES else _AS_IS
        stored = codec.compress(data)
        if len(stored) >= len(data):  # did not compress (e.g. an encoded image): keep as-is
            codec, stored = _AS_IS, data
        return path, _Entry(stored, codec, len(data), identity)

    def _over_limit_after_compression(self, num_done: int, num_files: int) -> str:
        return (
            f"dataset {self.id!r}: the staged bytes passed in_memory.memory_limit_gb={self.memory_limit_gb} "
            f"after {num_done} of {num_files} files, even compressed with {self.codec.name}. "
            'Raise `in_memory.memory_limit_gb` or use type "local" to read from disk'
        )

    def _check_failures(self, total: int, failed: list[tuple[str, str]]) -> None:
        """Raise when too many files were unreadable; otherwise warn about the ones left out."""
        if not failed:
            return
        fraction = len(failed) / total
        limit = self.max_bad_image_fraction
        if fraction > limit:
            listed = "\n".join(f"  - {path}: {reason}" for path, reason in failed[:NUM_FAILED_SHOWN])
            raise ValueError(
                f"dataset {self.id!r}: {len(failed)} of {total} files under {self.root} could not be read while "
                f"staging ({fraction:.1%}), more than max_bad_image_fraction={limit} ({limit:.1%}). "
                f"First {min(len(failed), NUM_FAILED_SHOWN)}:\n{listed}\n"
                "Fix their permissions or remove them, or raise `max_bad_image_fraction` to skip them."
            )
        shown = ", ".join(f"{path} ({reason})" for path, reason in failed[:3])
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        logger.warning(
            "dataset %r: %d of %d file(s) could not be read while staging and are left out: %s%s",
            self.id,
            len(failed),
            total,
            shown,
            more,
        )

    # --- the DataBackend protocol ---
    def _entry(self, path: str) -> _Entry:
        entry = self._entries.get(path)
        if entry is not None:
            return entry
        # The same refusal of paths leaving the root as local; then the canonical key.
        entry = self._entries.get(self._canonical(path))
        if entry is None:
            if path in self._failed:
                why = f"unreadable when staged: {self._failed[path]}"
            else:
                why = f"not among the {len(self._paths)} files staged from {self.root}"
            raise FileNotFoundError(f"dataset {self.id!r}: no file {path!r} ({why})")
        return entry

    def _canonical(self, path: str) -> str:
        if self._local is not None:
            return self._local._resolve(path).relative_to(self.root).as_posix()
        return self._source._key(path)

    def list_files(self, extensions: Iterable[str] | None = None) -> list[str]:
        """Relative POSIX paths of all staged files (recursive, sorted, hidden skipped)."""
        wanted = normalize_extensions(extensions)
        if wanted is None:
            return list(self._paths)
        return [p for p in self._paths if os.path.splitext(p)[1].lower() in wanted]

    def read(self, path: str) -> bytes:
        """The bytes of ``path``; FileNotFoundError naming it when it was not staged."""
        entry = self._entry(path)
        return entry.codec.decompress(entry.data)

    def read_head(self, path: str, num_bytes: int) -> bytes:
        """Up to ``num_bytes`` bytes from the start of ``path`` (for header parsing)."""
        data = self.read(path)
        return data if num_bytes < 0 else data[:num_bytes]

    def read_tail(self, path: str, num_bytes: int) -> bytes:
        """Up to ``num_bytes`` bytes from the end of ``path`` (the scan's cut-off check)."""
        return self.read(path)[-num_bytes:] if num_bytes > 0 else b""

    def exists(self, path: str) -> bool:
        """Whether ``path`` is a staged file."""
        if path in self._entries:
            return True
        return self._canonical(path) in self._entries

    def size(self, path: str) -> int:
        """Size of ``path`` in bytes (its content, not what is stored)."""
        return self._entry(path).size

    def identity(self, path: str) -> str:
        """``"{size}:{mtime_ns}"`` of the file when it was staged (as ``LocalDataBackend`` gives); from an object
        store its ``"{size}:{etag}"`` (as ``ObjectStoreBackend`` gives)."""
        return self._entry(path).identity

    def failed_files(self) -> dict[str, str]:
        """Files found under the root but not staged, ``{path: reason}`` (``SupportsStagingReport``)."""
        return dict(self.report.failed)


def build_in_memory_backend(dataset_cfg: Any, config: "TrainingConfig") -> GH200InMemoryBackend:
    """A ``GH200InMemoryBackend`` staging ``dataset_cfg.instance_data_dir`` with its ``in_memory`` options; an
    object store URL (``s3://bucket/prefix``) is listed and read through an ``ObjectStoreBackend`` built from
    the entry's ``storage_options`` / ``max_retries`` / ``retry_backoff_seconds``."""
    options = dataset_cfg.in_memory
    source = None
    if url_protocol(dataset_cfg.instance_data_dir) is not None:
        from simpletuner.data_backend.object_store import backend_from_options

        source = backend_from_options(dataset_cfg.instance_data_dir, dataset_cfg.id, dataset_cfg)
    return GH200InMemoryBackend(
        dataset_cfg.instance_data_dir,
        dataset_cfg.id,
        compression=options.compression,
        compress_encoded_images=options.compress_encoded_images,
        num_workers=options.num_workers,
        memory_limit_gb=options.memory_limit_gb,
        max_bad_image_fraction=config.max_bad_image_fraction,
        source=source,
    )
