"""Auto-config never plans a micro-batch the data cannot fill (issue 12, item 7).

``train`` refuses a ``train_batch_size`` x processes that no aspect bucket of one dataset holds
(BucketSampler); ``estimate --apply`` used to write 32 for 18 images. These run on a real image
folder (the demo's shapes) and the tiny SD model.
"""

from __future__ import annotations

import json

import pytest
from test_memory_autoconfig import FakeEstimates

from simpletuner.cli import main
from simpletuner.configuration import load_config, validate_config
from simpletuner.data_backend import BucketSampler, LocalDataBackend, build_metadata
from simpletuner.memory.autoconfig import DataTooSmall, EstimateCache, plan_batch, scan_data_cap
from simpletuner.memory.estimator import GiB
from simpletuner.testing.demo_data import write_shapes_dataset


@pytest.fixture(scope="module")
def eighteen_images(tmp_path_factory):
    """18 captioned images in three aspect ratios: 6 per bucket."""
    return write_shapes_dataset(tmp_path_factory.mktemp("eighteen") / "data", num_images=18)


def _samples(config):
    ds = config.datasets[0]
    return build_metadata(LocalDataBackend(ds.instance_data_dir, ds.id), ds, config, seed=config.seed).samples


def test_apply_writes_a_micro_batch_the_largest_bucket_fills(tmp_path, make_config, eighteen_images, capsys):
    raw = make_config(
        train_batch_size=2,
        mixed_precision="no",
        datasets=[{"id": "shapes", "type": "local", "instance_data_dir": str(eighteen_images)}],
    )
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw, indent=2))
    assert main(["estimate", "--config", str(path), "--gpu", "h100", "--target-effective-batch", "32", "--apply"]) == 0
    out = capsys.readouterr().out
    written = json.loads(path.read_text())
    assert written["train_batch_size"] == 4 and written["gradient_accumulation_steps"] == 8  # 4 x 8 = 32; 8 > 6
    assert "data cap: limited the micro-batch to 4: the largest bucket (dataset 'shapes', " in out
    assert "holds 6 samples" in out and "micro-batch 8, 16, 32 left out" in out
    # What train does with the written file: the sampler accepts it (it refused 32 before).
    config = load_config(path).config
    sampler = BucketSampler(_samples(config), config.train_batch_size)
    assert len(sampler) == 3  # one full micro-batch of 4 in each of the three buckets of 6


def test_the_cap_is_per_process_and_noted_in_the_plan_dict(make_config, eighteen_images):
    config = validate_config(
        make_config(
            train_batch_size=1,
            datasets=[{"id": "shapes", "type": "local", "instance_data_dir": str(eighteen_images), "repeats": 1}],
        )
    )
    data = scan_data_cap(config)
    assert data.largest == 12  # 6 images of the fullest bucket, each twice
    plan = plan_batch(
        config,
        80 * GiB,
        32,
        num_processes=2,
        data=data,
        estimates=EstimateCache(config, 2, estimate_fn=FakeEstimates()),
    )
    assert plan.micro_batch_size == 4 and plan.gradient_accumulation_steps == 4  # 8 x 2 processes > 12
    assert plan.as_dict()["data_cap"] == {
        "largest_bucket": 12,
        "where": data.where,
        "reason": None,
        "micro_batch_limit": 6,
        "left_out": [8, 16],
        "limited": True,
    }
    BucketSampler(_samples(config), plan.micro_batch_size, num_replicas=2)  # train accepts it

    # Memory, not the data, limits a small card: the note says the cap was not the limit.
    small = plan_batch(
        config,
        3882 << 20,
        32,
        num_processes=2,
        data=data,
        estimates=EstimateCache(config, 2, estimate_fn=FakeEstimates()),
    )
    assert small.micro_batch_size < 4 and not small.is_capped_by_data
    assert any("not the limit here" in note for note in small.notes)


def test_no_micro_batch_the_data_fills_is_a_clear_error(make_config, eighteen_images):
    config = validate_config(
        make_config(datasets=[{"id": "shapes", "type": "local", "instance_data_dir": str(eighteen_images)}])
    )
    with pytest.raises(DataTooSmall, match=r"holds 6 samples.*at least 8 samples; add images"):
        plan_batch(
            config,
            80 * GiB,
            16,
            num_processes=8,
            data=scan_data_cap(config),
            estimates=EstimateCache(config, 8, estimate_fn=FakeEstimates()),
        )


def test_without_the_datasets_the_cap_is_unknown_and_the_plan_says_so(make_config, tmp_path):
    config = validate_config(
        make_config(datasets=[{"id": "faraway", "type": "in_memory", "instance_data_dir": str(tmp_path / "not-here")}]),
        check_files=False,
    )
    data = scan_data_cap(config)
    assert data.largest is None and "not-here is not a folder on this machine" in data.reason
    plan = plan_batch(config, 80 * GiB, 32, data=data, estimates=EstimateCache(config, estimate_fn=FakeEstimates()))
    assert plan.micro_batch_size == 32  # nothing to cap with
    (note,) = [n for n in plan.notes if n.startswith("data cap:")]
    assert "data cap: unknown (dataset 'faraway'" in note and "run the estimate where the datasets are" in note
