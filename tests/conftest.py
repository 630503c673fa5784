"""Shared fixtures: offline, single-threaded, tiny models written once per session."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory):
    """A tiny random-weight SD pipeline folder (epsilon prediction)."""
    from simpletuner.models.zoo import write_tiny_sd

    return write_tiny_sd(tmp_path_factory.mktemp("tiny_sd") / "model")


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory):
    """A small captioned dataset of coloured shapes (three aspect ratios)."""
    from simpletuner.demo import write_shapes_dataset

    return write_shapes_dataset(tmp_path_factory.mktemp("shapes") / "data", num_images=12)


@pytest.fixture
def make_config(tiny_sd, shapes_dir, tmp_path):
    """Build a raw config dict for the tiny model; keyword overrides replace keys."""

    def _make(**overrides):
        raw = {
            "pretrained_model_name_or_path": str(tiny_sd),
            "model_family": "sd",
            "output_dir": str(tmp_path / "output"),
            "resolution": 64,
            "aspect_bucket_alignment": 16,
            "train_batch_size": 2,
            "max_train_steps": 4,
            "learning_rate": 1e-3,
            "logging_steps": 1,
            "seed": 123,
            "cache_config": {"cache_dir": str(tmp_path / "cache")},
            "datasets": [{"id": "shapes", "type": "local", "instance_data_dir": str(shapes_dir)}],
        }
        raw.update(overrides)
        return raw

    return _make


def pytest_collection_modifyitems(config, items):
    """Skip tests marked `gpu` where no CUDA device is usable (they run on a lent GPU machine)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fake_runtime():
    """A recording fake CUDA runtime (GH200-like) installed for one test; hint state reset."""
    from fake_cuda import FakeRuntime

    from simpletuner.gh200 import uvm
    from simpletuner.gh200.runtime import use_runtime

    uvm._reset_for_tests()
    runtime = FakeRuntime()
    with use_runtime(runtime):
        yield runtime
    uvm._reset_for_tests()
