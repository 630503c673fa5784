"""The metadata scan at scale (issue 17): the scandir listing keeps os.walk's semantics, the PNG/JPEG
header parser agrees with Pillow on every file (valid, cut off, damaged), and the scan's results
and ``Sample`` objects stay what they were."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import random
import re
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
from fakes import data_only_config
from PIL import Image, PngImagePlugin

import simpletuner.data_backend.metadata as metadata_module
from simpletuner.configuration import validate_config
from simpletuner.data_backend import IMAGE_EXTENSIONS, LocalDataBackend, build_metadata
from simpletuner.data_backend.image_headers import fast_image_size
from simpletuner.data_backend.images import HEADER_BYTES, read_image_size, read_image_size_pil
from simpletuner.data_backend.metadata import Sample, caption_file, caption_from_filename, caption_from_filename_cleaned


# --- listing ---------------------------------------------------------------------------------
def walk_listing(root: Path, extensions=None) -> list[str]:
    """The listing as it was before issue 17 (os.walk, followlinks, Path.is_file): the reference."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or (extensions is not None and os.path.splitext(name)[1].lower() not in extensions):
                continue
            full = Path(dirpath) / name
            if full.is_file():
                found.append(full.relative_to(root).as_posix())
    return sorted(found)


@pytest.fixture
def tricky(tmp_path):
    root = tmp_path / "data"
    for rel in [
        "a.PNG",
        "b.jpg",
        "c.JpEg",
        "notes.txt",
        "noext",
        ".hidden.png",
        ".cache/x.png",
        "sub/.y.png",
        "sub/deep/deeper/z.webp",
        "sub/deep/w.png",
        "日本/猫.png",
        "elsewhere_target/e.png",
    ]:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    outside = tmp_path / "outside"
    (outside / "nested").mkdir(parents=True)
    (outside / "o.png").write_bytes(b"o")
    (outside / "nested" / "p.jpg").write_bytes(b"p")
    os.symlink(outside, root / "linked")  # a symlinked folder outside the root: followed
    os.symlink(root / "elsewhere_target", root / "sub" / "again")  # a second name for a folder: both listed
    os.symlink(root / "a.PNG", root / "link_to_file.png")  # a symlink to a file: listed
    os.symlink(root / "gone.png", root / "broken.png")  # a broken symlink: skipped
    os.symlink(outside, root / ".hidden_link")  # hidden: skipped
    os.mkfifo(root / "pipe.png")  # not a regular file: skipped
    (root / "folder.png").mkdir()  # a folder named like an image: walked, not listed
    (root / "folder.png" / "inner.png").write_bytes(b"i")
    return root


@pytest.mark.parametrize("extensions", [None, IMAGE_EXTENSIONS, frozenset({".png"}), frozenset()])
def test_scandir_listing_matches_os_walk(tricky, extensions):
    listing = LocalDataBackend(tricky, "ds").list_files(extensions)
    assert listing == walk_listing(tricky, extensions)
    if extensions is None:
        assert {"a.PNG", "linked/nested/p.jpg", "sub/again/e.png", "link_to_file.png", "folder.png/inner.png"} <= set(
            listing
        )
        assert not {"broken.png", "pipe.png", ".hidden.png", "sub/.y.png"} & set(listing)


def test_listing_stops_at_symlink_loops(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "img.png").write_bytes(b"x")
    (tmp_path / "side").mkdir()
    (tmp_path / "side" / "s.png").write_bytes(b"s")
    os.symlink(tmp_path / "a", tmp_path / "a" / "b" / "up")  # back to an ancestor: os.walk went round ~40 times
    os.symlink(tmp_path, tmp_path / "a" / "root")
    os.symlink(tmp_path / "side", tmp_path / "a" / "b" / "to_side")  # not an ancestor: followed
    listing = LocalDataBackend(tmp_path, "ds").list_files(IMAGE_EXTENSIONS)
    assert listing == ["a/b/img.png", "a/b/to_side/s.png", "side/s.png"]


def test_resolve_matches_pathlib_rules(tmp_path):
    backend = LocalDataBackend(tmp_path, "ds")

    def reference(path):
        rel = PurePosixPath(str(path).replace(os.sep, "/"))
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            return "refused"
        return str(tmp_path.joinpath(*rel.parts))

    paths = ["a.png", "a/b.png", "a//b.png", "./a.png", "a/./b.png", "a/b/", ".h/x.png", "a/.h.png", "日本/猫.png"]
    paths += ["../x.png", "a/../../x", "/abs.png", "//abs.png", "", ".", "./", "a/..", "..a/b", "a/b..", "a\\b.png"]
    for path in paths:
        try:
            got = backend._full(path)
        except ValueError:
            got = "refused"
        assert got == reference(path), path


def test_caption_file_matches_pathlib():
    for path in ["a.png", "a/b.c.png", "a..png", "a.", ".png", "a/.png", "a", "a/b/", "./a.png", "a//b.png",
                 "x.y/z", "/abs/a.png", "a.png.", "..a.png", "日本/猫.JPG", "a/b."]:  # fmt: skip
        assert caption_file(path) == PurePosixPath(path).with_suffix(".txt").as_posix(), path
    assert caption_file("clips/one", is_folder=True) == "clips/one.txt"


def test_captions_from_filename_match_pathlib_stem():
    def stem(path, is_folder):
        return PurePosixPath(path).name if is_folder else PurePosixPath(path).stem

    def reference(path, is_folder):
        trimmed = re.sub(r"(?:[\s_\-]+\d+)+$", "", stem(path, is_folder)) or stem(path, is_folder)
        return " ".join(re.sub(r"[_\-]+", " ", trimmed).split())

    paths = ["red_cat.png", "sub/a-dog_on-grass_001.jpg", "shot_01_02.png", "1234.png", "a.b.png", ".png", "a/.png"]
    paths += ["x", "x.", "a/b/", "a//b_c.png", "./q_1.png", "a-_-b.png", "日本/猫_01.JPG", "clips/my_clip-3", "-_-"]
    for path in paths:
        for is_folder in (False, True):
            assert caption_from_filename_cleaned(path, is_folder=is_folder) == reference(path, is_folder), path
            assert caption_from_filename(path, is_folder=is_folder) == stem(path, is_folder).replace("_", " "), path


# --- header parser against Pillow -------------------------------------------------------------
def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def _exif(orientation: int | None, dpi: bool = False) -> bytes:
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    if dpi:
        exif[0x0128] = 2
        exif[0x011A] = 300.0
    return exif.tobytes()


def sample_files() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 255, (24, 40, 3), dtype=np.uint8))
    files = {}
    for mode in ["1", "L", "LA", "P", "RGB", "RGBA", "I;16"]:
        files[f"png-{mode}"] = _encode(rgb.convert(mode), "PNG")
    files["png-interlaced"] = _encode(rgb, "PNG", optimize=False)
    palette = rgb.convert("P")
    palette.info["transparency"] = 3
    files["png-trns"] = _encode(palette, "PNG")
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "hello")
    info.add_itxt("XML:com.adobe.xmp", "<x/>")  # iTXt: Pillow decides
    files["png-text"] = _encode(rgb, "PNG", pnginfo=info)
    for orientation in (1, 3, 6, 8):
        files[f"png-exif-{orientation}"] = _encode(rgb, "PNG", exif=_exif(orientation))
    files["png-icc"] = _encode(rgb, "PNG", icc_profile=b"\0" * 200)
    files["jpeg"] = _encode(rgb, "JPEG")
    files["jpeg-progressive"] = _encode(rgb, "JPEG", progressive=True)
    files["jpeg-grey"] = _encode(rgb.convert("L"), "JPEG")
    files["jpeg-cmyk"] = _encode(rgb.convert("CMYK"), "JPEG")
    files["jpeg-optimize-comment"] = _encode(rgb, "JPEG", optimize=True, comment=b"a comment")
    files["jpeg-icc"] = _encode(rgb, "JPEG", icc_profile=b"\1" * 300)
    files["jpeg-dpi"] = _encode(rgb, "JPEG", dpi=(300, 300), exif=_exif(6))
    files["jpeg-exif-dpi"] = _encode(rgb, "JPEG", exif=_exif(5, dpi=True))
    for orientation in range(1, 9):
        files[f"jpeg-exif-{orientation}"] = _encode(rgb, "JPEG", exif=_exif(orientation))
        files[f"jpeg-progressive-exif-{orientation}"] = _encode(rgb, "JPEG", progressive=True, exif=_exif(orientation))
    files["jpeg-exif-empty"] = _encode(rgb, "JPEG", exif=_exif(None))
    files["webp"] = _encode(rgb, "WEBP")
    files["webp-exif"] = _encode(rgb, "WEBP", exif=_exif(6))
    files["gif"] = _encode(rgb, "GIF")
    files["bmp"] = _encode(rgb, "BMP")
    files["tiff"] = _encode(rgb, "TIFF")
    return files


def outcome(read, data):
    try:
        return read(data)
    except ValueError as exc:
        return ("ValueError", str(exc))


@pytest.fixture(scope="module")
def files():
    return sample_files()


def test_header_parser_answers_for_plain_png_and_jpeg(files):
    for name, data in files.items():
        if name.startswith(("png-", "jpeg")) and name not in ("png-text", "png-icc"):
            assert fast_image_size(data) is not None, name  # the fast path is the one being tested
        if name.startswith(("webp", "gif", "bmp", "tiff")):
            assert fast_image_size(data) is None, name


def test_header_parser_matches_pillow_on_every_format(files):
    for name, data in files.items():
        assert read_image_size(data) == read_image_size_pil(data), name
    assert read_image_size(files["jpeg-exif-6"]) == (24, 40)  # rotated: width and height swap
    assert read_image_size(files["png-exif-8"]) == (24, 40)
    assert read_image_size(files["jpeg-exif-3"]) == (40, 24)


def test_header_parser_matches_pillow_on_cut_off_files(files):
    for name, data in files.items():
        if not name.startswith(("png", "jpeg")):
            continue
        for cut in sorted({*range(0, min(len(data), 700), 7), len(data) // 2, len(data) - 1}):
            assert outcome(read_image_size, data[:cut]) == outcome(read_image_size_pil, data[:cut]), (name, cut)


def test_header_parser_matches_pillow_on_damaged_files(files):
    rng = random.Random(0)
    for name, data in files.items():
        if not name.startswith(("png", "jpeg")):
            continue
        for _ in range(150):
            damaged = bytearray(data)
            for _ in range(rng.randint(1, 3)):
                position = rng.randrange(min(len(damaged), 400))
                damaged[position] = rng.randrange(256)
            damaged = bytes(damaged)
            assert outcome(read_image_size, damaged) == outcome(read_image_size_pil, damaged), name


def test_decompression_bomb_sizes_go_to_pillow(files, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 40x24 is a bomb now (> 2x the limit)
    for name in ("png-RGB", "jpeg"):
        assert fast_image_size(files[name]) is None
        assert outcome(read_image_size, files[name])[0] == "ValueError"


# --- the scan ---------------------------------------------------------------------------------
def test_scan_results_match_pillow_headers(tmp_path, files, monkeypatch):
    """Samples, buckets and bad files of a varied folder: the same with every header read by Pillow."""
    for i, (name, data) in enumerate(files.items()):
        ext = {"png": ".png", "jpe": ".jpg", "web": ".webp"}.get(name[:3])
        if ext:
            (tmp_path / f"sub{i % 3}").mkdir(exist_ok=True)
            (tmp_path / f"sub{i % 3}" / f"{name}{ext}").write_bytes(data)
    (tmp_path / "cut.jpg").write_bytes(files["jpeg-exif-6"][:300])
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "text.png").write_bytes(b"not an image")
    (tmp_path / "jpeg_named.png").write_bytes(files["jpeg-exif-6"])
    (tmp_path / "jpeg_named.txt").write_text("a caption")
    config = validate_config(
        data_only_config({"id": "ds", "type": "local", "instance_data_dir": str(tmp_path)}, 0.5), check_files=False
    )
    backend = LocalDataBackend(tmp_path, "ds")
    fast = build_metadata(backend, config.datasets[0], config, seed=3)

    def pil_reader(backend):
        return lambda path: read_image_size_pil(backend.read(path))

    monkeypatch.setattr(metadata_module, "image_size_reader", pil_reader)
    reference = build_metadata(backend, config.datasets[0], config, seed=3)
    assert fast.samples == reference.samples
    assert fast.bad_files == reference.bad_files and len(fast.bad_files) == 3
    assert fast.caption_sources == reference.caption_sources


def test_sample_is_compact_and_still_a_plain_value():
    sample = Sample("ds/a.png", "ds", "a.png", "a cat", (64, 48), (64, 48), "center", 7)
    assert not hasattr(sample, "__dict__")  # slots: the per-image memory budget of the scan
    assert pickle.loads(pickle.dumps(sample)) == sample
    assert dataclasses.replace(sample, caption="a dog").caption == "a dog"
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.caption = "x"
    assert hash(sample) == hash(Sample("ds/a.png", "ds", "a.png", "a cat", (64, 48), (64, 48), "center", 7))


def test_read_head_returns_the_requested_prefix(tmp_path):
    data = bytes(range(256)) * 1500  # 384,000 bytes: longer than the first read and than HEADER_BYTES
    (tmp_path / "big.bin").write_bytes(data)
    (tmp_path / "small.bin").write_bytes(data[:1000])
    backend = LocalDataBackend(tmp_path, "ds")
    assert backend.read_head("big.bin", HEADER_BYTES) == data[:HEADER_BYTES]
    assert backend.read_head("big.bin", 70_000) == data[:70_000]
    assert backend.read_head("small.bin", HEADER_BYTES) == data[:1000]
