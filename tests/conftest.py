"""Shared fixtures: offline, single-threaded, tiny models written once per session."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `simpletuner estimate` keeps estimates on disk between runs (memory/estimate_store.py): tests estimate afresh
os.environ.setdefault("SIMPLETUNER_ESTIMATE_CACHE", "off")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory):
    """A tiny random-weight SD pipeline folder (epsilon prediction)."""
    from simpletuner.testing.zoo import write_tiny_sd

    return write_tiny_sd(tmp_path_factory.mktemp("tiny_sd") / "model")


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory):
    """A small captioned dataset of coloured shapes (three aspect ratios)."""
    from simpletuner.testing.demo_data import write_shapes_dataset

    return write_shapes_dataset(tmp_path_factory.mktemp("shapes") / "data", num_images=12)


@pytest.fixture(scope="session")
def zoo(tiny_sd, tmp_path_factory):
    """``name -> folder`` of a tiny zoo model (``simpletuner zoo --family name``), written once per session on
    first use and shared by every test file (read only)."""
    from simpletuner.testing.zoo import write_tiny_model

    made = {"sd": tiny_sd}

    def get(name: str):
        if name not in made:
            made[name] = write_tiny_model(name, tmp_path_factory.mktemp(f"zoo_{name}") / "model")
        return made[name]

    return get


@pytest.fixture
def make_config(tiny_sd, shapes_dir, tmp_path):
    """Build a raw config dict for the tiny model (training_helpers.tiny_config); keyword overrides
    replace keys."""
    from training_helpers import tiny_config  # here, as in the fixtures above: it imports the Trainer

    def _make(**overrides):
        return tiny_config(tiny_sd, shapes_dir, tmp_path, **overrides)

    return _make


@pytest.fixture
def zoo_config(make_config, zoo):
    """``make_config`` on the zoo model ``name`` (``model_family`` ``family``, default ``name``): keyword
    overrides replace keys."""

    def _make(name: str, family: str | None = None, **overrides):
        return make_config(
            **{"pretrained_model_name_or_path": str(zoo(name)), "model_family": family or name, **overrides}
        )

    return _make


def pytest_collection_finish(session):
    """Freeze what collection made (the libraries and test modules, alive for the whole session), as
    ``simpletuner train`` does after its imports (startup.quiet_gc_while_importing): every later full
    collection, the trainer's own ``gc.collect()`` included, then skips those ~500k objects (~0.4 s each)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap():
    """The same at each test file's start, once the previous file's fixtures are gone: what lives on (libraries
    imported since, session fixtures) is frozen, whatever froze or unfroze the heap in between (an in-process
    ``simpletuner train`` freezes everything alive, garbage included; test_startup unfreezes)."""
    gc.collect()
    gc.freeze()


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
    from simpletuner.hardware.runtime import use_runtime

    uvm._reset_for_tests()
    runtime = FakeRuntime()
    with use_runtime(runtime):
        yield runtime
    uvm._reset_for_tests()


@pytest.fixture
def clean_uvm_state(monkeypatch):
    """No SIMPLETUNER_GH200_UVM_HINTS from the caller's shell, no hint override, nothing said yet; the
    process's CUDA runtime restored afterwards (gh200.uvm keeps these per process)."""
    from simpletuner.gh200 import uvm
    from simpletuner.hardware import runtime as runtime_module

    monkeypatch.delenv(uvm.ENV_VAR, raising=False)
    monkeypatch.setattr(runtime_module, "_runtime", runtime_module._runtime)
    uvm._reset_for_tests()
    yield
    uvm._reset_for_tests()


@pytest.fixture
def hub_server(monkeypatch, tmp_path):
    """A local Hub on 127.0.0.1 (hub_server.HubServer) with this process's huggingface_hub client pointed at it
    and online for the test (HF_ENDPOINT, HF_HUB_OFFLINE off, Xet off, no implicit token: see HubServer.use); the
    default Hub cache is ``hub_server.cache_dir`` (tmp_path / "hf_cache"), never the user's."""
    from hub_server import running_hub_server

    with running_hub_server(monkeypatch, cache_dir=tmp_path / "hf_cache") as server:
        yield server
