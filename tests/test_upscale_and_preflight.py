"""No silent upscaling, no OOM without a word (issue 12, item 1).

Real image folders (the demo's shapes), the tiny SD model and the real Trainer; the machine's
memory is a ``HardwareInfo`` (what the trainer's ``hardware=`` takes), so a run can be judged
against a small machine, or this machine against a run far larger than it, without allocating it.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from simpletuner.configuration import validate_config
from simpletuner.data_backend import LocalDataBackend, build_metadata
from simpletuner.hardware.machine import detect_hardware, hardware_for_gpu
from simpletuner.memory.advice import format_bytes
from simpletuner.memory.preflight import NotEnoughMemory, check_run_memory
from simpletuner.models import get_model_spec
from simpletuner.state import StateTracker
from simpletuner.testing.demo_data import write_shapes_dataset
from simpletuner.training.trainer import Trainer

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(scope="module")
def mixed_sizes(tmp_path_factory):
    """Six 96x96 images and six 32x24 ones (12 in all)."""
    return write_shapes_dataset(tmp_path_factory.mktemp("mixed") / "data", num_images=12, sizes=((96, 96), (32, 24)))


def _config(make_config, folder, resolution=64, **dataset):
    return validate_config(
        make_config(
            resolution=resolution,
            datasets=[{"id": "shapes", "type": "local", "instance_data_dir": str(folder), **dataset}],
        )
    )


def _scan(config):
    ds = config.datasets[0]
    return build_metadata(LocalDataBackend(ds.instance_data_dir, ds.id), ds, config, seed=0)


def _cache_files(config):
    root = config.cache_config.cache_dir
    import pathlib

    return [p for p in pathlib.Path(root).rglob("*") if p.is_file()] if pathlib.Path(root).exists() else []


def test_far_upscaling_stops_the_run_before_caching_naming_how_many_and_by_how_much(make_config, mixed_sizes):
    raw = make_config(
        resolution=4096, datasets=[{"id": "shapes", "type": "local", "instance_data_dir": str(mixed_sizes)}]
    )
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    with pytest.raises(ValueError) as exc:
        trainer.setup()
    message = str(exc.value)
    assert "12 of 12 image files would be upscaled more than 2x" in message and "resolution 4096" in message
    assert "(up to 148.0x: " in message and "is 32x24, its bucket 4736x3552" in message
    for fix in ("Lower `resolution`", "`minimum_image_size`", "`allow_upscale: false`", "`allow_upscale: true`"):
        assert fix in message
    assert _cache_files(trainer.config) == []  # stopped before the cache fill


def test_minimum_image_size_and_no_upscale_skip_and_count(make_config, mixed_sizes, caplog):
    with caplog.at_level(logging.WARNING, logger="simpletuner.data_backend.metadata"):
        kept = _scan(_config(make_config, mixed_sizes, minimum_image_size=64))
    assert {s.original_size for s in kept.samples} == {(96, 96)} and kept.num_skipped_small == {"minimum_image_size": 6}
    assert kept.bad_files == []  # skipped for size, not unreadable
    assert "skipped 6 of 12 image files with a shorter side below minimum_image_size 64 px" in caplog.text

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="simpletuner.data_backend.metadata"):
        native = _scan(_config(make_config, mixed_sizes, allow_upscale=False))
    assert {s.original_size for s in native.samples} == {(96, 96)} and native.num_skipped_small == {"allow_upscale": 6}
    assert "skipped 6 of 12 image files smaller than their bucket (allow_upscale: false)" in caplog.text

    # Asked for explicitly: trained upscaled, with a warning that names the factor.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="simpletuner.data_backend.metadata"):
        upscaled = _scan(_config(make_config, mixed_sizes, resolution=512, allow_upscale=True))
    assert len(upscaled.samples) == 12 and "would be upscaled more than 2x" in caplog.text

    with pytest.raises(ValueError, match=r"every image under .* was skipped by its size rules: 12 of 12"):
        _scan(_config(make_config, mixed_sizes, minimum_image_size=200))


def test_a_few_far_upscaled_images_are_named_in_a_warning_not_a_stop(make_config, mixed_sizes, caplog):
    """Less than max_bad_image_fraction of the dataset (a few odd files, not a wrong resolution) trains with a
    warning; as much or more stops the run, as for unreadable files."""
    config = validate_config(
        {
            **make_config(resolution=128, max_bad_image_fraction=0.6),
            "datasets": [{"id": "shapes", "type": "local", "instance_data_dir": str(mixed_sizes)}],
        }
    )
    with caplog.at_level(logging.WARNING, logger="simpletuner.data_backend.metadata"):
        assert len(_scan(config).samples) == 12
    assert "6 of 12 image files would be upscaled more than 2x" in caplog.text and "set `allow_upscale`" in caplog.text
    with pytest.raises(
        ValueError, match="6 of 12 image files would be upscaled more than 2x .* at least max_bad_image"
    ):
        _scan(validate_config({**config.model_dump(exclude_unset=True), "max_bad_image_fraction": 0.5}))


def _small_machine(host_available, gpu_free=None):
    if gpu_free is None:
        return dataclasses.replace(
            detect_hardware(), device_name=None, gpu_free_bytes=None, host_ram_available_bytes=host_available
        )
    return dataclasses.replace(
        hardware_for_gpu("h100"), gpu_free_bytes=gpu_free, host_ram_available_bytes=host_available
    )


def test_a_run_larger_than_this_machine_stops_before_the_cache_fill(make_config, mixed_sizes):
    """A machine with 256 MiB available against latents of 16384 px images (the largest resolution
    the schema allows) held in RAM: 64 MiB each, computed from the shapes, never allocated."""
    raw = make_config(
        resolution=16384,
        cache_config={"cache_dir": str(make_config()["cache_config"]["cache_dir"]), "vae_cache_type": "memory"},
        datasets=[{"id": "shapes", "type": "local", "instance_data_dir": str(mixed_sizes), "allow_upscale": True}],
    )
    machine = dataclasses.replace(detect_hardware(), host_ram_available_bytes=256 * 2**20)
    trainer = Trainer(StateTracker(validate_config(raw), raw), hardware=dataclasses.replace(machine, device_name=None))
    with pytest.raises(NotEnoughMemory) as exc:
        trainer.setup()
    message = str(exc.value)
    assert "not enough RAM for this run: it needs about" in message and "latent cache (memory, 12 images)" in message
    assert f"this machine has {format_bytes(machine.host_ram_available_bytes)} available (MemAvailable)" in message
    assert "`cache_config.vae_cache_type` / `text_cache_type: disk`" in message and "a smaller `resolution`" in message
    assert isinstance(exc.value, ValueError)  # exit 2 from `simpletuner train`
    assert _cache_files(trainer.config) == []


def test_host_and_device_checks_against_a_small_machine(make_config, shapes_dir, caplog):
    config = validate_config(
        make_config(
            cache_config={"cache_dir": "unused", "vae_cache_type": "memory", "text_cache_type": "unified_memory"}
        )
    )
    spec = get_model_spec(config)

    class Dataset:
        samples = _scan(config).samples

    estimate = check_run_memory(config, spec, [Dataset], torch.float32, _small_machine(64 * GiB))
    (latents, texts, models) = estimate.host.items()
    assert latents[0] == "latent cache (memory, 12 images)" and latents[1] > 0
    assert texts[0].startswith("text-embedding cache (unified_memory, ") and models[0] == "models (weights)"

    with pytest.raises(NotEnoughMemory, match=r"not enough RAM .* and this machine has 1\.0 MiB available"):
        check_run_memory(config, spec, [Dataset], torch.float32, _small_machine(1 * MiB))
    with caplog.at_level(logging.WARNING, logger="simpletuner.memory.preflight"):
        check_run_memory(config, spec, [Dataset], torch.float32, _small_machine(int(estimate.host_total / 0.9)))
    assert "little is left for the rest" in caplog.text

    # A GPU run: the caches are the host's share; the estimator's step against the GPU's free memory.
    with pytest.raises(NotEnoughMemory) as exc:
        check_run_memory(config, spec, [Dataset], torch.float32, _small_machine(64 * GiB, gpu_free=16 * MiB))
    message = str(exc.value)
    assert "not enough GPU memory for this run" in message and "training step, micro-batch 2 (estimate)" in message
    assert "16.0 MiB free" in message and "--target-effective-batch N --apply" in message
