"""Captions as SimpleTuner means them: a caption file of several lines is one caption per line, one line per draw
(unless `disable_multiline_split`), and `caption_strategy: filename` keeps the file name (`_` as spaces). The
expected captions are figures computed once by running SimpleTuner's own functions (simpletuner/helpers/prompts.py
at bc8e6ab7) on the inputs below; the draws, their resume and the text cache run on the tiny SD model."""

from __future__ import annotations

import logging
import math
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from fakes import data_only_config
from PIL import Image
from training_helpers import cached_data, resumed_batches, training_sampler

from simpletuner.caching.keys import DROPPED_CAPTION, cache_keys
from simpletuner.configuration import ConfigError, validate_config
from simpletuner.data_backend import LocalDataBackend, build_datasets, build_metadata
from simpletuner.data_backend.captions import caption_line_index

CPU = torch.device("cpu")

#: A caption file's text -> the captions SimpleTuner trains it as: ``prepare_instance_prompt_from_textfile`` splits it
#: at "\n" and drops empty strings (prompts.py:418-422), and its caption cache keeps each value stripped, empty ones
#: dropped (``_normalize_caption_payload``, prompts.py:274-283, called from ``get_all_captions``, prompts.py:805).
#: Computed once by running those two functions on these texts.
SIMPLETUNER_LINES = {
    "first caption line\nsecond caption line\nthird caption line": (
        "first caption line",
        "second caption line",
        "third caption line",
    ),
    "a cat on a mat\n": ("a cat on a mat",),
    "  a red box \n\n   \nblue sky at dusk\r\n\n": ("a red box", "blue sky at dusk"),
    "one\r\ntwo\r\n": ("one", "two"),
    "  just one  ": ("just one",),
}
#: The same texts with ``disable_multiline_split: true`` (the whole file, normalised the same way).
SIMPLETUNER_WHOLE = {
    "first caption line\nsecond caption line\nthird caption line": (
        "first caption line\nsecond caption line\nthird caption line"
    ),
    "a cat on a mat\n": "a cat on a mat",
    "  a red box \n\n   \nblue sky at dusk\r\n\n": "a red box \n\n   \nblue sky at dusk",
    "one\r\ntwo\r\n": "one\r\ntwo",
    "  just one  ": "just one",
}
#: ``prepend_instance_prompt`` with ``instance_prompt: "sks"`` on the three-line file: each line gets it
#: (prompts.py:425-428).
SIMPLETUNER_PREPENDED = ("sks first caption line", "sks second caption line", "sks third caption line")


def write_image(path: Path, size=(32, 32), value=128) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size[1], size[0], 3), value, dtype=np.uint8)).save(path)
    return path


def scan(folder: Path, **dataset):
    entry = {"id": "ds", "type": "local", "instance_data_dir": str(folder), **dataset}
    config = validate_config(data_only_config(entry), check_files=False)
    return build_metadata(LocalDataBackend(folder, "ds"), config.datasets[0], config, seed=0)


# --- the lines of a caption file ------------------------------------------------------------------------------
@pytest.mark.parametrize("text", sorted(SIMPLETUNER_LINES))
def test_a_caption_file_gives_simpletuners_lines(tmp_path, text):
    write_image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes(text.encode("utf-8"))
    (sample,) = scan(tmp_path).samples
    assert sample.captions == SIMPLETUNER_LINES[text]
    assert sample.caption == SIMPLETUNER_LINES[text][0]
    assert sample.caption_lines == (SIMPLETUNER_LINES[text] if len(SIMPLETUNER_LINES[text]) > 1 else ())
    (whole,) = scan(tmp_path, disable_multiline_split=True).samples
    assert whole.captions == (SIMPLETUNER_WHOLE[text],) and whole.caption_lines == ()


def test_prepend_goes_before_each_line(tmp_path):
    write_image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("first caption line\nsecond caption line\nthird caption line")
    (sample,) = scan(tmp_path, instance_prompt="sks", prepend_instance_prompt=True).samples
    assert sample.captions == SIMPLETUNER_PREPENDED


def test_only_caption_files_are_split(tmp_path):
    write_image(tmp_path / "a_b.png")
    (tmp_path / "a_b.txt").write_text("one\ntwo")
    assert scan(tmp_path, caption_strategy="filename").samples[0].captions == ("a b",)
    instance = scan(tmp_path, caption_strategy="instance_prompt", instance_prompt="x\ny").samples[0]
    assert instance.captions == ("x\ny",)


def test_the_scan_says_once_how_many_files_have_several_lines(tmp_path, caplog):
    for name, text in [("a", "one\ntwo"), ("b", "single line\n"), ("c", "x\ny\nz")]:
        write_image(tmp_path / f"{name}.png")
        (tmp_path / f"{name}.txt").write_text(text)
    with caplog.at_level(logging.INFO):
        scan(tmp_path)
    notes = [r.getMessage() for r in caplog.records if "several lines" in r.getMessage()]
    assert len(notes) == 1 and r"dataset 'ds': 2 of 3 caption files have several lines" in notes[0]
    assert "a.txt (2 lines)" in notes[0] and "disable_multiline_split: true" in notes[0]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        scan(tmp_path, disable_multiline_split=True)
    assert "several lines" not in caplog.text


def test_the_key_is_a_bool_on_every_dataset_type(tmp_path):
    entry = {"id": "ds", "type": "local", "instance_data_dir": str(tmp_path)}
    assert validate_config(data_only_config(entry), check_files=False).datasets[0].disable_multiline_split is False
    with pytest.raises(ConfigError, match="disable_multiline_split"):
        validate_config(data_only_config({**entry, "disable_multiline_split": "sometimes"}), check_files=False)


# --- caption_strategy: filename -------------------------------------------------------------------------------
def test_filename_says_once_where_it_differs_from_the_cleaned_text(tmp_path, caplog):
    for name in ("IMG_2031.jpg", "red_cat-on_mat_001.png", "blue_sky.png"):
        write_image(tmp_path / name)
    with caplog.at_level(logging.INFO):
        meta = scan(tmp_path, caption_strategy="filename")
    # SimpleTuner's figures: see tests/test_data_backend_metadata.py SIMPLETUNER_FILENAME_CAPTIONS.
    assert {s.path: s.caption for s in meta.samples} == {
        "IMG_2031.jpg": "IMG 2031",
        "red_cat-on_mat_001.png": "red cat-on mat 001",
        "blue_sky.png": "blue sky",
    }
    assert meta.caption_sources == {"filename": 3}
    notes = [r.getMessage() for r in caplog.records if "filename_cleaned" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("dataset 'ds': caption_strategy `filename`")
    assert "2 of 3 captions keep" in notes[0] and "IMG_2031.jpg -> 'IMG 2031'" in notes[0] and "('IMG')" in notes[0]

    caplog.clear()
    with caplog.at_level(logging.INFO):
        cleaned = scan(tmp_path, caption_strategy="filename_cleaned")
    assert {s.caption for s in cleaned.samples} == {"IMG", "red cat on mat", "blue sky"}
    assert cleaned.caption_sources == {"filename_cleaned": 3} and "filename_cleaned" not in caplog.text


def test_filename_says_nothing_where_both_agree(tmp_path, caplog):
    write_image(tmp_path / "blue_sky.png")
    with caplog.at_level(logging.INFO):
        scan(tmp_path, caption_strategy="filename")
    assert "filename_cleaned" not in caplog.text


# --- one line per draw ------------------------------------------------------------------------------------------
def test_the_line_draw_is_a_pure_uniform_function_of_seed_place_and_sample():
    n, lines = 12000, 3
    draws = [caption_line_index(7, i // 400, i % 400, i % 2, f"ds/{i % 11}.png", lines) for i in range(n)]
    assert draws[:300] == [
        caption_line_index(7, i // 400, i % 400, i % 2, f"ds/{i % 11}.png", lines) for i in range(300)
    ]
    assert draws[:300] != [
        caption_line_index(8, i // 400, i % 400, i % 2, f"ds/{i % 11}.png", lines) for i in range(300)
    ]
    counts = Counter(draws)
    assert set(counts) == {0, 1, 2}
    for count in counts.values():
        assert abs(count - n / lines) <= 4 * math.sqrt(n * (1 / lines) * (1 - 1 / lines))
    assert caption_line_index(7, 0, 0, 0, "k", 1) == 0


def _multiline_data(shapes_dir: Path, tmp_path: Path) -> Path:
    """The shapes set with three images captioned by a file of several lines."""
    data = tmp_path / "data"
    shutil.copytree(shapes_dir, data)
    (data / "000.txt").write_text("a red circle\na round red shape\nzxq style circle\n")
    (data / "001.txt").write_text("a blue square\n\nsquare, blue, flat\n")
    (data / "005.txt").write_text("  one more line \nand another\n")
    return data


def _prepare(make_config, data: Path, **overrides):
    return cached_data(
        make_config, datasets=[{"id": "shapes", "type": "local", "instance_data_dir": str(data)}], **overrides
    )


def _embeddings(spec, texts) -> dict[str, dict[str, torch.Tensor]]:
    """Each text's prompt embeddings, encoded here independently of the cache."""
    encoders = spec.load_text_encoders(CPU, torch.float32)
    with torch.no_grad():
        return {text: spec.encode_prompts(encoders, [text])[0] for text in texts}


def test_each_draw_trains_on_one_line_whose_embedding_is_cached(make_config, shapes_dir, tmp_path):
    p = 0.3
    data, datasets, config, spec = _prepare(
        make_config, _multiline_data(shapes_dir, tmp_path), caption_dropout_probability=p
    )
    multi = {s.path: s for s in datasets[0].samples if s.caption_lines}
    assert set(multi) == {"000.png", "001.png", "005.png"}
    assert multi["001.png"].caption_lines == ("a blue square", "square, blue, flat")
    every_text = {c for s in datasets[0].samples for c in s.captions}
    keys = cache_keys(spec, datasets, torch.float32)
    assert every_text | {DROPPED_CAPTION} == set(data.text_keys) == set(keys.texts)  # one entry per line
    assert all(data.text_cache.get_batch([key]) for key in data.text_keys.values())

    own = _embeddings(spec, every_text | {DROPPED_CAPTION})
    batches = data.iterate(training_sampler(datasets, config), CPU)
    drawn: dict[str, Counter] = {path: Counter() for path in multi}
    num_samples = num_dropped = 0
    for _ in range(120):
        batch = next(batches)
        assert len(batch.captions) in (0, batch.num_samples)
        for i, sample in enumerate(batch.samples):
            caption = batch.captions[i] if batch.captions else sample.caption
            assert caption in sample.captions
            dropped = bool(batch.dropped_captions and batch.dropped_captions[i])
            expected = own[DROPPED_CAPTION if dropped else caption]
            for name, tensor in expected.items():
                torch.testing.assert_close(batch.conditioning[name][i], tensor, rtol=1e-5, atol=1e-5)
            if sample.path in drawn:
                drawn[sample.path][caption] += 1
            num_dropped += dropped
        num_samples += batch.num_samples
    for path, counts in drawn.items():  # every line is drawn, none far more than the others
        assert set(counts) == set(multi[path].caption_lines), path
    assert abs(num_dropped - num_samples * p) <= 4 * math.sqrt(num_samples * p * (1 - p))  # dropout on top

    eval_batch = data.batch([multi["000.png"]], CPU)  # outside the training order: the first line, never dropped
    assert eval_batch.captions == () and eval_batch.dropped_captions == ()
    torch.testing.assert_close(eval_batch.conditioning["prompt_embeds"][0], own["a red circle"]["prompt_embeds"])


def test_a_resumed_sampler_draws_the_same_lines(make_config, shapes_dir, tmp_path):
    data, datasets, config, _ = _prepare(make_config, _multiline_data(shapes_dir, tmp_path))
    before, after, again = resumed_batches(data, datasets, config, 9, 12)  # past an epoch's end (6 batches each)
    assert [[s.key for s in b.samples] for b in again] == [[s.key for s in b.samples] for b in after]
    assert [b.captions for b in again] == [b.captions for b in after]
    for a, b in zip(after, again):
        assert torch.equal(a.conditioning["prompt_embeds"], b.conditioning["prompt_embeds"])
    assert any(b.captions for b in before + after)  # multi-line samples were drawn


def test_disable_multiline_split_trains_the_whole_file(make_config, shapes_dir, tmp_path):
    data = _multiline_data(shapes_dir, tmp_path)
    raw = make_config()
    raw["datasets"][0].update(instance_data_dir=str(data), disable_multiline_split=True)
    config = validate_config(raw)
    (dataset,) = build_datasets(config)
    sample = next(s for s in dataset.samples if s.path == "000.png")
    assert sample.captions == ("a red circle\na round red shape\nzxq style circle",)
    assert not any(s.caption_lines for s in dataset.samples)
