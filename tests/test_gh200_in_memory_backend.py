"""GH200InMemoryBackend: conformance with LocalDataBackend, codecs, limits, threads, factory, batches."""

from __future__ import annotations

import io
import json
import logging
import os
import random
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

from simpletuner.configuration import load_config, validate_config
from simpletuner.data_backend import (
    IMAGE_EXTENSIONS,
    BucketSampler,
    DataBackend,
    LocalDataBackend,
    SupportsReadHead,
    build_datasets,
    load_sample_pixels,
)
from simpletuner.data_backend import in_memory as imb
from simpletuner.data_backend.codecs import CODEC_NAMES, get_codec
from simpletuner.data_backend.in_memory import GH200InMemoryBackend, StagingReport

CODECS = ["lz4", "zlib", "snappy", "none"]


def image_bytes(fmt: str, size=(40, 24), seed=0) -> bytes:
    array = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=fmt)
    return buffer.getvalue()


def flat_png_uncompressed(size=(64, 64)) -> bytes:
    """A PNG stored without deflate (``compress_level=0``): a real image that compresses well."""
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 60)).save(buffer, format="PNG", compress_level=0)
    return buffer.getvalue()


@pytest.fixture
def tree(tmp_path):
    files = {
        "b.png": image_bytes("PNG", seed=1),
        "flat.png": flat_png_uncompressed(),
        "a.JPG": image_bytes("JPEG", seed=2),
        "a.txt": b"a caption " * 200,
        "notes.txt": b"hello",
        "empty.txt": b"",
        "sub/deeper/c.webp": image_bytes("WEBP", seed=3),
        "sub/d.jpeg": image_bytes("JPEG", seed=4),
        "sub/e.gif": b"gif-e",
        "sub/raw.npy": np.zeros(4096, dtype=np.float32).tobytes(),
        "日本/猫.png": image_bytes("PNG", seed=5),
        ".hidden.png": b"hidden",
        ".cache/f.png": b"in hidden dir",
        "sub/.g.png": b"hidden in sub",
    }
    root = tmp_path / "tree"
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def stage(root, **kwargs) -> GH200InMemoryBackend:
    kwargs.setdefault("num_workers", 2)
    return GH200InMemoryBackend(root, "ds", **kwargs)


# --- conformance with LocalDataBackend ---


@pytest.mark.parametrize("compression", CODECS)
def test_same_answers_as_local(tree, compression):
    local = LocalDataBackend(tree, "ds")
    memory = stage(tree, compression=compression)
    assert isinstance(memory, DataBackend) and isinstance(memory, SupportsReadHead) and memory.id == "ds"
    assert memory.list_files() == local.list_files()
    for extensions in (None, IMAGE_EXTENSIONS, {".png"}, {"TXT"}, ".npy", set()):
        assert memory.list_files(extensions) == local.list_files(extensions)
    for path in local.list_files():
        assert memory.read(path) == local.read(path)
        assert memory.size(path) == local.size(path)
        assert memory.identity(path) == local.identity(path)
        assert memory.exists(path)
        for num_bytes in (0, 3, 10**6):
            assert memory.read_head(path, num_bytes) == local.read_head(path, num_bytes)
    assert memory.read("./sub//d.jpeg") == local.read("./sub//d.jpeg")
    assert not memory.exists("nope.png") and not memory.exists("sub") and not memory.exists(".hidden.png")


def test_missing_file_error_names_the_path(tree):
    memory = stage(tree)
    for call in (memory.read, memory.size, memory.identity, lambda p: memory.read_head(p, 4)):
        with pytest.raises(FileNotFoundError, match=r"dataset 'ds': no file 'missing/x.png'"):
            call("missing/x.png")


@pytest.mark.parametrize("bad", ["../outside.png", "sub/../../outside.png", "/etc/passwd", ""])
def test_paths_escaping_the_root_are_refused(tree, bad):
    (tree / "outside.png").write_bytes(b"x")
    memory = stage(tree / "sub")
    for call in (memory.read, memory.exists, memory.size, memory.identity):
        with pytest.raises(ValueError, match="not a relative path inside"):
            call(bad)


def test_root_must_be_a_folder(tmp_path):
    with pytest.raises(ValueError, match="instance_data_dir"):
        stage(tmp_path / "absent")


def test_content_is_a_snapshot_of_staging_time(tree):
    memory = stage(tree)
    before = memory.identity("notes.txt")
    (tree / "notes.txt").write_bytes(b"rewritten later")
    (tree / "new.txt").write_bytes(b"added later")
    assert memory.read("notes.txt") == b"hello" and memory.identity("notes.txt") == before
    assert "new.txt" not in memory.list_files()


# --- codecs ---


@pytest.mark.parametrize("compression", CODECS)
@pytest.mark.parametrize("compress_images", [False, True])
def test_round_trip_and_what_is_compressed(tree, compression, compress_images):
    memory = stage(tree, compression=compression, compress_encoded_images=compress_images)
    for path in memory.list_files():
        assert memory.read(path) == (tree / path).read_bytes()
    entries = memory._entries
    text, jpeg, flat, tiny = entries["a.txt"], entries["a.JPG"], entries["flat.png"], entries["notes.txt"]
    if compression == "none":
        assert text.data == (tree / "a.txt").read_bytes() and text.codec.name == "none"
    else:
        assert len(text.data) < text.size and text.codec.name == compression
    if not compress_images:
        assert jpeg.data == (tree / "a.JPG").read_bytes() and jpeg.codec.name == "none"
    if compress_images and compression != "none":
        assert len(flat.data) < flat.size and flat.codec.name == compression
    else:
        assert flat.data == (tree / "flat.png").read_bytes() and flat.codec.name == "none"
    # Files under MIN_COMPRESS_BYTES are kept as-is (a codec header would grow a 5-byte caption).
    assert tiny.data == b"hello" and tiny.codec.name == "none"
    report = memory.report
    assert report.codec == compression and report.files == len(memory.list_files())
    assert report.raw_bytes == sum((tree / p).stat().st_size for p in memory.list_files())
    assert report.stored_bytes == sum(len(e.data) for e in memory._entries.values())
    if compression != "none":
        assert report.stored_bytes < report.raw_bytes and report.ratio < 1


def test_incompressible_and_tiny_files_are_kept_as_is(tmp_path):
    (tmp_path / "noise.bin").write_bytes(np.random.default_rng(0).bytes(4096))
    (tmp_path / "short.txt").write_bytes(b"ab" * (imb.MIN_COMPRESS_BYTES // 2 - 1))
    (tmp_path / "long.txt").write_bytes(b"ab" * (imb.MIN_COMPRESS_BYTES // 2))
    memory = stage(tmp_path, compression="lz4")
    codecs = {path: entry.codec.name for path, entry in memory._entries.items()}
    assert codecs == {"long.txt": "lz4", "noise.bin": "none", "short.txt": "none"}
    assert memory._entries["noise.bin"].data == (tmp_path / "noise.bin").read_bytes()


def test_codecs_round_trip_and_unknown_name():
    data = b"abc" * 1000 + bytes(range(256))
    for name in CODEC_NAMES:
        codec = get_codec(name)
        assert codec.name == name and codec.decompress(codec.compress(data)) == data
    with pytest.raises(ValueError) as info:
        get_codec("lz5")
    assert "'lz5'" in str(info.value) and all(name in str(info.value) for name in CODEC_NAMES)


def test_unknown_codec_is_refused_before_staging(tree, monkeypatch):
    calls = []
    monkeypatch.setattr(imb, "_read_file", lambda full: calls.append(full))
    with pytest.raises(ValueError, match="lz5.*lz4, zlib, snappy, none"):
        stage(tree, compression="lz5")
    assert calls == []


def test_missing_codec_library_names_the_package(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_snappy(name, *args, **kwargs):
        if name == "snappy":
            raise ImportError("No module named 'snappy'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_snappy)
    with pytest.raises(ImportError, match="pip install python-snappy"):
        get_codec("snappy")


# --- memory limit ---


def recording_reader(monkeypatch, fail: dict[str, OSError] | None = None, delay: float = 0.0):
    """Patch the per-file reader: record (path, thread id) per call; raise for chosen file names."""
    calls: list[tuple[str, int]] = []
    real = imb._read_file

    def reader(full):
        name = os.path.basename(full)
        calls.append((name, threading.get_ident()))
        if delay:
            time.sleep(delay)
        if fail and name in fail:
            raise fail[name]
        return real(full)

    monkeypatch.setattr(imb, "_read_file", reader)
    return calls


def test_memory_limit_refused_before_any_read(tree, monkeypatch):
    calls = recording_reader(monkeypatch)
    total = sum(LocalDataBackend(tree, "ds").size(p) for p in LocalDataBackend(tree, "ds").list_files())
    with pytest.raises(ValueError) as info:
        stage(tree, memory_limit_gb=total / 2 / 1e9)
    message = str(info.value)
    assert calls == []
    assert f"{total / 1e9:.3g} GB" in message and f"{total / 2 / 1e9:.3g} GB" in message
    assert "11 files" in message and "memory_limit_gb" in message and "compression" in message and '"local"' in message
    assert stage(tree, memory_limit_gb=total / 1e9).report.files == 11


def compressible_tree(tmp_path, num_files=8):
    root = tmp_path / "text"
    root.mkdir()
    for i in range(num_files):
        (root / f"{i}.txt").write_bytes(b"the same caption again " * 2000)  # 46 kB, compresses ~100x
    return root, 46_000 * num_files


@pytest.mark.parametrize("compression", ["lz4", "zlib", "snappy"])
def test_memory_limit_counts_compressed_size_of_compressible_files(tmp_path, compression):
    root, raw = compressible_tree(tmp_path)
    with pytest.raises(ValueError, match="needs an estimated"):
        stage(root, memory_limit_gb=raw / 2 / 1e9)  # no compression: refused up front
    memory = stage(root, compression=compression, memory_limit_gb=raw / 2 / 1e9)
    assert memory.report.stored_bytes < raw / 2 and memory.report.files == 8
    with pytest.raises(ValueError, match="even compressed with"):
        stage(root, compression=compression, memory_limit_gb=100 / 1e9)


# --- threads ---


def many_files(tmp_path, num_files=64):
    root = tmp_path / "many"
    root.mkdir()
    for i in range(num_files):
        (root / f"{i:03d}.txt").write_bytes(f"caption {i} ".encode() * (i + 1))
    return root


@pytest.mark.parametrize("num_workers", [1, 2, 4])
def test_num_workers_honoured(tmp_path, monkeypatch, num_workers):
    root = many_files(tmp_path)
    calls = recording_reader(monkeypatch, delay=0.002)
    memory = stage(root, num_workers=num_workers)
    threads = {ident for _, ident in calls}
    assert len(calls) == 64 and memory.report.workers == num_workers
    assert threading.get_ident() not in threads
    if num_workers == 1:
        assert len(threads) == 1
    else:
        assert 1 < len(threads) <= num_workers


def test_default_num_workers(tmp_path, monkeypatch):
    monkeypatch.setattr(imb.os, "cpu_count", lambda: 500)
    assert imb.default_num_workers() == 72
    monkeypatch.setattr(imb.os, "cpu_count", lambda: None)
    assert imb.default_num_workers() == 1
    with pytest.raises(ValueError, match="num_workers"):
        stage(many_files(tmp_path, 2), num_workers=0)


@pytest.mark.parametrize("compression", ["lz4", "none"])
def test_concurrent_reads_get_identical_bytes(tmp_path, compression):
    root = many_files(tmp_path)
    for i in range(8):
        (root / f"img{i}.png").write_bytes(image_bytes("PNG", seed=i))
    memory = stage(root, compression=compression)
    expected = {p: (root / p).read_bytes() for p in memory.list_files()}
    mismatches: list[str] = []

    def reader(seed):
        rng = random.Random(seed)
        for _ in range(300):
            path = rng.choice(list(expected))
            data = memory.read_head(path, 7) if rng.random() < 0.2 else memory.read(path)
            if data != expected[path][: len(data)] or (len(data) != 7 and data != expected[path]):
                mismatches.append(path)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert mismatches == []


# --- unreadable files ---


def test_unreadable_files_are_reported_and_left_out(tree, monkeypatch, caplog):
    failures = {"notes.txt": PermissionError(13, "Permission denied"), "b.png": OSError(5, "Input/output error")}
    recording_reader(monkeypatch, fail=failures)
    with caplog.at_level(logging.WARNING, logger=imb.__name__):
        memory = stage(tree, max_bad_image_fraction=0.5)
    assert memory.report.failed == (("b.png", "Input/output error"), ("notes.txt", "Permission denied"))
    assert memory.report.files == 9 and "b.png" not in memory.list_files()
    assert not memory.exists("notes.txt")
    with pytest.raises(FileNotFoundError, match="unreadable when staged: Permission denied"):
        memory.read("notes.txt")
    assert memory.read("a.JPG") == (tree / "a.JPG").read_bytes()  # the rest is intact
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "2 of 11" in warning and "b.png (Input/output error)" in warning and "notes.txt" in warning


def test_too_many_unreadable_files_abort(tree, monkeypatch):
    recording_reader(monkeypatch, fail={"notes.txt": PermissionError(13, "Permission denied")})
    with pytest.raises(ValueError) as info:
        stage(tree, max_bad_image_fraction=0.05)
    message = str(info.value)
    assert "1 of 11 files" in message and "9.1%" in message and "max_bad_image_fraction=0.05" in message
    assert "notes.txt: Permission denied" in message


def test_file_vanishing_between_listing_and_reading(tree, monkeypatch):
    real = imb._read_file

    def vanish_then_read(full):
        if os.path.basename(full) == "notes.txt":
            os.unlink(full)
        return real(full)

    monkeypatch.setattr(imb, "_read_file", vanish_then_read)
    memory = stage(tree, max_bad_image_fraction=0.5)
    assert memory.report.failed == (("notes.txt", "no such file (removed while staging)"),)


@pytest.mark.parametrize("limit", [None, 1.0])
def test_file_listed_but_gone_before_stat_or_read(tree, monkeypatch, limit):
    real_list = LocalDataBackend.list_files
    monkeypatch.setattr(LocalDataBackend, "list_files", lambda self, ext=None: real_list(self, ext) + ["zz_ghost.txt"])
    memory = stage(tree, memory_limit_gb=limit, max_bad_image_fraction=0.5)
    assert memory.report.failed == (("zz_ghost.txt", "no such file (removed while staging)"),)
    assert memory.report.files == 11


def test_read_file_reads_to_the_end_when_size_is_unknown(tmp_path):
    status = "/proc/self/status"
    if not os.path.exists(status) or os.stat(status).st_size != 0:
        pytest.skip("needs a procfs file that reports size 0")
    data, st = imb._read_file(status)
    assert st.st_size == 0 and data.startswith(b"Name:") and data.endswith(b"\n")
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(3 * 1024 * 1024 + 7))
    assert imb._read_file(str(big))[0] == big.read_bytes()


def test_report_and_log_line(tree, caplog):
    with caplog.at_level(logging.INFO, logger=imb.__name__):
        memory = stage(tree, compression="lz4", num_workers=3)
    report = memory.report
    assert isinstance(report, StagingReport) and report.workers == 3 and report.failed == ()
    assert report.seconds > 0 and report.mb_per_s > 0
    line = report.summary("ds")
    assert line in caplog.text
    assert line.startswith("staged dataset 'ds': 7 images (+4 captions and other files), ")  # 11 files
    assert "lz4) in " in line and "3 workers" in line
    failed = StagingReport(1, 10, 10, 1.0, 1, "none", (("x", "Permission denied"),))
    assert "1 unreadable file(s) left out" in failed.summary("ds")


def test_empty_folder_stages_nothing(tmp_path):
    memory = stage(tmp_path)
    assert memory.list_files() == [] and memory.report.files == 0 and memory.report.ratio == 1.0


# --- factory and the training data path ---


def test_factory_builds_in_memory_from_config(make_config, shapes_dir, tmp_path):
    raw = make_config(
        datasets=[
            {
                "id": "shapes",
                "type": "in_memory",
                "instance_data_dir": str(shapes_dir),
                "in_memory": {"compression": "lz4", "num_workers": 2},
            }
        ]
    )
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    loaded = load_config(path)
    (dataset,) = build_datasets(loaded.config)
    assert isinstance(dataset.backend, GH200InMemoryBackend)
    assert dataset.backend.codec.name == "lz4" and dataset.backend.num_workers == 2
    assert len(dataset.samples) == 12 and dataset.metadata.caption_sources == {"textfile": 12}
    assert dataset.backend.report.files == 24  # images and captions


def build_shapes(shapes_dir, kind, **options):
    entry = {"id": "shapes", "type": kind, "instance_data_dir": str(shapes_dir), "crop_style": "random"}
    if options:
        entry["in_memory"] = options
    raw = {
        "pretrained_model_name_or_path": "unused",
        "max_train_steps": 1,
        "resolution": 64,
        "aspect_bucket_alignment": 16,
        "seed": 11,
        "datasets": [entry],
    }
    (dataset,) = build_datasets(validate_config(raw, check_files=False))
    return dataset


@pytest.mark.parametrize("options", [{}, {"compression": "zlib", "compress_encoded_images": True}])
def test_identical_batches_local_and_in_memory(shapes_dir, options):
    local = build_shapes(shapes_dir, "local")
    memory = build_shapes(shapes_dir, "in_memory", **options)
    assert memory.samples == local.samples
    batches = {}
    for name, dataset in (("local", local), ("in_memory", memory)):
        sampler = BucketSampler(dataset.samples, batch_size=2, seed=11)
        batches[name] = [[(s.key, load_sample_pixels(dataset, s)) for s in batch] for batch in sampler]
    assert [[k for k, _ in b] for b in batches["local"]] == [[k for k, _ in b] for b in batches["in_memory"]]
    assert len(batches["local"]) == 6
    for local_batch, memory_batch in zip(batches["local"], batches["in_memory"]):
        for (_, (local_pixels, local_info)), (_, (memory_pixels, memory_info)) in zip(local_batch, memory_batch):
            assert torch.equal(local_pixels, memory_pixels) and local_info == memory_info
