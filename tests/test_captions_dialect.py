"""Captions in SimpleTuner's dialect: `prepend_instance_prompt`, captions from a metadata file (Parquet, CSV,
JSON lines, by `caption_strategy`), and `caption_dropout_probability` on real cached embeddings of the tiny
SD model, including the same drops after a resume."""

from __future__ import annotations

import csv
import json
import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fakes import data_only_config
from PIL import Image
from training_helpers import cached_data, resumed_batches, training_sampler

from simpletuner.caching.keys import DROPPED_CAPTION, cache_keys
from simpletuner.configuration import ConfigError, load_config, validate_config
from simpletuner.configuration.loader import check_paths
from simpletuner.data_backend import LocalDataBackend, build_metadata, caption_for
from simpletuner.data_backend.caption_files import load_caption_table, strip_media_extension
from simpletuner.training.batches import CaptionDropout

CPU = torch.device("cpu")


# --- helpers ---------------------------------------------------------------------------------------------------
def write_image(path: Path, size=(32, 32)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size[1], size[0], 3), 128, dtype=np.uint8)).save(path)
    return path


def scan(folder: Path, **dataset):
    """``(config, dataset config, metadata)`` of one scanned dataset over ``folder`` (no model is read)."""
    entry = {"id": "ds", "type": "local", "instance_data_dir": str(folder), **dataset}
    config = validate_config(data_only_config(entry), check_files=False)
    ds = config.datasets[0]
    return config, ds, build_metadata(LocalDataBackend(folder, "ds"), ds, config, seed=0)


def captions_of(meta) -> dict[str, str]:
    return {s.path: s.caption for s in meta.samples}


ROWS = [
    {"file": "apple", "text": "a red apple", "tags": "fruit", "w": 32, "h": 32},
    {"file": "bee", "text": "", "tags": "insect, bee", "w": 32, "h": 32},  # empty caption: the fallback
    {"file": "sub/cat", "text": "a cat", "tags": None, "w": 32, "h": 32},  # an image in a sub-folder
    {"file": 42, "text": "the answer", "tags": None, "w": 20, "h": 10},  # a number; the size is wrong
    {"file": "ghost", "text": "no such image", "tags": None, "w": 32, "h": 32},  # a row without an image
]
IMAGES = ["apple.png", "bee.jpg", "sub/cat.png", "42.png", "lonely.png"]  # lonely.png: an image without a row
EXPECTED = {"apple.png": "a red apple", "bee.jpg": "insect, bee", "sub/cat.png": "a cat", "42.png": "the answer"}


def write_table(path: Path, fmt: str, rows: list[dict]) -> Path:
    """``rows`` written as ``fmt`` (parquet, csv, jsonl or json) by the format's own library."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        cols = {k: [r[k] for r in rows] for k in rows[0]}
        cols["file"] = [str(v) for v in cols["file"]]  # a Parquet column holds one type
        pq.write_table(pa.table(cols), path)
    elif fmt == "csv":
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    else:
        path.write_text(json.dumps(rows), encoding="utf-8")
    return path


def table_dataset(tmp_path: Path, strategy: str, fmt: str, **options) -> tuple[Path, dict]:
    data = tmp_path / "data"
    for name in IMAGES:
        write_image(data / name)
    table = write_table(tmp_path / f"captions.{fmt}", fmt, ROWS)
    opts = {"path": str(table), "filename_column": "file", "caption_column": "text", **options}
    return data, {"caption_strategy": strategy, strategy: opts}


# --- metadata files ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "strategy,fmt",
    [("parquet", "parquet"), ("csv", "csv"), ("jsonl", "jsonl"), ("parquet", "jsonl"), ("parquet", "json")],
)
def test_captions_read_from_each_kind_of_file(tmp_path, caplog, strategy, fmt):
    data, entry = table_dataset(
        tmp_path, strategy, fmt, fallback_caption_column="tags", width_column="w", height_column="h"
    )
    with caplog.at_level(logging.WARNING):
        _, _, meta = scan(data, **entry)
    assert captions_of(meta) == EXPECTED
    assert meta.caption_sources == {strategy: 4}
    text = caplog.text
    assert "skipped 1 of 5 files with no caption" in text and "lonely.png" in text
    assert "1 of 5 captioned rows name no file" in text and "ghost" in text
    assert "1 image(s) have another size" in text and "42.png (32x32, the table says 20x10)" in text


def test_identifier_with_extension_and_first_of_several_captions(tmp_path, caplog):
    data = tmp_path / "data"
    for name in ("a.png", "b.png", "b.jpg"):
        write_image(data / name)
    rows = [
        {"name": "a.png", "caption": ["first", "second"]},  # a multi-caption row
        {"name": "b.png", "caption": "b as png"},
        {"name": "b.jpg", "caption": "b as jpeg"},
        {"name": "a.png", "caption": ["later row", "x"]},  # the same file again: the last row wins
    ]
    path = write_table(tmp_path / "t.jsonl", "jsonl", rows)
    opts = {"path": str(path), "filename_column": "name", "caption_column": "caption"}
    with caplog.at_level(logging.WARNING):
        _, _, meta = scan(data, caption_strategy="jsonl", jsonl={**opts, "identifier_includes_extension": True})
    assert captions_of(meta) == {"a.png": "later row", "b.png": "b as png", "b.jpg": "b as jpeg"}
    assert "2 row(s) hold several captions" in caplog.text
    assert "1 file name(s) appear on more than one row" in caplog.text


def test_strip_media_extension_keeps_other_dots():
    assert strip_media_extension("sub/cat.PNG") == "sub/cat"
    assert strip_media_extension("2024.05.01_shot") == "2024.05.01_shot"
    assert strip_media_extension("clip.mp4") == "clip"


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl"])
def test_missing_column_names_it_and_the_columns_there(tmp_path, fmt):
    data, entry = table_dataset(tmp_path, fmt, fmt, caption_column="caption")
    with pytest.raises(ValueError) as err:
        scan(data, **entry)
    message = str(err.value)
    assert f"'caption' (`{fmt}.caption_column`)" in message
    assert "'file', 'text', 'tags', 'w', 'h'" in message


@pytest.mark.parametrize(
    "strategy,content,message",
    [
        ("parquet", b"not parquet at all", "is not a readable Parquet file"),
        ("jsonl", b'{"file": "a", "text": "x"}\n{"file": "b", oops}\n', "line 2: not valid JSON"),
        ("csv", "file,text\nb,caf\u00e9\n".encode("latin-1"), "not UTF-8 text"),
    ],
)
def test_unreadable_files_say_where(tmp_path, strategy, content, message):
    write_image(tmp_path / "data" / "a.png")
    path = tmp_path / f"t.{strategy}"
    path.write_bytes(content)
    opts = {"path": str(path), "filename_column": "file", "caption_column": "text"}
    with pytest.raises(ValueError, match=message) as err:
        scan(tmp_path / "data", caption_strategy=strategy, **{strategy: opts})
    assert str(path) in str(err.value)


def test_no_image_matching_any_row_is_an_error_with_the_hint(tmp_path):
    data, entry = table_dataset(tmp_path, "csv", "csv", identifier_includes_extension=True)
    with pytest.raises(ValueError, match="none of the 5 files under .* has a caption there") as err:
        scan(data, **entry)
    assert "identifier_includes_extension" in str(err.value) and "'apple'" in str(err.value)


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    data, entry = table_dataset(tmp_path, "parquet", "parquet")
    raw = data_only_config({"id": "ds", "type": "local", "instance_data_dir": str(data), **entry})
    config = validate_config(raw, check_files=False)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # importing pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"parquet. extra"):
        load_caption_table(config.datasets[0])
    raw["pretrained_model_name_or_path"] = str(tmp_path)
    problems = "\n".join(_problems(raw))  # refused with the config, before any model loads
    assert "datasets[0].parquet.path: reading a Parquet file needs pyarrow" in problems and ".[parquet]" in problems
    raw["datasets"][0]["parquet"]["path"] = str(write_table(tmp_path / "t.jsonl", "jsonl", ROWS))
    config = validate_config(raw, check_files=False)
    assert not [p for p in check_paths(config) if "Parquet file" in p]  # JSON lines under `parquet`: no pyarrow needed


def test_caption_for_reads_the_file_itself_and_refuses_an_image_without_a_row(tmp_path):
    data, entry = table_dataset(tmp_path, "csv", "csv")
    _, ds, _ = scan(data, **entry)
    backend = LocalDataBackend(data, "ds")
    assert caption_for(backend, "sub/cat.png", ds) == ("a cat", "csv")
    with pytest.raises(ValueError, match="has no caption for 'lonely.png'"):
        caption_for(backend, "lonely.png", ds)


# --- the config ------------------------------------------------------------------------------------------------
def _problems(raw, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate_config(raw, **kwargs)
    return err.value.problems


def test_config_rules_for_tables_and_prepend(tmp_path):
    base = {"id": "ds", "type": "local", "instance_data_dir": str(tmp_path)}
    table = {"path": "x.csv", "filename_column": "f", "caption_column": "c"}
    text = "\n".join(
        _problems(data_only_config({**base, "caption_strategy": "parquet"}), check_files=False)
        + _problems(data_only_config({**base, "csv": table}), check_files=False)
        + _problems(data_only_config({**base, "prepend_instance_prompt": True}), check_files=False)
    )
    assert "caption_strategy 'parquet' needs a `parquet` table" in text
    assert "`csv` is set but caption_strategy is 'textfile'" in text
    assert "prepend_instance_prompt needs `instance_prompt`" in text


def test_relative_table_path_is_taken_from_the_config_folder_and_must_exist(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    write_image(folder / "data" / "a.png")
    write_table(folder / "meta" / "caps.jsonl", "jsonl", [{"file": "a", "text": "an a"}])
    entry = {
        "id": "ds",
        "type": "local",
        "instance_data_dir": "data",
        "caption_strategy": "jsonl",
        "jsonl": {"path": "meta/caps.jsonl", "filename_column": "file", "caption_column": "text"},
    }
    raw = {**data_only_config(entry), "pretrained_model_name_or_path": str(folder)}
    config_path = folder / "cfg.json"
    config_path.write_text(json.dumps(raw))
    monkeypatch.chdir(tmp_path)  # elsewhere: the path must not depend on the working directory
    config = load_config(config_path, check_files=False).config
    assert config.datasets[0].jsonl.path == str(folder / "meta" / "caps.jsonl")
    _, _, meta = scan(folder / "data", **{k: config.datasets[0].model_dump()[k] for k in ("caption_strategy", "jsonl")})
    assert captions_of(meta) == {"a.png": "an a"}

    (folder / "meta" / "caps.jsonl").unlink()
    problems = "\n".join(_problems(raw, base_dir=folder))
    assert f"datasets[0].jsonl.path: {folder / 'meta' / 'caps.jsonl'} is not a file" in problems


# --- prepend_instance_prompt ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["textfile", "filename", "parquet", "csv", "jsonl"])
def test_prepend_puts_the_instance_prompt_and_a_space_first(tmp_path, strategy):
    data = tmp_path / "data"
    write_image(data / "red_box.png")
    own = {"textfile": "a red box", "filename": "red box"}.get(strategy, "a box from the table")
    entry: dict = {"caption_strategy": strategy}
    if strategy == "textfile":
        (data / "red_box.txt").write_text(own)
    elif strategy != "filename":
        fmt = {"parquet": "parquet", "csv": "csv", "jsonl": "jsonl"}[strategy]
        rows = [{"file": "red_box", "text": own, "tags": "", "w": 1, "h": 1}]
        path = write_table(tmp_path / f"t.{fmt}", fmt, rows)
        entry[strategy] = {"path": str(path), "filename_column": "file", "caption_column": "text"}
    _, _, plain = scan(data, instance_prompt="sks", **entry)
    _, _, prepended = scan(data, instance_prompt="sks", prepend_instance_prompt=True, **entry)
    assert captions_of(plain) == {"red_box.png": own}
    assert captions_of(prepended) == {"red_box.png": "sks " + own}


def test_prepend_leaves_a_caption_that_is_the_instance_prompt_alone(tmp_path):
    data = tmp_path / "data"
    write_image(data / "with_text.png")
    (data / "with_text.txt").write_text("a caption")
    write_image(data / "no_text.png")  # textfile falls back to instance_prompt
    _, _, meta = scan(data, instance_prompt="sks toy", prepend_instance_prompt=True)
    assert captions_of(meta) == {"with_text.png": "sks toy a caption", "no_text.png": "sks toy"}
    _, _, meta = scan(data, caption_strategy="instance_prompt", instance_prompt="sks toy", prepend_instance_prompt=True)
    assert set(captions_of(meta).values()) == {"sks toy"}


# --- caption dropout -----------------------------------------------------------------------------------------------
def test_drop_decision_is_a_pure_function_with_the_asked_rate():
    p, n = 0.3, 20000
    dropout = CaptionDropout(seed=7, probability=p)
    draws = [dropout.is_dropped(epoch=i // 500, position=i % 500, slot=i % 3, key=f"ds/{i % 37}.png") for i in range(n)]
    assert abs(sum(draws) - n * p) <= 4 * math.sqrt(n * p * (1 - p))
    again = CaptionDropout(seed=7, probability=p)
    assert draws[:200] == [again.is_dropped(i // 500, i % 500, i % 3, f"ds/{i % 37}.png") for i in range(200)]
    other_seed = CaptionDropout(seed=8, probability=p)
    assert draws[:200] != [other_seed.is_dropped(i // 500, i % 500, i % 3, f"ds/{i % 37}.png") for i in range(200)]
    assert not any(CaptionDropout(7, 0.0).is_dropped(0, i, 0, "k") for i in range(100))


def test_dropped_samples_train_on_the_empty_prompt_embedding(make_config):
    p = 0.5
    data, datasets, config, spec = cached_data(make_config, caption_dropout_probability=p)
    keys = cache_keys(spec, datasets, torch.float32)
    assert DROPPED_CAPTION in data.text_keys and DROPPED_CAPTION in keys.texts  # cached like any caption

    # the empty prompt's embedding, encoded here independently of the cache
    encoders = spec.load_text_encoders(CPU, torch.float32)
    with torch.no_grad():
        empty = spec.encode_prompts(encoders, [DROPPED_CAPTION])[0]
        own = {c: spec.encode_prompts(encoders, [c])[0] for c in {s.caption for ds in datasets for s in ds.samples}}

    batches = data.iterate(training_sampler(datasets, config), CPU)
    num_samples = num_dropped = 0
    for _ in range(150):
        batch = next(batches)
        assert len(batch.dropped_captions) == batch.num_samples
        for i, (sample, dropped) in enumerate(zip(batch.samples, batch.dropped_captions)):
            expected = empty if dropped else own[sample.caption]
            for name, tensor in expected.items():
                torch.testing.assert_close(batch.conditioning[name][i], tensor, rtol=1e-5, atol=1e-5)
            num_dropped += dropped
        num_samples += batch.num_samples
    assert abs(num_dropped - num_samples * p) <= 4 * math.sqrt(num_samples * p * (1 - p))

    first = datasets[0].samples[0]
    eval_batch = data.batch([first], CPU)  # evaluation / validation: never dropped
    assert eval_batch.dropped_captions == ()
    torch.testing.assert_close(eval_batch.conditioning["prompt_embeds"][0], own[first.caption]["prompt_embeds"])


def test_a_resumed_sampler_drops_the_same_captions(make_config):
    data, datasets, config, _ = cached_data(make_config, caption_dropout_probability=0.4)
    batches, after, again = resumed_batches(data, datasets, config, 9, 8)  # past an epoch's end (6 batches each)
    before = [b.dropped_captions for b in batches]
    assert [b.dropped_captions for b in again] == [b.dropped_captions for b in after]
    assert [[s.key for s in b.samples] for b in again] == [[s.key for s in b.samples] for b in after]
    for a, b in zip(after, again):
        assert torch.equal(a.conditioning["prompt_embeds"], b.conditioning["prompt_embeds"])
    assert any(any(d) for d in before + [b.dropped_captions for b in after])  # something was dropped


def test_no_dropout_leaves_batches_and_keys_as_before(make_config):
    data, datasets, config, spec = cached_data(make_config)
    assert DROPPED_CAPTION not in cache_keys(spec, datasets, torch.float32).texts
    batch = next(data.iterate(training_sampler(datasets, config), CPU))
    assert batch.dropped_captions == ()
