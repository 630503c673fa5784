"""Bad data policy, the same for every storage backend (``local`` and ``in_memory``).

A corpus of good, odd and broken files is generated here. Each kind either works (decodes
to the right 8-bit RGB; transparency composited on WHITE) or is skipped and reported by
path with a reason; ``max_bad_image_fraction`` of a dataset or more (default half) stops the run
with a message listing them.

| kind                                  | outcome                                                      |
|---------------------------------------|--------------------------------------------------------------|
| RGB JPEG / PNG                        | works                                                        |
| CMYK JPEG, 16-bit grey (I;16), P, 1   | works: converted to RGB (16-bit scaled by 1/257)              |
| RGBA, LA, P with transparency         | works: composited on white                                   |
| 4000x16 / 16x4000 strips              | works: clamped 4:1 bucket, crop of the middle                |
| unicode names (NFC, NFD, emoji)       | works                                                        |
| caption not UTF-8                     | works: bad bytes -> U+FFFD, one warning naming the .txt      |
| caption with UTF-8 / UTF-16 BOM       | works: BOM dropped / UTF-16 decoded                          |
| random bytes named .jpg               | skipped at scan: "not a recognised image"                    |
| zero bytes                            | skipped at scan: "empty file (0 bytes)"                      |
| header claiming 30000x30000 pixels    | skipped at scan: "... decompression bomb ..."                |
| unreadable image (EACCES)             | skipped at scan: "cannot read file: Permission denied"       |
| unreadable caption .txt               | image skipped at scan: "caption file X cannot be read"       |
| file name not valid UTF-8             | skipped at scan, shown escaped: "file name is not valid UTF-8" |
| truncated JPEG / PNG (first half)     | skipped at scan (no EOI / IEND: decoded): "image file is truncated" |
| valid header, garbage body            | skipped at the cache fill: "broken data stream"              |

A JPEG whose scan data is garbage *without* marker bytes decodes to noise: libjpeg only
warns, so it cannot be told from a real image and is not in this table.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from fakes import data_only_config
from PIL import Image

from simpletuner.configuration import validate_config
from simpletuner.data_backend import (
    LocalDataBackend,
    bucket_for,
    build_datasets,
    build_metadata,
    load_rgb,
    load_sample_pixels,
    prepare_image,
)
from simpletuner.data_backend import images as images_module
from simpletuner.data_backend import in_memory as imb
from simpletuner.state import StateTracker

BACKENDS = ["local", "in_memory"]
SIZE = (64, 48)
RED, BLUE, WHITE, BLACK = (255, 0, 0), (0, 0, 255), (255, 255, 255), (0, 0, 0)
COLOUR = (200, 30, 40)

#: Files the patched readers refuse with EACCES (tests run as root, so chmod would not do).
LOCKED = {"unreadable.png", "locked_caption.txt"}
NON_UTF8_NAME = b"latin1_caf\xe9.png"
NON_UTF8_SHOWN = "latin1_caf\\xe9.png"

#: path -> (stage, reason substring) for every file that must be skipped.
SKIPPED = {
    "corrupt_random.jpg": ("scan", "not a recognised image"),
    "zero.png": ("scan", "empty file (0 bytes)"),
    "bomb.png": ("scan", "decompression bomb"),
    "unreadable.png": ("scan", "cannot read file: Permission denied"),
    "locked_caption.png": ("scan", "caption file locked_caption.txt cannot be read: Permission denied"),
    NON_UTF8_SHOWN: ("scan", "file name is not valid UTF-8"),
    "truncated.jpg": ("scan", "image file is truncated"),
    "truncated.png": ("scan", "image file is truncated"),
    "corrupt_body.jpg": ("decode", "broken data stream"),
    "corrupt_body.png": ("decode", "broken data stream"),
}
UNICODE_NAMES = ["café_ñ_日本.png", "cafe\u0301_nfd.png", "🐱_emoji.png"]
#: Images of the corpus that must work.
NUM_WORKING = 19


# --- the corpus ---------------------------------------------------------------------------
def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def halves(left, right, mode="RGB", size=SIZE) -> Image.Image:
    """An image whose left half is ``left`` and right half ``right``."""
    image = Image.new(mode, size, left)
    image.paste(right, (size[0] // 2, 0, size[0], size[1]))
    return image


def noise(size=SIZE, seed=0) -> Image.Image:
    array = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(array)


def jpeg_with_garbage_scan(seed=0) -> bytes:
    """A JPEG whose headers (through SOS) are intact and whose scan data is garbage."""
    data = encode(noise(seed=seed), "JPEG", quality=90)
    sos = data.index(b"\xff\xda")
    body = sos + 2 + struct.unpack(">H", data[sos + 2 : sos + 4])[0]
    # Stray SOI markers inside the scan are a hard libjpeg error (plain random bytes are
    # mostly "decoded" into noise with a warning Pillow does not surface).
    return data[:body] + b"\xff\xd8" * 1000 + b"\xff\xd9"


def png_with_garbage_idat(seed=0) -> bytes:
    """A PNG whose IHDR is intact and whose IDAT is garbage (with a correct CRC)."""
    data = encode(noise(seed=seed), "PNG")
    start = data.index(b"IDAT") - 4
    (length,) = struct.unpack(">I", data[start : start + 4])
    garbage = np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8).tobytes()
    chunk = data[start : start + 8] + garbage + struct.pack(">I", zlib.crc32(b"IDAT" + garbage))
    return data[:start] + chunk + data[start + 12 + length :]


def png_bomb_header(width=30000, height=30000) -> bytes:
    """A tiny PNG whose header claims a 900 M-pixel image (Pillow refuses it as a bomb)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def write_corpus(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    good_jpg = encode(noise(seed=1), "JPEG", quality=90)
    good_png = encode(noise(seed=2), "PNG")
    files = {
        # works
        "good_rgb.jpg": encode(Image.new("RGB", SIZE, COLOUR), "JPEG", quality=95),
        "good_rgb.png": encode(Image.new("RGB", SIZE, COLOUR), "PNG"),
        "cmyk.jpg": encode(Image.new("CMYK", SIZE, (0, 255, 255, 0)), "JPEG", quality=95),
        "deep16.png": encode(
            Image.fromarray(np.tile(np.repeat(np.array([0, 32896, 65535], np.uint16), [16, 16, 32]), (48, 1))), "PNG"
        ),
        "palette.png": encode(halves(0, 1, "P").copy(), "PNG"),
        "palette_transparent.png": None,  # written below (needs a palette)
        "rgba.png": encode(halves((0, 0, 0, 0), (255, 0, 0, 255), "RGBA"), "PNG"),
        "semi_alpha.png": encode(Image.new("RGBA", SIZE, (255, 0, 0, 128)), "PNG"),
        "la.png": encode(halves((0, 0), (0, 255), "LA"), "PNG"),
        "onebit.png": encode(halves(0, 1, "1"), "PNG"),
        "wide_strip.png": encode(noise((4000, 16), seed=3), "PNG"),
        "tall_strip.png": encode(noise((16, 4000), seed=4), "PNG"),
        "latin1_caption.png": good_png,
        "latin1_caption.txt": "café crème".encode("latin-1"),
        "invalid_utf8_caption.png": good_png,
        "invalid_utf8_caption.txt": b"a \x80\x81 cat",
        "bom_caption.png": good_png,
        "bom_caption.txt": "\ufeffa bom caption\n".encode("utf-8"),
        "utf16_caption.png": good_png,
        "utf16_caption.txt": "ein Bär".encode("utf-16"),
        # skipped
        "corrupt_random.jpg": np.random.default_rng(5).integers(0, 256, 3000, dtype=np.uint8).tobytes(),
        "corrupt_body.jpg": jpeg_with_garbage_scan(),
        "corrupt_body.png": png_with_garbage_idat(),
        "truncated.jpg": good_jpg[: len(good_jpg) // 2],
        "truncated.png": good_png[: len(good_png) // 2],
        "zero.png": b"",
        "bomb.png": png_bomb_header(),
        "unreadable.png": good_png,
        "locked_caption.png": good_png,
        "locked_caption.txt": b"a caption nobody may read",
    }
    palette = halves(0, 1, "P")
    palette.putpalette([255, 0, 0, 0, 0, 255] + [0] * (256 * 3 - 6))
    files["palette.png"] = encode(palette, "PNG")
    files["palette_transparent.png"] = encode(palette, "PNG", transparency=0)
    for name in UNICODE_NAMES:
        files[name] = encode(Image.new("RGB", SIZE, BLUE), "PNG")
    files["café_ñ_日本.txt"] = "un café à Tōkyō".encode("utf-8")
    for name, data in files.items():
        (folder / name).write_bytes(data)
    with open(os.path.join(os.fsencode(folder), NON_UTF8_NAME), "wb") as handle:
        handle.write(good_png)
    return folder


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture
def locked(monkeypatch):
    """Make the files in LOCKED unreadable (EACCES) for both backends' readers."""

    def refuse(path):
        if os.path.basename(str(path)) in LOCKED:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))

    real_read, real_head, real_stage = LocalDataBackend.read, LocalDataBackend.read_head, imb._read_file

    def read(self, path):
        refuse(path)
        return real_read(self, path)

    def read_head(self, path, num_bytes):
        refuse(path)
        return real_head(self, path, num_bytes)

    def stage(full):
        refuse(full)
        return real_stage(full)

    monkeypatch.setattr(LocalDataBackend, "read", read)
    monkeypatch.setattr(LocalDataBackend, "read_head", read_head)
    monkeypatch.setattr(imb, "_read_file", stage)


def dataset_entry(kind: str, folder: Path, **extra) -> dict:
    entry = {"id": "corpus", "type": kind, "instance_data_dir": str(folder), **extra}
    if kind == "in_memory":
        entry["in_memory"] = {"num_workers": 2}
    return entry


def make_state(kind: str, folder: Path, max_bad: float = 0.5) -> StateTracker:
    raw = data_only_config(dataset_entry(kind, folder), max_bad)
    return StateTracker(validate_config(raw, check_files=False), raw)


def scan_and_decode(state: StateTracker):
    """What the trainer does with the data: scan, then decode every sample (as the latent
    cache fill does) and drop the ones whose body does not decode."""
    (dataset,) = build_datasets(state.config)
    failures = {}
    for sample in {s.key: s for s in dataset.samples}.values():
        try:
            load_sample_pixels(dataset, sample)
        except (OSError, ValueError) as exc:
            failures[sample.path] = str(exc)
    dataset.metadata.drop_unreadable(
        dataset.id, str(dataset.backend.root), failures, state.config.max_bad_image_fraction
    )
    return dataset


def pixel(dataset, path, xy):
    return tuple(int(v) for v in load_rgb(dataset.backend.read(path)).getpixel(xy))


# --- every kind, both backends --------------------------------------------------------------
@pytest.mark.parametrize("kind", BACKENDS)
def test_each_kind_works_or_is_skipped_by_path(kind, corpus, locked, caplog):
    with caplog.at_level(logging.WARNING):
        dataset = scan_and_decode(make_state(kind, corpus))
    meta = dataset.metadata
    bad = dict(meta.bad_files)
    assert set(bad) == set(SKIPPED), sorted(bad)
    for path, (_, reason) in SKIPPED.items():
        assert reason in bad[path], (path, bad[path])
    # Scan failures come first, decode failures after: the stage is where the table says.
    order = [p for p, _ in meta.bad_files]
    num_decode = sum(stage == "decode" for stage, _ in SKIPPED.values())
    assert {p for p in order[: len(order) - num_decode]} == {p for p, (s, _) in SKIPPED.items() if s == "scan"}
    assert meta.num_files == len(SKIPPED) + NUM_WORKING

    works = {s.path for s in meta.samples}
    assert not works & set(SKIPPED)
    assert set(UNICODE_NAMES) <= works and {"cmyk.jpg", "deep16.png", "wide_strip.png", "tall_strip.png"} <= works
    # Every skipped file is named, with its reason, in a warning.
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for path, (_, reason) in SKIPPED.items():
        assert f"{path}: " in warned and reason in warned, path


@pytest.mark.parametrize("kind", BACKENDS)
def test_converted_pixels_are_correct_rgb(kind, corpus, locked):
    dataset = scan_and_decode(make_state(kind, corpus))
    left, right = (4, 24), (60, 24)
    assert pixel(dataset, "good_rgb.png", left) == COLOUR
    assert all(abs(a - b) <= 4 for a, b in zip(pixel(dataset, "good_rgb.jpg", left), COLOUR))
    assert all(abs(a - b) <= 4 for a, b in zip(pixel(dataset, "cmyk.jpg", left), RED))
    deep = load_rgb(dataset.backend.read("deep16.png"))
    assert [deep.getpixel((x, 0)) for x in (0, 20, 60)] == [BLACK, (128, 128, 128), WHITE]  # value / 257
    assert (pixel(dataset, "palette.png", left), pixel(dataset, "palette.png", right)) == (RED, BLUE)
    # Transparency is composited on white.
    assert (pixel(dataset, "palette_transparent.png", left), pixel(dataset, "palette_transparent.png", right)) == (
        WHITE,
        BLUE,
    )
    assert (pixel(dataset, "rgba.png", left), pixel(dataset, "rgba.png", right)) == (WHITE, RED)
    assert pixel(dataset, "semi_alpha.png", left) in {(255, 127, 127), (255, 128, 128)}
    assert (pixel(dataset, "la.png", left), pixel(dataset, "la.png", right)) == (WHITE, BLACK)
    assert (pixel(dataset, "onebit.png", left), pixel(dataset, "onebit.png", right)) == (BLACK, WHITE)
    for name in UNICODE_NAMES:
        assert pixel(dataset, name, left) == BLUE
    for sample in dataset.samples:  # every working sample becomes a tensor of its bucket
        pixels, _ = load_sample_pixels(dataset, sample)
        assert pixels.shape == (3, sample.bucket[1], sample.bucket[0]) and torch.isfinite(pixels).all()


@pytest.mark.parametrize("kind", BACKENDS)
def test_captions_never_crash_and_bad_encodings_are_reported_once(kind, corpus, locked, caplog):
    with caplog.at_level(logging.WARNING):
        dataset = scan_and_decode(make_state(kind, corpus))
    captions = {s.path: s.caption for s in dataset.samples}
    assert captions["latin1_caption.png"] == "caf\ufffd cr\ufffdme"
    assert captions["invalid_utf8_caption.png"] == "a \ufffd\ufffd cat"
    assert captions["bom_caption.png"] == "a bom caption"
    assert captions["utf16_caption.png"] == "ein Bär"
    assert captions["café_ñ_日本.png"] == "un café à Tōkyō"
    assert captions["🐱_emoji.png"] == "🐱 emoji"  # from the file name
    assert captions["cafe\u0301_nfd.png"] == "cafe\u0301 nfd"
    assert {s.key for s in dataset.samples} >= {f"corpus/{n}" for n in UNICODE_NAMES}
    messages = [
        r.getMessage() for r in caplog.records if "not valid UTF-8" in r.getMessage() and ".txt" in r.getMessage()
    ]
    for name in ("latin1_caption.txt", "invalid_utf8_caption.txt"):
        assert sum(name in m for m in messages) == 1, messages
    assert not any("bom_caption" in m or "utf16_caption" in m for m in messages)


@pytest.mark.parametrize("kind", BACKENDS)
def test_more_bad_files_than_the_limit_abort_listing_them(kind, corpus, locked):
    with pytest.raises(ValueError) as info:
        build_datasets(make_state(kind, corpus, max_bad=0.1).config)
    message = str(info.value)
    assert "8 of 29 image files" in message and "max_bad_image_fraction=0.1" in message
    for path, (stage, _) in SKIPPED.items():
        if stage == "scan":
            assert path in message, path


@pytest.mark.parametrize("kind", BACKENDS)
def test_below_the_limit_the_scan_proceeds_and_decode_failures_count_too(kind, corpus, locked):
    # 8 of 29 fail the scan (28%): allowed at 0.3, but the 2 decode failures make it 34%.
    (dataset,) = build_datasets(make_state(kind, corpus, max_bad=0.3).config)
    assert len(dataset.metadata.bad_files) == 8
    with pytest.raises(ValueError, match=r"(?s)10 of 29 image files .*corrupt_body\.png"):
        scan_and_decode(make_state(kind, corpus, max_bad=0.3))


def test_only_unreadable_images_is_not_reported_as_an_empty_folder(tmp_path, monkeypatch):
    folder = tmp_path / "locked"
    folder.mkdir()
    (folder / "unreadable.png").write_bytes(encode(noise(), "PNG"))
    monkeypatch.setattr(
        imb, "_read_file", lambda full: (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied"))
    )
    with pytest.raises(
        ValueError, match="(?s)none of the 1 image files .*unreadable.png: cannot read file: Permission denied"
    ):
        build_datasets(make_state("in_memory", folder, max_bad=1.0).config)


# --- aspect ratios -------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [(4000, 16), (16, 4000), (100_000, 1), (1, 100_000), (3, 1), (1, 1)])
@pytest.mark.parametrize("resolution,alignment", [(64, 16), (1024, 64), (40, 16), (8, 16)])
def test_extreme_aspect_ratios_land_in_a_clamped_bucket(size, resolution, alignment):
    width, height = bucket_for(*size, resolution, alignment)
    assert width >= alignment and height >= alignment
    assert width % alignment == 0 and height % alignment == 0
    assert max(width, height) / min(width, height) <= 5  # 4:1, give or take the alignment


def test_strip_buckets_at_the_training_resolution():
    assert bucket_for(4000, 16, 64, 16) == (128, 32)
    assert bucket_for(16, 4000, 64, 16) == (32, 128)


@pytest.mark.parametrize("size,bucket", [((4000, 1), (2048, 512)), ((1, 4000), (512, 2048)), ((4000, 16), (128, 32))])
def test_strips_are_cropped_without_a_huge_intermediate(size, bucket, monkeypatch):
    sizes = []
    real = Image.Image.resize

    def recording_resize(self, new_size, *args, **kwargs):
        sizes.append(tuple(new_size))
        return real(self, new_size, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "resize", recording_resize)
    image = Image.fromarray(np.tile(np.arange(size[0], dtype=np.uint8)[None, :, None], (size[1], 1, 3)))
    for style in ("center", "random"):
        pixels, info = prepare_image(image, bucket, style, crop_seed=3)
        assert pixels.shape == (3, bucket[1], bucket[0])
        assert info["target_size"] == bucket and info["original_size"] == size
    limit = images_module.MAX_RESIZE_OVERSHOOT * bucket[0] * bucket[1]
    assert sizes and all(w * h <= limit for w, h in sizes), sizes


def test_strip_crop_matches_the_full_resize_for_a_smooth_image():
    """Resampling only the crop window gives the pixels a full resize-then-crop would."""
    ramp = np.linspace(0, 255, 4000)[None, :].repeat(16, 0)
    image = Image.fromarray(np.stack([ramp] * 3, -1).astype(np.uint8))
    pixels, info = prepare_image(image, (128, 32), "center", 0)
    resized = image.resize((8000, 32), Image.Resampling.BICUBIC)
    left = info["crop_left"]
    want = np.asarray(resized.crop((left, 0, left + 128, 32)), dtype=np.float32) / 127.5 - 1
    assert np.abs(pixels.permute(1, 2, 0).numpy() - want).max() <= 2 / 127.5


# --- a training run over bad data ------------------------------------------------------------------
@pytest.mark.parametrize("kind", BACKENDS)
def test_training_completes_and_reports_skipped_files(kind, make_config, shapes_dir, tmp_path, locked, caplog):
    from simpletuner.training.trainer import Trainer

    data = tmp_path / "data"
    shutil.copytree(shapes_dir, data)
    (data / "zero.png").write_bytes(b"")
    (data / "corrupt_random.jpg").write_bytes(b"\x00garbage" * 100)
    (data / "unreadable.png").write_bytes(encode(noise((64, 64)), "PNG"))
    good = encode(noise((64, 64), seed=9), "PNG")
    (data / "truncated.png").write_bytes(good[: len(good) // 2])
    (data / "rgba.png").write_bytes(encode(halves((0, 0, 0, 0), (255, 0, 0, 255), "RGBA", size=(64, 64)), "PNG"))
    (data / "rgba.txt").write_bytes("a red half on caf\xe9 white".encode("latin-1"))
    raw = make_config(max_train_steps=2)  # 4 of 17 unreadable: under the default (half)
    raw["datasets"] = [dataset_entry(kind, data, id="shapes")]
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(StateTracker(validate_config(raw), raw))
        result = trainer.train()
    assert result.global_step == 2
    meta = trainer.state.get_dataset("shapes").metadata
    skipped = {"zero.png", "corrupt_random.jpg", "unreadable.png", "truncated.png"}
    assert {p for p, _ in meta.bad_files} == skipped
    assert "rgba.png" in {s.path for s in meta.samples}
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    for path in skipped:
        assert path in warned, path
    assert warned.count("rgba.txt is not valid UTF-8") == 1


# --- the default rule: a few unreadable files are skipped, half or more stop the run ---------------------------------
def broken_pair(folder: Path) -> dict[str, str]:
    """A cut-off JPEG (its header intact) and garbage bytes named .png, each with a caption; -> name: reason."""
    good = encode(noise((64, 64), seed=11), "JPEG", quality=90)
    (folder / "truncated.jpg").write_bytes(good[: len(good) // 3])
    (folder / "garbage.png").write_bytes(np.random.default_rng(12).integers(0, 256, 2000, dtype=np.uint8).tobytes())
    for name in ("truncated", "garbage"):
        (folder / f"{name}.txt").write_text(f"a {name} file")
    return {"truncated.jpg": "image file is truncated", "garbage.png": "not a recognised image"}


def test_thirty_images_with_two_broken_files_train_and_both_are_listed(make_config, tmp_path, caplog):
    from simpletuner.testing.demo_data import write_shapes_dataset
    from simpletuner.training.trainer import Trainer

    data = write_shapes_dataset(tmp_path / "data", num_images=28)
    broken = broken_pair(data)
    raw = make_config(max_train_steps=2)  # the default max_bad_image_fraction
    raw["datasets"][0]["instance_data_dir"] = str(data)
    with caplog.at_level(logging.WARNING):
        trainer = Trainer(StateTracker(validate_config(raw), raw))
        result = trainer.train()
    assert result.global_step == 2
    meta = trainer.state.get_dataset("shapes").metadata
    assert dict(meta.bad_files).keys() == broken.keys() and len({s.path for s in meta.samples}) == 28
    for path, reason in broken.items():  # the cut-off JPEG is found by the scan, not the fill
        assert reason in dict(meta.bad_files)[path]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    scan = [m for m in warnings if "as unreadable while scanning" in m]
    fill = [m for m in warnings if "left out of training" in m]
    assert len(scan) == 1 and "skipped 2 of 30 image files" in scan[0]
    assert (
        len(fill) == 1 and "2 of 30 image files are unreadable" in fill[0] and "(2 found by the scan, 0 by" in fill[0]
    )
    for message in scan + fill:
        assert all(f"{path}: " in message for path in broken), message


def test_half_the_dataset_unreadable_stops_naming_the_dataset_the_count_and_what_to_check(tmp_path):
    from simpletuner.testing.demo_data import write_shapes_dataset

    data = write_shapes_dataset(tmp_path / "data", num_images=2)
    broken_pair(data)  # 2 of 4: half
    with pytest.raises(ValueError) as info:
        build_datasets(make_state("local", data, max_bad=0.5).config)
    message = str(info.value)
    assert message.startswith("dataset 'corpus': 2 of 4 image files under ") and str(data) in message
    assert "max_bad_image_fraction=0.5" in message and "wrong `instance_data_dir`" in message
    assert "garbage.png: not a recognised image" in message and "truncated.jpg: cannot decode image" in message
    (data / "extra.png").write_bytes(encode(noise((64, 64)), "PNG"))  # 2 of 5: trains
    (dataset,) = build_datasets(make_state("local", data, max_bad=0.5).config)
    assert len(dataset.samples) == 3


def test_the_default_rule_is_half_or_more(tmp_path):
    from simpletuner.data_backend.bad_files import DEFAULT_MAX_BAD_FRACTION, is_too_many

    raw = {k: v for k, v in data_only_config(dataset_entry("local", tmp_path)).items() if k != "max_bad_image_fraction"}
    assert validate_config(raw, check_files=False).max_bad_image_fraction == DEFAULT_MAX_BAD_FRACTION == 0.5
    assert [is_too_many(n, 30, 0.5) for n in (0, 2, 14, 15, 30)] == [False, False, False, True, True]
    assert is_too_many(3, 30, 0.1) and not is_too_many(2, 30, 0.1)  # 0.1 is a tenth exactly, not 0.1000...01
    assert not is_too_many(0, 30, 0.0) and is_too_many(1, 30, 0.0)


# --- the cheap checks at the scan, and what only the fill finds ------------------------------------------------
def test_a_large_cut_off_jpeg_is_found_at_the_scan_from_its_end(tmp_path, monkeypatch):
    big = encode(noise((900, 700), seed=3), "JPEG", quality=95)
    assert len(big) > images_module.HEADER_BYTES  # the header read does not hold the whole file
    (tmp_path / "cut.jpg").write_bytes(big[: int(len(big) * 0.9)])
    (tmp_path / "whole.jpg").write_bytes(big)
    (tmp_path / "motion.jpg").write_bytes(big + b"\x00\x00\x00\x18ftypmp42" + bytes(5000))  # a video after the EOI
    png = encode(noise((64, 64)), "PNG")
    (tmp_path / "no_iend.png").write_bytes(png[:-12])  # Pillow decodes a PNG whose IEND alone is missing
    decoded = []
    real = images_module.load_rgb
    monkeypatch.setattr(images_module, "load_rgb", lambda data: decoded.append(len(data)) or real(data))
    config = validate_config(data_only_config(dataset_entry("local", tmp_path), 0.5), check_files=False)
    meta = build_metadata(LocalDataBackend(tmp_path, "corpus"), config.datasets[0], config, seed=0)
    assert {p for p, _ in meta.bad_files} == {"cut.jpg"}
    assert "cannot decode image: image file is truncated" in dict(meta.bad_files)["cut.jpg"]
    assert {s.path for s in meta.samples} == {"whole.jpg", "motion.jpg", "no_iend.png"}
    assert len(decoded) == 3  # only the files that do not end like whole ones were decoded


def test_a_corrupt_body_passes_the_scan_is_skipped_at_the_fill_and_the_same_on_a_rerun(make_config, tmp_path, caplog):
    from simpletuner.caching.fill import fill_caches
    from simpletuner.data_backend import BucketSampler
    from simpletuner.models import get_model_spec
    from simpletuner.testing.demo_data import write_shapes_dataset

    data = write_shapes_dataset(tmp_path / "data", num_images=8)
    (data / "corrupt_body.jpg").write_bytes(jpeg_with_garbage_scan())  # ends with its EOI: passes the cheap checks
    raw = make_config()
    raw["datasets"][0]["instance_data_dir"] = str(data)
    config = validate_config(raw)

    def fill_and_order():
        state = StateTracker(config, raw)
        datasets = build_datasets(state.config)
        assert "corrupt_body.jpg" in {s.path for s in datasets[0].samples}  # the scan kept it
        cache_dir = Path(config.cache_config.cache_dir)
        filled, _ = fill_caches(
            get_model_spec(config),
            datasets,
            cache_dir,
            torch.device("cpu"),
            torch.float32,
            locks=None,
            record_cache_dir=state.register_cache_dir,
        )
        samples = [s for ds in datasets for s in ds.samples]
        sampler = BucketSampler(samples, config.train_batch_size, 1, 0, config.seed)
        return datasets[0].metadata, [[s.key for s in batch] for batch in sampler], filled.reports["latents"]

    with caplog.at_level(logging.WARNING):
        meta, order, report = fill_and_order()
    assert [p for p, _ in meta.bad_files] == ["corrupt_body.jpg"] and "broken data stream" in meta.bad_files[0][1]
    assert "corrupt_body.jpg" not in {s.path for s in meta.samples}
    fill = [r.getMessage() for r in caplog.records if "left out of training" in r.getMessage()]
    assert (
        len(fill) == 1 and "1 of 9 image files" in fill[0] and "(0 found by the scan, 1 by the cache fill)" in fill[0]
    )
    assert "corrupt_body.jpg: " in fill[0]

    again_meta, again_order, again_report = fill_and_order()  # a re-run: the good latents are cache hits
    assert again_report.num_hits == 8 and again_report.num_computed == 0
    assert again_order == order and again_meta.bad_files == meta.bad_files


def test_files_found_bad_on_different_ranks_leave_every_rank_the_same_samples(tmp_path):
    from simpletuner.caching.fill import _every_rank_undecodable

    class Share:  # rank r found only the failures of its own part of the misses
        def __init__(self, parts):
            self.parts = parts

        def from_all(self, value):
            return self.parts

    parts = [{"corpus": {"a.png": "cannot decode image: x"}}, {"corpus": {"b.png": "cannot decode image: y"}}]
    merged = [_every_rank_undecodable(part, Share(parts)) for part in parts]
    assert merged[0] == merged[1] == {"corpus": {"a.png": "cannot decode image: x", "b.png": "cannot decode image: y"}}
    for name in ("a.png", "b.png", "c.png", "d.png", "e.png"):
        (tmp_path / name).write_bytes(encode(noise((64, 64)), "PNG"))
    kept = []
    for failures in merged:
        (dataset,) = build_datasets(make_state("local", tmp_path).config)
        dataset.metadata.drop_unreadable("corpus", str(tmp_path), failures["corpus"], 0.5)
        kept.append([s.key for s in dataset.samples])
    assert kept[0] == kept[1] == ["corpus/c.png", "corpus/d.png", "corpus/e.png"]
