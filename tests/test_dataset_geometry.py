"""Dataset geometry (SimpleTuner's crop / resolution_type / size keys): buckets, crop windows, filters.

Expected buckets are worked out by hand in each test from SimpleTuner's formulas (DATALOADER.md,
OPTIONS.md and its multiaspect code), written out in the comments: the aspect ratio rounded to two
decimals, each side rounded to the nearest multiple of the alignment.
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fakes import data_only_config
from PIL import Image

from simpletuner.caching.vae_cache import latent_cache_key, sample_latent_key
from simpletuner.configuration import ConfigError, validate_config
from simpletuner.data_backend import LocalDataBackend, bucket_for, build_metadata, prepare_image
from simpletuner.data_backend.geometry import Geometry, geometry_for


def geometry(resolution, resolution_type=None, crop=None, alignment=64, **rest) -> Geometry:
    """The Geometry a dataset entry with these keys gets (through the real config validation)."""
    entry = {"id": "ds", "type": "local", "instance_data_dir": "/unused", "resolution": resolution}
    entry.update({k: v for k, v in {"resolution_type": resolution_type, "crop": crop}.items() if v is not None})
    entry.update(rest)
    raw = data_only_config(entry)
    raw["aspect_bucket_alignment"] = alignment
    raw["resolution"] = 64 if alignment <= 64 else alignment
    config = validate_config(raw, check_files=False)
    return geometry_for(config.datasets[0], config)


def bucket(g: Geometry, width: int, height: int, seed: int = 0) -> tuple[int, int]:
    return g.plan(width, height, seed).bucket


def config_problems(**dataset) -> str:
    entry = {"id": "ds", "type": "local", "instance_data_dir": "/unused", **dataset}
    with pytest.raises(ConfigError) as caught:
        validate_config(data_only_config(entry), check_files=False)
    return str(caught.value)


def gradient(size) -> Image.Image:
    """An image whose every pixel differs from its neighbours (so a crop one pixel off is caught)."""
    w, h = size
    x = np.arange(w)[None, :].repeat(h, 0)
    y = np.arange(h)[:, None].repeat(w, 1)
    return Image.fromarray(np.stack([(x * 7) % 256, (y * 5) % 256, (x + y) % 256], -1).astype(np.uint8))


def expected_pixels(image: Image.Image, resized: tuple[int, int], box: tuple[int, int, int, int]) -> torch.Tensor:
    """What the crop should hold: the image resized (same filter as prepare_image) and cut at ``box``."""
    scale_down = resized[0] < image.size[0]
    resample = Image.Resampling.LANCZOS if scale_down else Image.Resampling.BICUBIC
    out = image.resize(resized, resample=resample, reducing_gap=3.0 if scale_down else None).crop(box)
    return torch.from_numpy(np.asarray(out, dtype=np.uint8).copy()).permute(2, 0, 1).float().div(127.5).sub(1.0)


# --- today's behaviour is untouched ------------------------------------------------------------------


@pytest.mark.parametrize("size", [(800, 600), (600, 800), (512, 512), (1920, 1080), (4000, 300)])
def test_unset_crop_and_resolution_type_is_the_native_bucket(size):
    g = geometry(1024, minimum_aspect_ratio=0.01)  # other keys do not switch the bucket rule
    assert g.is_native
    assert g.plan(*size, crop_seed=5).bucket == bucket_for(*size, 1024, 64)
    assert g.plan(*size, crop_seed=5).canvas is None


# --- resolution_type and crop_aspect: buckets ----------------------------------------------------------


def test_square_crop_at_pixel_512_puts_every_image_in_512x512():
    g = geometry(512, "pixel", crop=True, crop_aspect="square")
    for size in [(800, 600), (600, 800), (512, 512), (300, 200), (4000, 1000)]:
        assert bucket(g, *size) == (512, 512)


def test_crop_true_defaults_to_square_and_pixel_area():
    g = geometry(1024, crop=True)
    assert (g.unit, g.crop_aspect) == ("pixel_area", "square")
    assert bucket(g, 1500, 1000) == (1024, 1024)


def test_preserve_at_pixel_area_1024_gives_simpletuners_aspect_buckets():
    g = geometry(1024, "pixel_area", crop=True, crop_aspect="preserve")
    # 1216x832: aspect round(1.4615, 2) = 1.46, sqrt = 1.2083; 1024*1.2083 = 1237.3 -> 19.33*64 -> 1216;
    # 1024/1.2083 = 847.5 -> 13.24*64 -> 832 (OPTIONS.md lists 1024x1024, 1216x832, 832x1216 for 1024).
    assert bucket(g, 1216, 832) == (1216, 832)
    # 832x1216: aspect 0.68, sqrt 0.8246: 844.4 -> 13.19 -> 832; 1241.8 -> 19.40 -> 1216.
    assert bucket(g, 832, 1216) == (832, 1216)
    # 3:2: sqrt(1.5) = 1.2247: 1254.1 -> 19.60 -> 1280; 836.1 -> 13.06 -> 832.
    assert bucket(g, 1500, 1000) == (1280, 832)
    # 16:9 (1.78): sqrt 1.3342: 1366.2 -> 21.35 -> 1344; 767.5 -> 11.99 -> 768.
    assert bucket(g, 1920, 1080) == (1344, 768)
    assert bucket(g, 2000, 2000) == (1024, 1024)
    # crop: false buckets the same way (only the overshoot is cropped in both).
    assert bucket(geometry(1024, "pixel_area", crop=False), 1920, 1080) == (1344, 768)


def test_simpletuner_rounding_differs_from_the_native_search_for_some_aspects():
    # 1677x1024 at 1024: aspect round(1.6377, 2) = 1.64, sqrt 1.2806; 1024*1.2806 = 1311.4 -> 20.49*64 -> 1280;
    # 1024/1.2806 = 799.6 -> 12.49 -> 768.  The native search keeps the aspect closer: 1344x832 (1.615).
    g = geometry(1024, "pixel_area", crop=False)
    assert bucket(g, 1677, 1024) == (1280, 768)
    assert bucket_for(1677, 1024, 1024, 64) == (1344, 832)


def test_area_one_megapixel():
    g = geometry(1.0, "area", crop=False)
    # Square side: sqrt(1e6) = 1000 -> 15.625*64 -> 1024; 1.0 MP also snaps squares to 1024.
    assert bucket(g, 3000, 3000) == (1024, 1024)
    # 3:2 from edge 1024: 1280x832, as pixel_area 1024.
    assert bucket(g, 1500, 1000) == (1280, 832)


def test_area_half_megapixel_keeps_simpletuners_square_snap():
    g = geometry(0.5, "area", crop=False)
    # Edge: int(sqrt(5e5)) = 707 -> 11.05*64 -> 704; 3:2: 704*1.2247 = 862.2 -> 13.47 -> 832;
    # 704/1.2247 = 574.8 -> 8.98 -> 576.  A square bucket snaps 0.5 MP to 768x768.
    assert bucket(g, 1500, 1000) == (832, 576)
    assert bucket(g, 1000, 1000) == (768, 768)


def test_pixel_keeps_the_shorter_side_and_rounds_the_other():
    g = geometry(1024, "pixel", crop=False)
    # Landscape 16:9: aspect 1.78; height 1024, width int(1024*1.78) = 1822 -> 28.47*64 -> 1792.
    assert bucket(g, 1920, 1080) == (1792, 1024)
    # Portrait: aspect 0.56; width 1024, height int(1024/0.56) = 1828 -> 28.56*64 -> 1856.
    assert bucket(g, 1080, 1920) == (1024, 1856)
    # Near square (aspect 1.02): 1044 -> 16.3 -> 1024: a square bucket is resolution x resolution.
    assert bucket(g, 1020, 1000) == (1024, 1024)


def test_closest_takes_the_nearest_listed_aspect():
    g = geometry(512, "pixel_area", crop=True, crop_aspect="closest", crop_aspect_buckets=[0.75, 1.0, 1.5])
    # 1.25 is as far from 1.0 as from 1.5: the first listed wins -> the square, 512x512.
    assert bucket(g, 1000, 800) == (512, 512)
    # 1.4 -> 1.5: 512*1.2247 = 627.1 -> 9.80 -> 640; 418.0 -> 6.53 -> 448.
    assert bucket(g, 1400, 1000) == (640, 448)
    # 0.6 -> 0.75: sqrt 0.8660: 443.4 -> 6.93 -> 448; 591.2 -> 9.24 -> 576.
    assert bucket(g, 600, 1000) == (448, 576)


def test_random_draws_from_the_list_by_weight_and_is_fixed_per_seed():
    weighted = [{"aspect": 1.0, "weight": 0.8}, {"aspect": 1.5, "weight": 0.2}]
    g = geometry(512, "pixel_area", crop=True, crop_aspect="random", crop_aspect_buckets=weighted)
    draws = [bucket(g, 700, 700, seed) for seed in range(2000)]
    assert set(draws) == {(512, 512), (640, 448)}
    assert abs(draws.count((640, 448)) / len(draws) - 0.2) < 0.04
    assert [bucket(g, 700, 700, seed) for seed in range(50)] == draws[:50]  # same seed, same bucket

    uniform = geometry(512, "pixel_area", crop=True, crop_aspect="random", crop_aspect_buckets=[0.75, 1.5])
    draws = [bucket(uniform, 700, 700, seed) for seed in range(2000)]
    assert set(draws) == {(448, 576), (640, 448)}
    assert abs(draws.count((640, 448)) / len(draws) - 0.5) < 0.05


# --- crop windows ----------------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["center", "corner", "random"])
def test_crop_window_of_each_style(style):
    image = gradient((200, 120))
    target = (64, 64)
    # Cover: scale max(64/200, 64/120) = 0.5333 -> 106.67 -> 107 x 64; the window is 64 wide.
    resized = (107, 64)
    pixels, info = prepare_image(image, target, style, crop_seed=11)
    left = {"center": (107 - 64) // 2, "corner": 0}.get(style, info["crop_left"])
    assert 0 <= left <= 107 - 64 and info["crop_top"] == 0 and info["crop_left"] == left
    assert torch.allclose(pixels, expected_pixels(image, resized, (left, 0, left + 64, 64)))
    if style == "random":
        again, info2 = prepare_image(image, target, style, crop_seed=11)
        assert torch.equal(pixels, again) and info2 == info


def test_corner_is_accepted_in_config_and_reaches_the_samples(tmp_path):
    Image.new("RGB", (48, 32), "red").save(tmp_path / "a.png")
    entry = {"id": "ds", "type": "local", "instance_data_dir": str(tmp_path), "crop_style": "corner"}
    config = validate_config(data_only_config(entry), check_files=False)
    meta = build_metadata(LocalDataBackend(tmp_path, "ds"), config.datasets[0], config, seed=0)
    assert {s.crop_style for s in meta.samples} == {"corner"}


# --- maximum_image_size / target_downsample_size -------------------------------------------------------


def test_large_images_are_downsampled_to_the_target_before_the_crop_pixel():
    g = geometry(512, "pixel", crop=True, maximum_image_size=1024, target_downsample_size=768)
    plan = g.plan(2000, 1500, 0)
    # 2000 > 1024: shorter side to 768 -> scale 768/1500 = 0.512 -> 1024 x 768; bucket 512x512.
    assert plan == type(plan)((512, 512), (1024, 768))
    assert g.plan(1000, 800, 0).canvas is None  # not above the maximum: just cover the bucket
    image = gradient((2000, 1500))
    pixels, info = prepare_image(image, plan.bucket, "center", 0, plan.canvas)
    assert (info["crop_left"], info["crop_top"]) == ((1024 - 512) // 2, (768 - 512) // 2)
    assert torch.allclose(pixels, expected_pixels(image, (1024, 768), (256, 128, 768, 640)))


def test_downsample_in_area_units():
    g = geometry(512, "pixel_area", crop=True, maximum_image_size=1024, target_downsample_size=768)
    # 2048x1536 = 3.1 M px > 1024² = 1.05 M: area to 768²: scale sqrt(589824 / 3145728) = 0.43301.
    scale = math.sqrt(768**2 / (2048 * 1536))
    assert g.plan(2048, 1536, 0).canvas == (round(2048 * scale), round(1536 * scale)) == (887, 665)
    assert g.plan(1000, 1000, 0).canvas is None  # 1.0 M px is not above 1024²

    mp = geometry(0.25, "area", crop=True, maximum_image_size=2.0, target_downsample_size=1.0)
    scale = math.sqrt(1e6 / (3000 * 2000))
    assert mp.plan(3000, 2000, 0).canvas == (round(3000 * scale), round(2000 * scale))
    assert mp.plan(1500, 1000, 0).canvas is None  # 1.5 MP is not above 2.0


def test_downsample_is_ignored_with_crop_false_as_in_simpletuner():
    g = geometry(512, "pixel", crop=False, maximum_image_size=1024, target_downsample_size=768)
    assert g.plan(2000, 1500, 0).canvas is None


def test_a_downsampled_image_gets_its_own_latent_key(tmp_path):
    Image.new("RGB", (96, 64), "red").save(tmp_path / "a.png")
    backend = LocalDataBackend(tmp_path, "ds")
    keys = []
    for extra in ({}, {"crop": True, "maximum_image_size": 80, "target_downsample_size": 72}):
        entry = {"id": "ds", "type": "local", "instance_data_dir": str(tmp_path), "resolution_type": "pixel"}
        config = validate_config(data_only_config({**entry, **extra}), check_files=False)
        ds = config.datasets[0]
        (sample,) = build_metadata(backend, ds, config, seed=0).samples
        keys.append(sample_latent_key(SimpleNamespace(backend=backend, config=ds), sample, "vae", 64))
        if extra:  # crop true (square at 64) with a canvas: 96 > 80, shorter side to 72 -> 108x72
            assert (sample.bucket, sample.canvas) == ((64, 64), (108, 72))
        else:
            # pixel 64, aspect 1.5: 96 -> 6*16 = 96 x 64, no canvas
            assert (sample.bucket, sample.canvas) == ((96, 64), None)
    assert keys[0] != keys[1]
    # Without a canvas the key is what it was before these settings existed (old caches stay valid).
    entry = {"id": "ds", "type": "local", "instance_data_dir": str(tmp_path)}
    config = validate_config(data_only_config(entry), check_files=False)
    ds = config.datasets[0]
    (sample,) = build_metadata(backend, ds, config, seed=0).samples
    assert sample.canvas is None
    assert sample_latent_key(SimpleNamespace(backend=backend, config=ds), sample, "vae", 64) == latent_cache_key(
        sample_key=sample.key,
        file_identity=backend.identity("a.png"),
        bucket=sample.bucket,
        crop={"style": "center", "seed": sample.crop_seed},
        resolution=64,
        encoder_identity="vae",
        dtype="float32",
    )


# --- size and aspect filters -----------------------------------------------------------------------------


def test_minimum_image_size_in_each_unit():
    pixel = geometry(512, "pixel", minimum_image_size=512)
    assert pixel.is_below_minimum(1000, 500) and not pixel.is_below_minimum(600, 512)
    native = geometry(512, minimum_image_size=512)  # unset resolution_type: the shorter side, as before
    assert native.is_below_minimum(1000, 500) and not native.is_below_minimum(600, 512)

    area = geometry(0.25, "area", crop=False, minimum_image_size=0.25)  # 250000 px of area
    assert area.is_below_minimum(600, 400)  # 240000
    assert not area.is_below_minimum(700, 400)  # 280000
    assert not area.is_below_minimum(1000, 300)  # 300000: no side rule without a square crop
    square = geometry(0.25, "area", crop=True, crop_aspect="square", minimum_image_size=0.25)
    assert square.is_below_minimum(1000, 300)  # shorter side 300 < floor(sqrt(250000)) = 500

    pixel_area = geometry(512, "pixel_area", crop=False, minimum_image_size=512)  # 512² = 262144 px
    assert pixel_area.is_below_minimum(600, 400)  # 240000
    assert not pixel_area.is_below_minimum(700, 400)  # 280000


def write_images(folder, sizes):
    folder.mkdir(parents=True, exist_ok=True)
    for index, size in enumerate(sizes):
        gradient(size).save(folder / f"img_{index:02d}.png")
    return folder


def scan(folder, seed=0, **dataset):
    entry = {"id": "ds", "type": "local", "instance_data_dir": str(folder), **dataset}
    config = validate_config(data_only_config(entry), check_files=False)
    return build_metadata(LocalDataBackend(folder, "ds"), config.datasets[0], config, seed=seed)


def test_aspect_ratio_filter_skips_and_counts(tmp_path, caplog):
    folder = write_images(tmp_path / "d", [(40, 100), (64, 64), (64, 64), (140, 40)])  # 0.4, 1, 1, 3.5
    with caplog.at_level(logging.WARNING, logger="simpletuner.data_backend.metadata"):
        meta = scan(folder, minimum_aspect_ratio=0.5, maximum_aspect_ratio=3.0)
    assert {s.original_size for s in meta.samples} == {(64, 64)}
    assert meta.num_skipped_small == {"minimum_aspect_ratio": 1, "maximum_aspect_ratio": 1}
    assert "1 of 4 image files with an aspect ratio (width / height) below minimum_aspect_ratio 0.5" in caplog.text
    assert "1 of 4 image files with an aspect ratio (width / height) above maximum_aspect_ratio 3.0" in caplog.text


@pytest.mark.parametrize(
    "dataset,threshold,largest,fix",
    [
        (
            {"minimum_image_size": 100},
            "shorter side below minimum_image_size 100 px",
            "shorter side 48 px",
            "at most 48",
        ),
        (
            {"resolution_type": "pixel_area", "minimum_image_size": 100},
            "area below minimum_image_size 100² px (10000 px",
            "area 3840 px",
            "at most 61",  # isqrt(80 * 48)
        ),
        (
            {"resolution_type": "area", "resolution": 0.25, "minimum_image_size": 0.01},
            "area below minimum_image_size 0.01 megapixels (10000 px)",
            "0.00384 megapixels",
            "at most 0.0038",
        ),
    ],
)
def test_a_minimum_that_removes_every_image_stops_with_reason_and_fix(tmp_path, dataset, threshold, largest, fix):
    folder = write_images(tmp_path / "d", [(32, 32), (80, 48), (40, 30)])
    with pytest.raises(ValueError) as caught:
        scan(folder, **dataset)
    message = str(caught.value)
    assert "every image under" in message and "3 of 3 image files with" in message
    assert threshold in message
    assert "the largest is img_01.png (80x48" in message and largest in message
    assert f"lower `minimum_image_size` to {fix}" in message


# --- end to end: a folder of real PNGs ---------------------------------------------------------------------


SIZES = [(96, 64), (96, 64), (64, 96), (64, 64), (200, 50), (50, 40)]


def test_scan_buckets_for_each_way(tmp_path):
    folder = write_images(tmp_path / "d", SIZES)

    def counts(**dataset):
        meta = scan(folder, allow_upscale=True, **dataset)
        return {s.original_size: s.bucket for s in meta.samples}, len(meta.samples)

    # Native (today): bucket_for at resolution 64, alignment 16.
    native, n = counts()
    assert n == 6 and native == {size: bucket_for(*size, 64, 16) for size in SIZES}

    # Square crop, pixel 64: every image 64x64.
    square, _ = counts(crop=True, resolution_type="pixel")
    assert set(square.values()) == {(64, 64)}

    # Preserve at pixel_area 64 (edge 64, alignment 16):
    # 1.5: 64*1.2247 = 78.4 -> 4.90*16 -> 80; 52.3 -> 3.27 -> 48        -> 80x48
    # 0.67: sqrt .8185: 52.4 -> 3.27 -> 48; 78.2 -> 4.89 -> 80           -> 48x80
    # 4.0: 128 x 32;  1.25: sqrt 1.1180: 71.6 -> 4.47 -> 64; 57.2 -> 3.58 -> 64: square -> 64x64
    preserve, _ = counts(crop=True, crop_aspect="preserve")
    assert preserve == {(96, 64): (80, 48), (64, 96): (48, 80), (64, 64): (64, 64), (200, 50): (128, 32),
                        (50, 40): (64, 64)}  # fmt: skip
    assert counts(crop=False)[0] == preserve  # crop: false buckets alike (resolution_type pixel_area)

    # Filters together: min side 60 px drops 200x50 and 50x40; max aspect 1.4 drops 96x64.
    meta = scan(folder, minimum_image_size=60, maximum_aspect_ratio=1.4)
    assert sorted(s.original_size for s in meta.samples) == [(64, 64), (64, 96)]
    assert meta.num_skipped_small == {"minimum_image_size": 2, "maximum_aspect_ratio": 2}


# --- config rules --------------------------------------------------------------------------------------


def test_fractional_resolution_needs_area():
    assert "resolution 1.5 is not a whole number of pixels" in config_problems(resolution=1.5)
    assert "needs resolution_type 'area'" in config_problems(resolution=1.5)
    ok = validate_config(
        data_only_config(
            {"id": "d", "type": "local", "instance_data_dir": "/x", "resolution_type": "area", "resolution": 1.05}
        ),  # fmt: skip
        check_files=False,
    )
    assert ok.datasets[0].resolution == 1.05
    native = validate_config(
        data_only_config({"id": "d", "type": "local", "instance_data_dir": "/x", "resolution": 64.0}),
        check_files=False,
    )
    assert native.datasets[0].resolution == 64 and isinstance(native.datasets[0].resolution, int)


@pytest.mark.parametrize(
    "dataset,expected",
    [
        ({"resolution_type": "area"}, "resolution_type 'area' needs this dataset's `resolution` in megapixels"),
        ({"resolution_type": "area", "resolution": 1024}, "more than 64 megapixels reads as pixels"),
        ({"crop_aspect": "square"}, "crop_aspect applies only with `crop: true`, and crop is unset"),
        ({"crop": True, "crop_aspect": "closest"}, "crop_aspect 'closest' needs `crop_aspect_buckets`"),
        ({"crop": True, "crop_aspect_buckets": [1.0]}, "crop_aspect_buckets is used by crop_aspect 'closest'"),
        (
            {"crop": True, "crop_aspect": "random", "crop_aspect_buckets": [{"aspect": 1, "weight": 0.5}]},
            "add up to 0.5; they must add up to 1",
        ),
        ({"crop": True, "maximum_image_size": 1024}, "set target_downsample_size too"),
        (
            {"crop": True, "maximum_image_size": 512, "target_downsample_size": 1024},
            "target_downsample_size 1024 is larger than maximum_image_size 512",
        ),
        ({"minimum_aspect_ratio": 2, "maximum_aspect_ratio": 0.5}, "minimum_aspect_ratio 2.0 is above maximum"),
        ({"minimum_image_size": 0.5}, "minimum_image_size 0.5 is not a whole number of pixels"),
    ],
)
def test_config_rules(dataset, expected):
    assert expected in config_problems(**dataset)


def test_crop_false_accepts_simpletuners_ignored_keys():
    entry = {
        "id": "d",
        "type": "local",
        "instance_data_dir": "/x",
        "crop": False,
        "crop_aspect": "square",
        "maximum_image_size": 480,
        "target_downsample_size": 480,
        "resolution": 64,
    }
    validate_config(data_only_config(entry), check_files=False)
