"""Factory: datasets built from the config (and recorded in the StateTracker by the caller), pixels loaded."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from simpletuner.configuration import validate_config
from simpletuner.data_backend import (
    BUILDERS,
    BucketSampler,
    LocalDataBackend,
    RegisteredDataset,
    build_datasets,
    builder_for,
    load_sample_pixels,
)
from simpletuner.state import StateTracker


def write_folder(folder, sizes, caption_prefix="pic"):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for i, size in enumerate(sizes):
        array = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(array).save(folder / f"img_{i:02d}.png")
        (folder / f"img_{i:02d}.txt").write_text(f"{caption_prefix} {i}")
    return folder


def make_state(tmp_path, **first_dataset):
    one = write_folder(tmp_path / "one", [(64, 64)] * 4 + [(96, 48)] * 2)
    two = write_folder(tmp_path / "two", [(48, 48)] * 3, caption_prefix="other")
    raw = {
        "pretrained_model_name_or_path": "unused",
        "max_train_steps": 2,
        "resolution": 64,
        "aspect_bucket_alignment": 16,
        "seed": 7,
        "datasets": [
            {"id": "one", "type": "local", "instance_data_dir": str(one), **first_dataset},
            {"id": "two", "type": "local", "instance_data_dir": str(two), "crop_style": "random"},
        ],
    }
    return StateTracker(validate_config(raw, check_files=False), raw)


def _build_and_record(state: StateTracker) -> list[RegisteredDataset]:
    """As the trainer does: build the datasets, then record each in the run's StateTracker."""
    datasets = build_datasets(state.config)
    for dataset in datasets:
        state.register_dataset(dataset)
    return datasets


def test_build_datasets_builds_and_the_state_records_them(tmp_path):
    state = make_state(tmp_path, repeats=1)
    datasets = build_datasets(state.config)
    assert [d.id for d in datasets] == ["one", "two"]
    assert state.datasets == []  # building records nothing: the caller does
    for dataset in datasets:
        state.register_dataset(dataset)
    assert state.datasets == datasets
    one = state.get_dataset("one")
    assert isinstance(one, RegisteredDataset)
    assert isinstance(one.backend, LocalDataBackend) and one.backend.root == tmp_path / "one"
    assert one.config is state.config.datasets[0]
    assert len(one.samples) == 12 and one.samples is one.metadata.samples  # 6 images x (1 + 1 repeat)
    assert one.metadata.caption_sources == {"textfile": 6}
    assert {s.caption for s in state.get_dataset("two").samples} == {"other 0", "other 1", "other 2"}
    assert all(s.crop_style == "random" for s in state.get_dataset("two").samples)


def test_recording_twice_into_one_state_is_refused(tmp_path):
    state = make_state(tmp_path)
    _build_and_record(state)
    with pytest.raises(ValueError, match="registered twice"):
        _build_and_record(state)


def test_two_states_do_not_share_datasets(tmp_path):
    first, second = make_state(tmp_path / "a"), make_state(tmp_path / "b")
    _build_and_record(first)
    assert [d.id for d in first.datasets] == ["one", "two"] and second.datasets == []


def test_load_sample_pixels_matches_bucket(tmp_path):
    datasets = build_datasets(make_state(tmp_path).config)
    for dataset in datasets:
        for sample in dataset.samples:
            pixels, info = load_sample_pixels(dataset, sample)
            assert tuple(pixels.shape) == (3, sample.bucket[1], sample.bucket[0])
            assert pixels.dtype == torch.float32 and -1 <= pixels.min() <= pixels.max() <= 1
            assert info["original_size"] == sample.original_size
    random_sample = datasets[1].samples[0]
    first, _ = load_sample_pixels(datasets[1], random_sample)
    again, _ = load_sample_pixels(datasets[1], random_sample)
    assert torch.equal(first, again)


def test_sampler_over_built_datasets(tmp_path):
    datasets = build_datasets(make_state(tmp_path).config)
    samples = [s for d in datasets for s in d.samples]
    sampler = BucketSampler(samples, batch_size=2, seed=7)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 2 + 1 + 1  # "one": 4 square + 2 wide; "two": 3 square -> 1
    assert all(len({s.dataset_id for s in b}) == 1 for b in batches)


def test_builders_map_and_unknown_type():
    assert set(BUILDERS) >= {"local"}
    fake = SimpleNamespace(type="s3", id="remote")
    with pytest.raises(ValueError) as info:
        builder_for(fake)
    message = str(info.value)
    assert "'remote'" in message and "'s3'" in message and "local" in message


def test_builder_lookup_uses_the_map(tmp_path, monkeypatch):
    calls = []

    def fake_builder(dataset_cfg, config):
        calls.append(dataset_cfg.id)
        return LocalDataBackend(tmp_path, dataset_cfg.id)

    monkeypatch.setitem(BUILDERS, "fake", fake_builder)
    cfg = SimpleNamespace(type="fake", id="f")
    assert builder_for(cfg) is fake_builder
    assert builder_for(cfg)(cfg, None).id == "f" and calls == ["f"]


def test_missing_folder_is_a_clear_error(tmp_path):
    raw = {
        "pretrained_model_name_or_path": "unused",
        "max_train_steps": 1,
        "datasets": [{"id": "gone", "type": "local", "instance_data_dir": str(tmp_path / "nowhere")}],
    }
    state = StateTracker(validate_config(raw, check_files=False), raw)
    with pytest.raises(ValueError, match="nowhere.*instance_data_dir"):
        build_datasets(state.config)
