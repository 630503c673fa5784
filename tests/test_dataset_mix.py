"""Dataset mixing: ``datasets[].probability`` (weighted dataset draw in BucketSampler) and ``disabled``.

Shares are checked against the documented formula (chance of a dataset = probability x its global
batches per epoch, normalised) within a binomial tolerance; equal weights must give exactly the
unweighted order; a weighted run resumed mid-epoch replays the uninterrupted batches.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from pathlib import Path

import orjson
import pytest
from fakes import data_only_config, make_samples

from simpletuner.configuration import ConfigError, load_config, validate_config
from simpletuner.data_backend import BucketSampler
from simpletuner.data_backend.factory import build_datasets
from simpletuner.state import StateTracker

COUNTS = {("a", (64, 64)): 13, ("a", (96, 48)): 9, ("b", (64, 64)): 8, ("c", (48, 96)): 6}


def keys(batches):
    return [[s.key for s in batch] for batch in batches]


def epochs(sampler: BucketSampler, n: int) -> list[list[list[str]]]:
    return [keys(list(sampler)) for _ in range(n)]


def binomial_ok(hits: int, trials: int, p: float, sigmas: float = 4.0) -> bool:
    return abs(hits / trials - p) <= sigmas * math.sqrt(p * (1 - p) / trials)


# --- equal weights: the unweighted order, exactly ---------------------------------------------------


@pytest.mark.parametrize("weight", [1.0, 2.5])
@pytest.mark.parametrize("batch_size,num_replicas", [(2, 1), (1, 2)])
def test_equal_weights_give_exactly_the_unweighted_order(weight, batch_size, num_replicas):
    samples = make_samples(COUNTS)
    for rank in range(num_replicas):
        plain = BucketSampler(samples, batch_size, num_replicas, rank, seed=5)
        weighted = BucketSampler(
            samples, batch_size, num_replicas, rank, seed=5, weights={"a": weight, "b": weight, "c": weight}
        )
        assert len(plain) == len(weighted)
        assert epochs(plain, 3) == epochs(weighted, 3)


def test_weights_naming_no_dataset_weigh_one():
    samples = make_samples(COUNTS)
    assert epochs(BucketSampler(samples, 2, seed=1), 2) == epochs(
        BucketSampler(samples, 2, seed=1, weights={"a": 1.0, "unknown": 7.0}), 2
    )


# --- unequal weights: shares follow probability x size ----------------------------------------------


@pytest.mark.parametrize(
    "sizes,weights",
    [
        ({"a": 40, "b": 40}, {"a": 3.0, "b": 1.0}),  # equal sizes: shares are the weights, 3:1
        ({"a": 60, "b": 20}, {"a": 1.0, "b": 3.0}),  # 60x1 : 20x3, half each
        ({"a": 30, "b": 30, "c": 60}, {"a": 0.5, "b": 2.0, "c": 0.25}),
    ],
)
def test_weighted_shares_follow_probability_times_batches(sizes, weights):
    samples = make_samples({(d, (64, 64)): n for d, n in sizes.items()})
    sampler = BucketSampler(samples, batch_size=1, seed=3, weights=weights)
    assert len(sampler) == sum(sizes.values())  # an epoch keeps its length
    drawn = Counter(batch[0].dataset_id for epoch in range(40) for batch in list(sampler))
    trials = sum(drawn.values())
    total = sum(weights[d] * sizes[d] for d in sizes)
    for d in sizes:
        assert binomial_ok(drawn[d], trials, weights[d] * sizes[d] / total), (d, drawn, trials)


def test_weighted_batches_hold_one_dataset_and_bucket_and_walk_each_dataset_in_passes():
    counts = {("a", (64, 64)): 12, ("a", (96, 48)): 8, ("b", (64, 64)): 10}
    sampler = BucketSampler(make_samples(counts), batch_size=2, seed=9, weights={"a": 1.0, "b": 4.0})
    batches = list(sampler)
    assert len(batches) == 6 + 4 + 5
    for batch in batches:
        assert len(batch) == 2 and len({(s.dataset_id, s.bucket) for s in batch}) == 1
    # A dataset's batches come in whole passes: within its first pass no sample repeats.
    for dataset_id, per_pass in (("a", 10), ("b", 5)):
        own = [tuple(s.key for s in b) for b in batches if b[0].dataset_id == dataset_id]
        first = own[:per_pass]
        assert len({k for batch in first for k in batch}) == 2 * len(first)
        if len(own) >= per_pass:  # a whole pass seen: every usable sample of the dataset once
            assert len({k for batch in first for k in batch}) == 2 * per_pass


def test_weighted_order_is_a_function_of_seed_and_epoch():
    samples = make_samples(COUNTS)
    weights = {"a": 1.0, "b": 5.0, "c": 0.5}
    one, two = (BucketSampler(samples, 2, seed=4, weights=weights) for _ in range(2))
    assert epochs(one, 3) == epochs(two, 3)
    other_seed = BucketSampler(samples, 2, seed=5, weights=weights)
    assert epochs(other_seed, 1) != epochs(BucketSampler(samples, 2, seed=4, weights=weights), 1)
    # Input order does not matter.
    assert epochs(BucketSampler(list(reversed(samples)), 2, seed=4, weights=weights), 2) == epochs(
        BucketSampler(samples, 2, seed=4, weights=weights), 2
    )


@pytest.mark.parametrize("stop_after", [0, 3, 7])
def test_weighted_resume_mid_epoch_replays_the_same_batches(stop_after):
    samples = make_samples(COUNTS)
    weights = {"a": 0.5, "b": 3.0, "c": 1.0}
    straight = BucketSampler(samples, 2, seed=11, weights=weights)
    first_epoch, second_epoch = keys(list(straight)), keys(list(straight))

    interrupted = BucketSampler(samples, 2, seed=11, weights=weights)
    it = iter(interrupted)
    seen = [[s.key for s in next(it)] for _ in range(stop_after)]
    state = interrupted.state_dict()

    resumed = BucketSampler(samples, 2, seed=11, weights=weights)
    resumed.load_state_dict(state)
    assert seen + keys(list(resumed)) == first_epoch
    assert keys(list(resumed)) == second_epoch


def test_weighted_ranks_share_each_step_dataset_and_bucket_but_not_samples():
    samples = make_samples(COUNTS)
    weights = {"a": 1.0, "b": 6.0, "c": 2.0}
    ranks = [BucketSampler(samples, 2, 2, r, seed=2, weights=weights) for r in range(2)]
    for step in zip(*(list(s) for s in ranks)):
        assert len({(s.dataset_id, s.bucket) for batch in step for s in batch}) == 1
        assert not {s.key for s in step[0]} & {s.key for s in step[1]}


# --- probability 0 ------------------------------------------------------------------------------------


def test_zero_weight_drops_a_dataset():
    samples = make_samples(COUNTS)
    sampler = BucketSampler(samples, 2, seed=1, weights={"a": 1.0, "b": 0.0, "c": 1.0})
    assert len(sampler) == 6 + 4 + 3  # a: 13//2 + 9//2 = 6 + 4, c: 3
    assert all(batch[0].dataset_id != "b" for _ in range(2) for batch in list(sampler))


def test_every_weight_zero_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="probability 0.*above 0"):
        BucketSampler(make_samples(COUNTS), 2, weights={"a": 0, "b": 0, "c": 0})


# --- config: probability, disabled ------------------------------------------------------------------


def _two_datasets(tmp_path: Path, first: dict, second: dict) -> dict:
    raw = data_only_config({"id": "a", "type": "local", "instance_data_dir": str(tmp_path / "a"), **first})
    raw["datasets"].append({"id": "b", "type": "local", "instance_data_dir": str(tmp_path / "b"), **second})
    return raw


@pytest.mark.parametrize(
    "first,second",
    [({"disabled": True}, {"disabled": True}), ({"probability": 0}, {"probability": 0.0}), ({"disabled": True}, {})],
)
def test_every_dataset_left_out_is_refused_at_load(tmp_path, first, second):
    raw = _two_datasets(tmp_path, first, {"probability": 0, **second} if not second else second)
    with pytest.raises(ConfigError) as error:
        validate_config(raw, check_files=False)
    text = str(error.value)
    assert "every dataset is left out of training" in text and "remove `disabled: true`" in text


def test_negative_probability_and_typos_in_a_disabled_entry_are_refused(tmp_path):
    raw = _two_datasets(tmp_path, {"probability": -0.5}, {"disabled": True, "repaets": 2})
    with pytest.raises(ConfigError) as error:
        validate_config(raw, check_files=False)
    text = str(error.value)
    assert "datasets[0]" in text and "probability" in text
    assert "repaets" in text


def test_a_left_out_dataset_needs_no_folder(tmp_path):
    (tmp_path / "a").mkdir()
    raw = _two_datasets(tmp_path, {}, {"disabled": True})  # b's folder does not exist
    raw["pretrained_model_name_or_path"] = "some/hub-id"
    config = validate_config(raw)
    assert [d.disabled for d in config.datasets] == [False, True]
    raw["datasets"][1]["disabled"] = False
    with pytest.raises(ConfigError, match=r"datasets\[1\].instance_data_dir: .* is not a folder"):
        validate_config(raw)


def _write_png(path: Path, size=(64, 64)) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (200, 30, 30)).save(path)
    path.with_suffix(".txt").write_text("a red square")


@pytest.mark.parametrize("left_out", [{"disabled": True}, {"probability": 0}])
def test_left_out_dataset_is_not_scanned(tmp_path, caplog, left_out):
    for i in range(3):
        _write_png(tmp_path / "a" / f"{i}.png")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "broken.png").write_bytes(b"not an image at all")  # a scan would refuse it (max_bad 0)
    raw = _two_datasets(tmp_path, {}, left_out)
    raw["max_bad_image_fraction"] = 0.0
    state = StateTracker(validate_config(raw, check_files=False), raw)
    with caplog.at_level(logging.INFO, logger="simpletuner.data_backend.factory"):
        built = build_datasets(state.config)
    assert [d.id for d in built] == ["a"]
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(said) == 1 and "'b'" in said[0]
    # The same dataset enabled is scanned, and its broken file stops the run.
    raw["datasets"][1] = {k: v for k, v in raw["datasets"][1].items() if k not in left_out}
    with pytest.raises(ValueError):
        build_datasets(validate_config(raw, check_files=False))


# --- config: cache folder templates and relative paths ------------------------------------------------


def test_cache_folder_templates_are_checked(tmp_path):
    raw = data_only_config(
        {"id": "a", "type": "local", "instance_data_dir": str(tmp_path), "cache_dir_vae": "lat/{family}"}
    )
    raw["cache_config"] = {"text_cache_dir": "text/{id}"}
    with pytest.raises(ConfigError) as error:
        validate_config(raw, check_files=False)
    text = str(error.value)
    assert "{family}" in text and "{model_family}" in text  # the unknown name, and the known ones
    assert "text_cache_dir" in text and "{id}" in text
    raw["datasets"][0]["cache_dir_vae"] = "lat/{model_family}/{id}-{output_dir}"
    raw["cache_config"] = {"text_cache_dir": "text/{model_family}"}
    validate_config(raw, check_files=False)


def test_relative_cache_folders_are_taken_from_the_config_folder(tmp_path):
    folder = tmp_path / "conf"
    folder.mkdir()
    raw = data_only_config(
        {"id": "a", "type": "local", "instance_data_dir": "data", "cache_dir_vae": "lat/{model_family}"}
    )
    raw["datasets"].append(
        {"id": "b", "type": "local", "instance_data_dir": "data", "cache_dir_vae": "{output_dir}/lat"}
    )
    raw["cache_config"] = {"text_cache_dir": "emb"}
    (folder / "cfg.json").write_bytes(orjson.dumps(raw))
    config = load_config(folder / "cfg.json", check_files=False).config
    assert config.datasets[0].cache_dir_vae == str(folder / "lat" / "{model_family}")
    assert config.datasets[1].cache_dir_vae == "{output_dir}/lat"
    assert config.cache_config.text_cache_dir == str(folder / "emb")
