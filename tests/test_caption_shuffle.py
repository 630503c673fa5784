"""Caption shuffling (a dataset's ``caption_shuffle``), SimpleTuner's meaning: each caption and its shuffled copies
are captions of the image, each encoded once, one drawn per use. The expected copies are figures computed once by
running SimpleTuner's own ``CaptionShuffler.expand_with_shuffles`` (simpletuner/helpers/prompts.py:168-242 at
bc8e6ab7) on the inputs below; the draws, their resume and the text cache run on the tiny SD model."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from fakes import data_only_config
from PIL import Image
from training_helpers import cached_data, resumed_batches, training_sampler

from simpletuner.caching.keys import cache_keys
from simpletuner.configuration import ConfigError, validate_config
from simpletuner.configuration.dataset_sections import CaptionShuffle
from simpletuner.configuration.foreign_keys import foreign_key
from simpletuner.configuration.simpletuner import translate as dialect
from simpletuner.data_backend import LocalDataBackend, build_metadata
from simpletuner.data_backend.caption_shuffle import shuffled_captions

CPU = torch.device("cpu")

#: (caption, SimpleTuner's `caption_shuffle`) -> what `expand_with_shuffles` returns for them.
SIMPLETUNER_SHUFFLES = [
    (
        "dog, running, park, sunny day",
        {"enable": True, "count": 2, "split_on": "comma", "position_start": 1, "seed": 42},
        ["dog, running, park, sunny day", "dog, park, running, sunny day", "dog, sunny day, running, park"],
    ),
    (
        "dog, running, park, sunny day",
        {"enable": True, "count": 3, "split_on": "comma", "position_start": 0, "seed": 123},
        ["dog, running, park, sunny day", "dog, sunny day, running, park", "sunny day, park, running, dog"],
    ),
    (
        "1girl, solo, red hair, smile, outdoors",
        {"enable": True, "count": 3, "position_start": 2, "seed": 7, "include_original": False},
        ["1girl, solo, red hair, smile, outdoors", "1girl, solo, smile, outdoors, red hair",
         "1girl, solo, outdoors, red hair, smile"],
    ),
    ("a b c d e", {"enable": True, "count": 2, "split_on": "space", "position_start": 1, "seed": 5},
     ["a b c d e", "a e c b d", "a b d c e"]),
    ("One. Two. Three", {"enable": True, "count": 2, "split_on": "period", "seed": 9},
     ["One. Two. Three", "Three. One. Two"]),
    ("dog, cat", {"enable": True, "count": 2, "position_start": 1, "seed": 1}, ["dog, cat"]),  # one tag to move
    ("a red square", {"enable": True, "count": 2, "seed": 123}, ["a red square"]),  # one tag
    ("square, blue, flat", {"enable": True, "count": 2, "seed": 123},
     ["square, blue, flat", "flat, square, blue", "flat, blue, square"]),
    ("square, blue, flat", {"enable": False, "count": 2, "seed": 123}, ["square, blue, flat"]),
]  # fmt: skip


@pytest.mark.parametrize(("caption", "settings", "copies"), SIMPLETUNER_SHUFFLES)
def test_the_copies_are_simpletuners(caption, settings, copies):
    assert shuffled_captions(caption, CaptionShuffle(**settings), seed=0) == copies


def test_an_unset_seed_is_the_runs():
    shuffle = CaptionShuffle(enable=True, count=2)
    assert shuffled_captions("square, blue, flat", shuffle, seed=123) == SIMPLETUNER_SHUFFLES[-2][2]


def _dataset(folder, captions: dict[str, str], **entry):
    folder.mkdir(parents=True, exist_ok=True)
    for i, (name, text) in enumerate(captions.items()):
        Image.new("RGB", (64, 64), (40 * i, 90, 160)).save(folder / f"{name}.png")
        (folder / f"{name}.txt").write_text(text)
    return {"id": "tags", "type": "local", "instance_data_dir": str(folder), **entry}


def _scan(entry, seed=0):
    config = validate_config({**data_only_config(entry), "seed": seed}, check_files=False)
    return build_metadata(LocalDataBackend(entry["instance_data_dir"], "tags"), config.datasets[0], config, seed=seed)


def test_the_scan_shuffles_before_the_instance_prompt_is_put_first(tmp_path, caplog):
    entry = _dataset(
        tmp_path / "data",
        {"a": "square, blue, flat\nred, round"},
        caption_shuffle={"enable": True, "count": 2, "seed": 123},
        instance_prompt="sks",
        prepend_instance_prompt=True,
    )
    with caplog.at_level("INFO"):
        (sample,) = _scan(entry).samples
    # each line is shuffled on its own, then `sks ` goes first (prompts.py:632-644)
    assert sample.captions == (
        "sks square, blue, flat",
        "sks flat, square, blue",
        "sks flat, blue, square",
        *(f"sks {c}" for c in shuffled_captions("red, round", CaptionShuffle(enable=True, count=2, seed=123), 0)),
    )
    assert f"caption_shuffle: 1 images have {len(sample.captions)} captions in all" in caplog.text
    assert "have several lines" not in caplog.text


def test_instance_prompt_captions_are_not_shuffled(tmp_path):
    entry = _dataset(
        tmp_path / "data",
        {"a": "ignored"},
        caption_strategy="instance_prompt",
        instance_prompt="sks, dog, photo",
        caption_shuffle={"enable": True, "count": 3},
    )
    assert _scan(entry).samples[0].captions == ("sks, dog, photo",)


def test_each_draw_trains_on_one_copy_whose_embedding_is_cached(make_config, tmp_path):
    """The tiny SD model: every copy has its own text-cache entry, each draw trains on one of them (all are drawn),
    and a resumed run draws the same ones."""
    captions = {"a": "red, circle, small, bright", "b": "blue, square, large", "c": "green, triangle"}
    entry = _dataset(tmp_path / "data", captions, caption_shuffle={"enable": True, "count": 3, "position_start": 1})
    data, datasets, config, spec = cached_data(make_config, datasets=[entry])
    samples = {s.path: s for s in datasets[0].samples}
    assert samples["a.png"].captions == tuple(
        shuffled_captions(captions["a"], CaptionShuffle(enable=True, count=3, position_start=1), config.seed)
    )
    assert len(samples["a.png"].captions) > 2 and samples["c.png"].captions == ("green, triangle",)
    every_text = {c for s in samples.values() for c in s.captions}
    assert every_text == set(data.text_keys) == set(cache_keys(spec, datasets, torch.float32).texts)

    encoders = spec.load_text_encoders(CPU, torch.float32)
    with torch.no_grad():
        own = {text: spec.encode_prompts(encoders, [text])[0]["prompt_embeds"] for text in every_text}
    batches = data.iterate(training_sampler(datasets, config), CPU)
    drawn: Counter[str] = Counter()
    for _ in range(40):
        batch = next(batches)
        for i, sample in enumerate(batch.samples):
            caption = batch.captions[i] if batch.captions else sample.caption
            assert caption in sample.captions
            torch.testing.assert_close(batch.conditioning["prompt_embeds"][i], own[caption], rtol=1e-5, atol=1e-5)
            drawn[caption] += sample.path == "a.png"
    assert {c for c, n in drawn.items() if n} == set(samples["a.png"].captions)

    _, after, again = resumed_batches(data, datasets, config, 3, 4)
    assert [b.captions for b in again] == [b.captions for b in after]


def test_the_settings_are_checked(tmp_path):
    entry = _dataset(tmp_path / "data", {"a": "x"})
    for bad, message in (
        ({"enable": True, "count": 0}, "count"),
        ({"enable": True, "split_on": "semicolon"}, "split_on"),
        ({"enable": True, "position_start": -1}, "position_start"),
        ({"enable": True, "keep_tokens": 1}, "keep_tokens"),
    ):
        with pytest.raises(ConfigError, match=message):
            validate_config(data_only_config({**entry, "caption_shuffle": bad}), check_files=False)


def test_simpletuners_caption_shuffle_translates_as_it_is(tmp_path):
    (tmp_path / "model").mkdir()
    settings = {"enable": True, "count": 3, "split_on": "comma", "position_start": 1, "include_original": False}
    entry = {"id": "d", "type": "local", "instance_data_dir": "data", "caption_shuffle": settings}
    (tmp_path / "multidatabackend.json").write_text(json.dumps([entry]))
    top = {"model_type": "lora", "model_family": "sd1x", "pretrained_model_name_or_path": "model",
           "data_backend_config": "multidatabackend.json"}  # fmt: skip
    native, _ = dialect.translate(top, None, tmp_path)
    assert native["datasets"][0]["caption_shuffle"] == {**settings, "seed": 0}  # SimpleTuner without a seed: 0
    native, _ = dialect.translate({**top, "seed": 7}, None, tmp_path)
    assert native["datasets"][0]["caption_shuffle"] == settings  # the run's seed, 7, as there


def test_kohyas_keys_point_at_caption_shuffle():
    (shuffle,), (keep,) = foreign_key("shuffle_caption"), foreign_key("keep_tokens")
    assert shuffle.ours == keep.ours == "datasets[].caption_shuffle"
    assert "position_start" in keep.note
