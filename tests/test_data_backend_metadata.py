"""Captions and the metadata scan: sizes, buckets, bad files, repeats, seeds."""

from __future__ import annotations

import io
import logging
from collections import Counter

import numpy as np
import pytest
from fakes import data_only_config
from PIL import Image, ImageFile

from simpletuner.configuration import validate_config
from simpletuner.data_backend import LocalDataBackend, bucket_for, build_metadata, caption_for
from simpletuner.data_backend.metadata import caption_from_filename, caption_from_filename_cleaned, crop_seed_for


def scan_config(folder, max_bad=0.05, **dataset):
    """The validated config and its one dataset, for a scan of ``folder`` (no model is read)."""
    entry = {"id": "ds", "type": "local", "instance_data_dir": str(folder), **dataset}
    config = validate_config(data_only_config(entry, max_bad), check_files=False)
    return config, config.datasets[0]


def write_image(path, size=(32, 32), mode="RGB", fmt=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    array = np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(array).convert(mode).save(path, fmt)
    return path


def png_bytes(size=(32, 32)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, "blue").save(buffer, "PNG")
    return buffer.getvalue()


# --- captions -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path,caption",
    [
        ("red_cat.png", "red cat"),
        ("sub/a-dog_on-grass_001.jpg", "a dog on grass"),
        ("photo-12.webp", "photo"),
        ("shot_01_02.png", "shot"),
        ("1234.png", "1234"),
        ("r2d2 robot.png", "r2d2 robot"),
    ],
)
def test_caption_from_filename_cleaned(path, caption):
    assert caption_from_filename_cleaned(path) == caption


#: ``caption_strategy: filename`` as SimpleTuner gives it: figures computed once by running SimpleTuner's
#: ``PromptHandler.prepare_instance_prompt_from_filename`` (simpletuner/helpers/prompts.py:379-395 at bc8e6ab7,
#: the caption made at lines 389-391) on these paths.
SIMPLETUNER_FILENAME_CAPTIONS = {
    "photos/red_cat-on_mat_001.png": "red cat-on mat 001",
    "portrait-of-a-woman_12.png": "portrait-of-a-woman 12",
    "IMG_2031.jpg": "IMG 2031",
    "sub/a-dog_on-grass_001.jpg": "a-dog on-grass 001",
    "shot_01_02.png": "shot 01 02",
    "1234.png": "1234",
    "r2d2 robot.png": "r2d2 robot",
    "a__b.png": "a  b",
    "clips/walk_cycle-2.mp4": "walk cycle-2",
    "_lead_.png": " lead ",
    "a.b_c.png": "a.b c",
}


@pytest.mark.parametrize("path,caption", sorted(SIMPLETUNER_FILENAME_CAPTIONS.items()))
def test_caption_from_filename_is_simpletuners(path, caption):
    assert caption_from_filename(path) == caption


def test_textfile_caption_and_fallbacks(tmp_path):
    write_image(tmp_path / "with_text.png")
    (tmp_path / "with_text.txt").write_text("  a red square \n", encoding="utf-8")
    write_image(tmp_path / "empty_text_01.png")
    (tmp_path / "empty_text_01.txt").write_text("   \n")
    write_image(tmp_path / "no_text.png")
    backend = LocalDataBackend(tmp_path, "ds")

    _, cfg = scan_config(tmp_path)
    assert caption_for(backend, "with_text.png", cfg) == ("a red square", "textfile")
    assert caption_for(backend, "empty_text_01.png", cfg) == ("empty text", "filename_cleaned")
    assert caption_for(backend, "no_text.png", cfg) == ("no text", "filename_cleaned")

    _, cfg = scan_config(tmp_path, instance_prompt="sks toy")
    assert caption_for(backend, "with_text.png", cfg) == ("a red square", "textfile")
    assert caption_for(backend, "empty_text_01.png", cfg) == ("sks toy", "instance_prompt")
    assert caption_for(backend, "no_text.png", cfg) == ("sks toy", "instance_prompt")


def test_textfile_non_utf8_is_replaced_with_warning(tmp_path, caplog):
    write_image(tmp_path / "latin.png")
    (tmp_path / "latin.txt").write_bytes("café crème".encode("latin-1"))
    _, cfg = scan_config(tmp_path)
    with caplog.at_level(logging.WARNING):
        caption, source = caption_for(LocalDataBackend(tmp_path, "ds"), "latin.png", cfg)
    assert source == "textfile"
    assert caption == "caf\ufffd cr\ufffdme"
    assert "latin.txt" in caplog.text and "UTF-8" in caplog.text


def test_textfile_utf8_with_bom_and_unicode(tmp_path):
    write_image(tmp_path / "猫.png")
    (tmp_path / "猫.txt").write_bytes("\ufeff黒い猫".encode("utf-8"))
    _, cfg = scan_config(tmp_path)
    assert caption_for(LocalDataBackend(tmp_path, "ds"), "猫.png", cfg) == ("黒い猫", "textfile")


def test_filename_and_instance_prompt_strategies(tmp_path):
    write_image(tmp_path / "blue_sky_003.png")
    (tmp_path / "blue_sky_003.txt").write_text("ignored")
    backend = LocalDataBackend(tmp_path, "ds")
    _, cfg = scan_config(tmp_path, caption_strategy="filename")
    assert caption_for(backend, "blue_sky_003.png", cfg) == ("blue sky 003", "filename")
    _, cfg = scan_config(tmp_path, caption_strategy="filename_cleaned")
    assert caption_for(backend, "blue_sky_003.png", cfg) == ("blue sky", "filename_cleaned")
    _, cfg = scan_config(tmp_path, caption_strategy="instance_prompt", instance_prompt="a photo of sks")
    assert caption_for(backend, "blue_sky_003.png", cfg) == ("a photo of sks", "instance_prompt")


# --- build_metadata ---------------------------------------------------------------------------
@pytest.fixture
def mixed_folder(tmp_path):
    folder = tmp_path / "data"
    write_image(folder / "square.png", (32, 32))
    write_image(folder / "wide.jpg", (96, 48))
    write_image(folder / "tall.webp", (40, 80))
    write_image(folder / "sub" / "rgba.png", (32, 32), "RGBA")
    write_image(folder / "sub" / "palette.png", (48, 32), "P")
    write_image(folder / "sub" / "grey.png", (32, 64), "L")
    write_image(folder / "cmyk.jpg", (64, 32), "CMYK")
    write_image(folder / "ñandú_写真.png", (32, 32))
    i16 = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)
    Image.fromarray(i16).save(folder / "deep.png")
    (folder / "square.txt").write_text("a square")
    return folder


def _add_bad_files(folder):
    (folder / "zero.png").write_bytes(b"")
    (folder / "truncated.png").write_bytes(png_bytes()[:20])
    (folder / "not_an_image.png").write_text("definitely not a png")


def test_build_metadata_sizes_buckets_and_captions(mixed_folder):
    config, cfg = scan_config(mixed_folder, instance_prompt="fallback")
    meta = build_metadata(LocalDataBackend(mixed_folder, "ds"), cfg, config, seed=3)
    assert meta.bad_files == []
    by_path = {s.path: s for s in meta.samples}
    assert len(by_path) == len(meta.samples) == 9
    wide = by_path["wide.jpg"]
    assert wide.original_size == (96, 48)
    assert wide.bucket == bucket_for(96, 48, 64, 16)
    assert wide.bucket[0] > wide.bucket[1]
    assert by_path["tall.webp"].bucket[1] > by_path["tall.webp"].bucket[0]
    assert by_path["square.png"].bucket == (64, 64)
    assert by_path["square.png"].caption == "a square"
    assert by_path["ñandú_写真.png"].key == "ds/ñandú_写真.png"
    assert meta.caption_sources == {"textfile": 1, "instance_prompt": 8}
    assert all(s.crop_style == "center" and s.dataset_id == "ds" for s in meta.samples)


def test_crop_seed_is_stable_and_depends_on_seed_and_key(mixed_folder):
    config, cfg = scan_config(mixed_folder)
    backend = LocalDataBackend(mixed_folder, "ds")
    first = {s.key: s.crop_seed for s in build_metadata(backend, cfg, config, seed=3).samples}
    again = {s.key: s.crop_seed for s in build_metadata(backend, cfg, config, seed=3).samples}
    other = {s.key: s.crop_seed for s in build_metadata(backend, cfg, config, seed=4).samples}
    assert first == again
    assert all(first[k] != other[k] for k in first)
    assert len(set(first.values())) == len(first)
    assert crop_seed_for(3, "ds/square.png") == first["ds/square.png"]  # pinned to sha256, not hash()
    assert all(0 <= v < 2**63 for v in first.values())


def test_repeats_multiply_samples(mixed_folder):
    config, cfg = scan_config(mixed_folder, repeats=2)
    meta = build_metadata(LocalDataBackend(mixed_folder, "ds"), cfg, config, seed=0)
    assert len(meta.samples) == 27
    assert all(n == 3 for n in Counter(s.key for s in meta.samples).values())


def test_bad_files_are_skipped_with_reasons(mixed_folder, caplog):
    _add_bad_files(mixed_folder)
    config, cfg = scan_config(mixed_folder, max_bad=0.5)
    with caplog.at_level(logging.WARNING):
        meta = build_metadata(LocalDataBackend(mixed_folder, "ds"), cfg, config, seed=0)
    reasons = dict(meta.bad_files)
    assert set(reasons) == {"zero.png", "truncated.png", "not_an_image.png"}
    assert "empty" in reasons["zero.png"]
    assert "header" in reasons["truncated.png"]
    assert "not a recognised image" in reasons["not_an_image.png"]
    assert len(meta.samples) == 9
    assert "skipped 3 of 12 image files as unreadable while scanning" in caplog.text and "zero.png" in caplog.text


def test_too_many_bad_files_raise_naming_the_limit(mixed_folder):
    _add_bad_files(mixed_folder)
    config, cfg = scan_config(mixed_folder, max_bad=0.1)
    with pytest.raises(ValueError) as info:
        build_metadata(LocalDataBackend(mixed_folder, "ds"), cfg, config, seed=0)
    message = str(info.value)
    assert "3 of 12" in message and "25.0%" in message
    assert "max_bad_image_fraction" in message and "0.1" in message
    assert "truncated.png" in message and "zero.png" in message and str(mixed_folder) in message


def test_all_files_bad_raises_even_when_allowed(tmp_path):
    _add_bad_files(tmp_path)
    config, cfg = scan_config(tmp_path, max_bad=1.0)
    with pytest.raises(ValueError, match="none of the 3 image files"):
        build_metadata(LocalDataBackend(tmp_path, "ds"), cfg, config, seed=0)


def test_empty_folder_names_the_folder(tmp_path):
    (tmp_path / "readme.txt").write_text("no images here")
    config, cfg = scan_config(tmp_path)
    with pytest.raises(ValueError, match="no images found under") as info:
        build_metadata(LocalDataBackend(tmp_path, "ds"), cfg, config, seed=0)
    assert str(tmp_path) in str(info.value) and ".webp" in str(info.value)


def test_dataset_resolution_overrides_global(mixed_folder):
    config, cfg = scan_config(mixed_folder, resolution=32)
    meta = build_metadata(LocalDataBackend(mixed_folder, "ds"), cfg, config, seed=0)
    assert {s.bucket for s in meta.samples if s.path == "square.png"} == {(32, 32)}


def test_scan_never_decodes_pixels(mixed_folder, monkeypatch):
    def no_decode(*args, **kwargs):
        raise AssertionError("build_metadata decoded an image")

    monkeypatch.setattr(Image.Image, "load", no_decode)
    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    config, cfg = scan_config(mixed_folder)
    meta = build_metadata(LocalDataBackend(mixed_folder, "ds"), cfg, config, seed=0)
    assert len(meta.samples) == 9
