"""Edit pairs on the data side: sources found by file name or by a caption table's column, refused when
missing, extra, ambiguous or of another shape; the source cut exactly like its image; cache keys that
follow the source file; and configs whose data does not fit the model refused before any scan."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from fakes import data_only_config
from PIL import Image

from simpletuner.caching.keys import PairedCaption, cache_keys, text_id
from simpletuner.configuration import load_config, validate_config
from simpletuner.data_backend import RegisteredDataset, build_local_backend, build_metadata
from simpletuner.data_backend.factory import load_sample_pixels
from simpletuner.data_backend.images import prepare_image
from simpletuner.data_backend.pairs import check_model_inputs, pixels_to_image, source_pixels
from simpletuner.testing.demo_data import write_edit_pairs


def _scan(dataset: dict, **top):
    cfg = validate_config({**data_only_config(dataset), **top}, check_files=False)
    ds_cfg = cfg.datasets[0]
    backend = build_local_backend(ds_cfg, cfg)
    return cfg, RegisteredDataset(ds_cfg.id, ds_cfg, backend, build_metadata(backend, ds_cfg, cfg, seed=cfg.seed))


@pytest.fixture
def pairs(tmp_path):
    return write_edit_pairs(tmp_path / "pairs", num_pairs=6)


def _entry(images, sources, **extra):
    return {
        "id": "edits",
        "type": "local",
        "instance_data_dir": str(images),
        "conditioning_data_dir": str(sources),
        **extra,
    }


def test_each_image_gets_the_source_of_its_name_with_any_extension(pairs):
    images, sources = pairs
    Image.open(sources / "002.png").save(sources / "002.jpg", quality=95)  # another extension, same name
    os.remove(sources / "002.png")
    _, ds = _scan(_entry(images, sources))
    got = {s.path: s.source for s in ds.samples}
    assert got == {f"{i:03d}.png": str(sources / f"{i:03d}{'.jpg' if i == 2 else '.png'}") for i in range(6)}
    assert {s.caption for s in ds.samples} >= {"make the circle green", "make the square blue"}


@pytest.mark.parametrize("fault", ["missing", "extra", "ambiguous"])
def test_unpaired_files_are_refused_by_name_before_anything_is_read(pairs, fault):
    images, sources = pairs
    if fault == "missing":
        os.remove(sources / "004.png")
        expected = r"1 image\(s\) have no source image in .*: 004.png"
    elif fault == "extra":
        shutil.copy(sources / "000.png", sources / "zz_stray.png")
        expected = r"1 source image\(s\) in .* have no image in .*: zz_stray.png"
    else:
        shutil.copy(sources / "001.png", sources / "001.webp")
        expected = r"several source images for one image name: 001.png and 001.webp"
    with pytest.raises(ValueError, match=expected) as err:
        _scan(_entry(images, sources))
    assert "dataset 'edits'" in str(err.value)


def test_a_source_of_another_shape_is_refused_one_of_another_size_is_resized(pairs):
    images, sources = pairs
    with Image.open(images / "000.png") as img:
        size = img.size
        img.resize((size[0] * 2, size[1] * 2), Image.Resampling.NEAREST).save(sources / "000.png")
    _, ds = _scan(_entry(images, sources))  # twice the size, same shape: fine
    sample = next(s for s in ds.samples if s.path == "000.png")
    # Resized to the image's size, the source is the image itself here (a nearest 2x blow-up scales back).
    target = load_sample_pixels(ds, sample)[0]
    assert target.shape[0] == 6 and float((target[3:] - target[:3]).abs().mean()) < 0.01

    Image.new("RGB", (size[0], size[1] * 2)).save(sources / "003.png")  # another aspect ratio
    with pytest.raises(ValueError, match=r"1 edit pair\(s\) cannot be used:\n  - 003.png: its source .* aspect ratios"):
        _scan(_entry(images, sources))


def test_the_source_gets_its_images_crop(pairs):
    images, sources = pairs
    # A random crop of a 96x64 image into a 64x64 bucket: the source must be cut at the same offset.
    _, ds = _scan(_entry(images, sources, crop=True, crop_style="random", crop_aspect="square"))
    sample = next(s for s in ds.samples if s.original_size == (96, 64))
    pixels, info = load_sample_pixels(ds, sample)
    assert pixels.shape == (6, 64, 64) and sample.bucket == (64, 64)
    with Image.open(sample.source) as source:
        want, want_info = prepare_image(source.convert("RGB"), sample.bucket, "random", sample.crop_seed)
    assert want_info["crop_left"] == info["crop_left"] and torch.equal(pixels[3:], want)
    assert torch.equal(pixels[3:], source_pixels(sample))
    # The PIL image the text encoder sees is exactly those pixels.
    assert torch.equal(prepare_image(pixels_to_image(pixels[3:]), (64, 64), "center", 0)[0], pixels[3:])


def test_a_caption_table_names_the_sources(pairs, tmp_path):
    images, sources = pairs
    rows = [{"file": f"{i:03d}", "instruction": f"edit {i}", "before": f"{i:03d}.png"} for i in range(6)]
    rows[5]["before"] = str(sources / "005.png")  # absolute paths work too
    table = tmp_path / "pairs.jsonl"
    table.write_text("\n".join(json.dumps(r) for r in rows))
    spec = {
        "path": str(table),
        "filename_column": "file",
        "caption_column": "instruction",
        "conditioning_column": "before",
    }
    entry = _entry(images, sources, caption_strategy="jsonl", jsonl=spec)
    _, ds = _scan(entry)
    assert {s.path: (s.caption, s.source) for s in ds.samples} == {
        f"{i:03d}.png": (f"edit {i}", str(sources / f"{i:03d}.png")) for i in range(6)
    }
    rows[1]["before"] = None
    rows[2]["before"] = "nope.png"
    table.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError) as err:
        _scan(entry)
    message = str(err.value)
    assert "1 captioned image(s) have no `before` value: 001.png" in message
    assert "1 source image(s) named there are not files: 002.png -> " in message and "nope.png" in message


class _Identities:
    """The encoder identities cache keys need, without a model."""

    conditions_on_size_crop = False  # no size/crop beside the latents (SDXL's)
    prompt_sees_source = True  # Qwen-Image-Edit's prompt embedding sees the source (Flux Kontext's does not)

    def __init__(self, config):
        self.config = config

    def image_encoder_identity(self):
        return "vae"

    def text_encoder_identity(self):
        return "text"


def test_cache_keys_follow_the_source(pairs):
    images, sources = pairs
    cfg, ds = _scan(_entry(images, sources))

    keys = cache_keys(_Identities(cfg), [ds], torch.float32)
    sample = ds.samples[0]
    assert text_id(sample) == PairedCaption(sample.caption, sample.key) and text_id(sample) in keys.texts
    assert len(keys.texts) == len(ds.samples)  # one embedding per pair, even for a shared caption
    # The source rewritten: the latent and the prompt embedding of that pair (only) are new entries.
    stat = os.stat(sample.source)
    os.utime(sample.source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    again = cache_keys(_Identities(cfg), [ds], torch.float32)
    changed = {k for k in keys.latents if keys.latents[k] != again.latents[k]}
    assert changed == {sample.key}
    assert {t for t in keys.texts if keys.texts[t] != again.texts[t]} == {text_id(sample)}


def test_each_line_of_a_pairs_caption_file_is_embedded_with_its_source(pairs):
    images, sources = pairs
    (images / "000.txt").write_text("make the circle green\nturn the circle green\n")
    cfg, ds = _scan(_entry(images, sources))

    sample = next(s for s in ds.samples if s.path == "000.png")
    assert sample.caption_lines == ("make the circle green", "turn the circle green")
    keys = cache_keys(_Identities(cfg), [ds], torch.float32)
    assert {PairedCaption(line, sample.key) for line in sample.caption_lines} <= set(keys.texts)
    assert len(keys.texts) == len(ds.samples) + 1  # the second line of 000.png is one more (caption, source) entry


def test_data_that_does_not_fit_the_model_is_refused_before_a_scan(make_config, pairs, tmp_path):
    from simpletuner.models import get_model_spec

    images, sources = pairs
    cfg = validate_config(make_config(datasets=[_entry(images, sources)], validation_image=str(sources / "000.png")))
    with pytest.raises(ValueError) as err:
        check_model_inputs(get_model_spec(cfg), cfg)
    message = str(err.value)
    assert "dataset(s) 'edits' name source images" in message and "not an edit model" in message
    assert "validation_image is set, but the model" in message


def test_paths_are_read_from_the_config_files_folder(pairs, tiny_sd, tmp_path):
    images, sources = pairs
    config = {
        "pretrained_model_name_or_path": str(tiny_sd),
        "max_train_steps": 1,
        "resolution": 64,
        "validation_prompt": "a",
        "validation_image": ["pairs/sources/000.png"],
        "datasets": [
            {"id": "e", "type": "local", "instance_data_dir": "pairs/images", "conditioning_data_dir": "pairs/sources"}
        ],
    }
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config))
    cfg = load_config(str(path)).config
    assert cfg.datasets[0].conditioning_data_dir == str(sources) and cfg.validation_image == [str(sources / "000.png")]
    config["datasets"][0]["conditioning_data_dir"] = "pairs/nowhere"
    config["validation_image"] = ["pairs/sources/000.png", "pairs/sources/001.png"]  # 2 images, 1 prompt
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        load_config(str(path))
    assert "validation_image lists 2 images for 1 validation prompt(s)" in str(err.value)
    config["validation_image"] = "pairs/sources/nothing.png"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        load_config(str(path))
    assert "conditioning_data_dir" in str(err.value) and "nowhere is not a folder" in str(err.value)
    assert "nothing.png is not a file" in str(err.value)
