"""Augmentations: the pixel math, and what each `augmentations_cache_mode` encodes when (real tiny SD
VAE, real files), including a crash in the middle of a refresh and exact resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import cached_data, train

from simpletuner.caching import MemoryTensorStore, ShardedTensorStore, sample_latent_key
from simpletuner.caching.reencode import EpochLatents
from simpletuner.configuration import validate_config
from simpletuner.configuration.schema import Augmentations
from simpletuner.data_backend import BucketSampler
from simpletuner.data_backend.augment import (
    AugmentParams,
    apply_params,
    augment_pixels,
    augmentation_key,
    crop_window,
    draw_params,
)
from simpletuner.models import get_model_spec
from simpletuner.models.sd import StableDiffusionSpec
from simpletuner.training import checkpoint as ckpt

AUG = {"flip_probability": 0.5, "crop_jitter": 0.1, "color_jitter": 0.2}
CPU = torch.device("cpu")


def _pixels(*shape, seed=0) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


# --- the pixel math ---------------------------------------------------------------------------------
def test_flip_mirrors_and_colour_factor_one_is_identity():
    x = _pixels(3, 8, 12)
    assert torch.equal(apply_params(x, AugmentParams(flip=True)), torch.flip(x, dims=[-1]))
    assert torch.equal(apply_params(x, AugmentParams()), x)
    assert torch.equal(apply_params(x, AugmentParams(brightness=1.0, contrast=1.0, saturation=1.0)), x)
    darker = apply_params(x, AugmentParams(brightness=0.5))
    assert darker.mean() < x.mean() and darker.min() >= -1 and darker.max() <= 1
    grey = apply_params(x, AugmentParams(saturation=0.0))
    assert torch.allclose(grey[0], grey[1], atol=1e-6) and torch.allclose(grey[1], grey[2], atol=1e-6)


@pytest.mark.parametrize("jitter", [0.05, 0.25, 0.49])
def test_crop_jitter_stays_in_bounds_and_keeps_shape_and_range(jitter):
    aug = Augmentations(crop_jitter=jitter)
    x = _pixels(3, 48, 80)
    offsets = set()
    for version in range(40):
        params = draw_params(aug, 7, "ds/a.png", version)
        scaled_h, scaled_w, top, left = crop_window(48, 80, params)
        assert 0 <= top <= scaled_h - 48 and 0 <= left <= scaled_w - 80
        assert scaled_w - 80 <= round(2 * jitter * 80) + 1  # scaled up only as far as the jitter needs
        offsets.add((top, left))
        out = augment_pixels(x, aug, 7, "ds/a.png", version)
        assert out.shape == x.shape and out.min() >= -1 and out.max() <= 1
    assert len(offsets) > 10  # the window really moves
    edge = AugmentParams(crop_scale=1 + 2 * jitter, crop_x=1.0, crop_y=1.0)  # the far corner still fits
    assert apply_params(x, edge).shape == x.shape


def test_same_seed_same_output_and_versions_differ():
    aug = Augmentations(**AUG)
    x = _pixels(3, 32, 32)
    a = augment_pixels(x, aug, 1, "ds/a.png", 3)
    assert torch.equal(a, augment_pixels(x, aug, 1, "ds/a.png", 3))
    others = [augment_pixels(x, aug, *args) for args in [(2, "ds/a.png", 3), (1, "ds/b.png", 3), (1, "ds/a.png", 4)]]
    assert all(not torch.equal(a, o) for o in others)
    assert torch.equal(augment_pixels(x, Augmentations(), 1, "ds/a.png", 3), x)  # disabled: untouched
    with pytest.raises(ValueError, match=r"\[3, H, W\]"):
        augment_pixels(torch.zeros(4, 8, 8), aug, 1, "k", 0)


def test_video_frames_get_the_same_augmentation():
    aug = Augmentations(**AUG)
    frame = _pixels(3, 32, 48)
    clip = torch.stack([frame] * 5, dim=1)  # [3, F, H, W]
    out = augment_pixels(clip, aug, 3, "clips/a.mp4", 1)
    assert out.shape == clip.shape
    image_out = augment_pixels(frame, aug, 3, "clips/a.mp4", 1)
    for f in range(5):
        assert torch.allclose(out[:, f], image_out, atol=1e-6)
    # Different frames: the same flip and window on each (geometry only, so frames are independent).
    params = AugmentParams(flip=True, crop_scale=1.3, crop_x=0.2, crop_y=0.9)
    moving = _pixels(3, 4, 32, 48, seed=5)
    out = apply_params(moving, params)
    for f in range(4):
        assert torch.allclose(out[:, f], apply_params(moving[:, f], params), atol=1e-6)


def test_cache_key_description():
    aug = Augmentations(**AUG)
    key = augmentation_key(aug, 42, 0)
    import json

    assert json.loads(json.dumps(key)) == key and key["version"] == 0 and key["seed"] == 42
    assert augmentation_key(aug, 42, 1) != key and augmentation_key(Augmentations(), 42, 0) is None


# --- removal and markers of the stores -----------------------------------------------------------------
def _entry(i: int) -> dict[str, torch.Tensor]:
    return {"latents": torch.full((2, 2), float(i))}


@pytest.mark.parametrize("kind", ["disk", "memory"])
def test_store_remove_and_markers(tmp_path, kind):
    disk = ShardedTensorStore(tmp_path / "s")
    store = disk if kind == "disk" else MemoryTensorStore("t")
    store.put_many({"a": _entry(1), "b": _entry(2)})
    store.put_many({"c": _entry(3)})
    assert store.remove(["a", "c", "zz"]) == 2
    assert store.keys() == ["b"] and torch.equal(store.get("b")["latents"], _entry(2)["latents"])
    if kind == "disk":
        assert len(list((tmp_path / "s").glob("shard-*"))) == 1  # c's shard deleted, a+b's rewritten
        assert ShardedTensorStore(tmp_path / "s").keys() == ["b"]
    store.write_marker("epoch-3", {"keys": "abc"})
    assert store.read_marker("epoch-3") == {"keys": "abc"} and store.marker_names() == ["epoch-3"]
    store.remove_marker("epoch-3")
    assert store.read_marker("epoch-3") is None and store.marker_names() == []
    with pytest.raises(ValueError, match="marker name"):
        store.write_marker("../x", {})


# --- what is encoded when ---------------------------------------------------------------------------
@pytest.fixture
def encodes(monkeypatch):
    """Counts images through the real SD VAE; ``fail_after`` makes it raise after that many more."""
    real = StableDiffusionSpec.encode_images
    record = {"images": 0, "fail_after": None, "pixels": []}

    def counting(self, vae, pixels):
        if record["fail_after"] is not None:
            if record["fail_after"] < pixels.shape[0]:
                raise RuntimeError("simulated crash while encoding")
            record["fail_after"] -= pixels.shape[0]
        record["images"] += pixels.shape[0]
        record["pixels"].append(pixels.clone())
        return real(self, vae, pixels)

    monkeypatch.setattr(StableDiffusionSpec, "encode_images", counting)
    return record


def _prepare(make_config, **overrides):
    data, datasets, config, _ = cached_data(make_config, **overrides)
    return data, datasets, config


def _sampler(datasets, config, rank=0, replicas=1):
    return BucketSampler(
        [s for ds in datasets for s in ds.samples], config.train_batch_size, replicas, rank, config.seed
    )


def _keys(datasets, config, version) -> dict[str, str]:
    identity = get_model_spec(config).image_encoder_identity()
    augment = augmentation_key(config.augmentations, config.seed, version)
    return {
        s.key: sample_latent_key(ds, s, identity, config.resolution, augment=augment)
        for ds in datasets
        for s in ds.samples
    }


def _shard_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("shard-*.safetensors"))


def test_static_encodes_each_image_once_under_a_key_of_its_own(make_config, encodes, tmp_path):
    plain, datasets, config = _prepare(make_config)
    assert encodes["images"] == 12
    data, datasets, config = _prepare(make_config, augmentations=AUG)
    assert encodes["images"] == 24  # augmented latents have keys of their own
    assert set(data.latent_keys.values()).isdisjoint(plain.latent_keys.values())
    assert plain.latent_keys == {k: v for k, v in _keys(datasets, validate_config(make_config()), 0).items()}
    batches = data.iterate(_sampler(datasets, config), CPU)
    for _ in range(18):  # three epochs
        next(batches)
    assert encodes["images"] == 24
    key = datasets[0].samples[0].key
    assert not torch.equal(
        data.vae_cache.get(data.latent_keys[key])["latents"], plain.vae_cache.get(plain.latent_keys[key])["latents"]
    )
    again, _, _ = _prepare(make_config, augmentations=AUG)
    assert encodes["images"] == 24 and again.fill_reports["latents"].num_hits == 12


@pytest.mark.parametrize("persistent", [True, False])
def test_refresh_each_epoch_reencodes_per_epoch_and_removes_the_old_version(
    make_config, encodes, monkeypatch, persistent
):
    snapshots = {}
    real_prepare = EpochLatents.prepare

    def observed(self, sampler, epoch):
        before = encodes["images"]
        keys = real_prepare(self, sampler, epoch)
        on_disk = ShardedTensorStore(self.cache.store.root)
        snapshots[epoch] = (
            encodes["images"] - before,
            set(on_disk.keys()),
            on_disk.marker_names(),
            self._threads._pool,
        )
        return keys

    monkeypatch.setattr(EpochLatents, "prepare", observed)
    data, datasets, config = _prepare(
        make_config,
        augmentations=AUG,
        augmentations_cache_mode="refresh_each_epoch",
        dataloader_num_workers=2,
        dataloader_persistent_workers=persistent,
    )
    assert encodes["images"] == 0 and not _shard_files(Path(config.cache_config.cache_dir) / "sd" / "vae")
    batches = data.iterate(_sampler(datasets, config), CPU)
    seen = [next(batches) for _ in range(18)]  # three epochs of 6 batches
    assert sorted(snapshots) == [0, 1, 2]
    for epoch, (num_encoded, on_disk, markers, _) in snapshots.items():
        assert num_encoded == 12
        assert on_disk == set(_keys(datasets, config, epoch).values())  # nothing of epoch - 1 is left
        assert markers == [f"epoch-{epoch}"]
    # A sample's latents change from one epoch to the next.
    first = {s.key: b.latents[i] for b in seen[:6] for i, s in enumerate(b.samples)}
    second = {s.key: b.latents[i] for b in seen[6:12] for i, s in enumerate(b.samples)}
    assert sum(not torch.equal(first[k], second[k]) for k in first) >= 10
    pools = [snap[3] for snap in snapshots.values()]
    if persistent:  # one pool, reused by every refresh
        assert data.decode_threads.num_started == 1 and pools[0] is pools[1] is pools[2] is not None
    else:  # a pool for the start-up decode and one per refresh, each shut down after
        assert data.decode_threads.num_started == 4 and pools == [None, None, None]
    data.close()


def test_refresh_in_memory_without_persistence_writes_nothing(make_config, encodes):
    data, datasets, config = _prepare(
        make_config,
        augmentations=AUG,
        augmentations_cache_mode="refresh_each_epoch",
        cache_config={
            "cache_dir": make_config()["cache_config"]["cache_dir"],
            "vae_cache_type": "memory",
            "persistent_cache": False,
        },
    )
    batches = data.iterate(_sampler(datasets, config), CPU)
    for _ in range(12):
        next(batches)
    assert encodes["images"] == 24 and len(data.epoch_latents.cache) == 12
    assert not (Path(config.cache_config.cache_dir) / "sd" / "vae-epochs").exists()


def test_refresh_shards_by_process_without_sharing_files(make_config, encodes):
    ranks = []
    for rank in range(2):
        data, datasets, config = _prepare(make_config, augmentations=AUG, augmentations_cache_mode="refresh_each_epoch")
        ranks.append((data, data.iterate(_sampler(datasets, config, rank, 2), CPU)))
    for _ in range(3 + 1):  # all of epoch 0 (3 batches per process), then epoch 1 begins
        for _, batches in ranks:
            next(batches)
    folders = [data.epoch_latents.cache.store.root for data, _ in ranks]
    assert [f.name for f in folders] == ["rank-0-of-2", "rank-1-of-2"]
    held = [set(ShardedTensorStore(f).keys()) for f in folders]
    assert held[0].isdisjoint(held[1])
    assert held[0] | held[1] == set(_keys(datasets, config, 1).values())  # each process encoded its own share
    assert encodes["images"] == 24


def test_disable_cache_encodes_every_batch_and_stores_no_latents(make_config, encodes):
    data, datasets, config = _prepare(
        make_config, augmentations=AUG, augmentations_cache_mode="disable_cache", dataloader_num_workers=1
    )
    assert encodes["images"] == 0
    batches = data.iterate(_sampler(datasets, config), CPU)
    seen = [next(batches) for _ in range(12)]
    assert encodes["images"] == 24
    cache = Path(config.cache_config.cache_dir) / "sd"
    assert not _shard_files(cache / "vae") and not (cache / "vae-epochs").exists()
    assert _shard_files(cache / "text")  # text embeddings stay cached
    first = {s.key: b.latents[i] for b in seen[:6] for i, s in enumerate(b.samples)}
    second = {s.key: b.latents[i] for b in seen[6:] for i, s in enumerate(b.samples)}
    assert sum(not torch.equal(first[k], second[k]) for k in first) >= 10  # a fresh augmentation per read
    fixed = data.batch(seen[0].samples, CPU).latents  # outside the training order: one fixed version
    assert torch.equal(fixed, data.batch(seen[0].samples, CPU).latents)
    assert data.decode_threads.num_started == 3  # start-up decode + one per epoch (not persistent)


# --- resumes through the real Trainer ----------------------------------------------------------------
def _same_weights(a, b) -> bool:
    wa, wb = load_file(a.output_path), load_file(b.output_path)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_crash_mid_refresh_is_not_read_as_complete_and_resume_is_exact(make_config, encodes, monkeypatch, tmp_path):
    common = dict(augmentations=AUG, augmentations_cache_mode="refresh_each_epoch", max_train_steps=12)
    _, straight = train(make_config(output_dir=str(tmp_path / "straight"), **common))

    epochs = {}
    real_prepare = EpochLatents.prepare

    def crash_in_epoch_1(self, sampler, epoch):
        epochs["cache"] = self.cache
        if epoch == 1:
            encodes["fail_after"] = 10  # the refresh's third VAE batch (of 4 images) fails
        return real_prepare(self, sampler, epoch)

    monkeypatch.setattr(EpochLatents, "prepare", crash_in_epoch_1)
    out = tmp_path / "run"
    raw = make_config(output_dir=str(out), checkpointing_steps=6, **common)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(raw)
    folder = Path(raw["cache_config"]["cache_dir"]) / "sd" / "vae-epochs" / "rank-0-of-1"
    left = ShardedTensorStore(folder)
    assert left.marker_names() == []  # neither epoch 0 (removed first) nor the half-done epoch 1
    assert 0 < len(left) < 12  # the batches written before the crash

    encodes["fail_after"] = None
    monkeypatch.setattr(EpochLatents, "prepare", real_prepare)
    before = encodes["images"]
    resumed, result = train(dict(raw, resume_from_checkpoint="latest"))
    report = resumed.data.epoch_latents.reports[1]
    assert report.num_hits == 0 and report.num_computed == 12  # re-encoded whole, not topped up
    assert encodes["images"] - before >= 12
    assert ckpt.find_latest(out).name == "checkpoint-12" and result.global_step == 12
    assert result.losses == pytest.approx(straight.losses[6:], rel=0, abs=0)
    assert _same_weights(straight, result)


def test_disable_cache_resume_reproduces_the_augmentations(make_config, tmp_path):
    common = dict(
        augmentations=AUG,
        augmentations_cache_mode="disable_cache",
        max_train_steps=8,
        gradient_accumulation_steps=2,
        dataloader_num_workers=1,
        dataloader_persistent_workers=True,
    )
    straight_trainer, straight = train(make_config(output_dir=str(tmp_path / "straight"), **common))
    assert straight_trainer.data._reencoder.vae is not None  # kept loaded after set-up
    out = str(tmp_path / "run")
    train(
        make_config(output_dir=out, checkpointing_steps=3, checkpoint_at_end=False, **common)
    )  # as if stopped after 6
    latest = ckpt.find_latest(Path(out))
    _, resumed = train(make_config(output_dir=out, resume_from_checkpoint=str(latest), **common))
    assert latest.name == "checkpoint-6" and resumed.global_step == 8
    assert resumed.losses == pytest.approx(straight.losses[6:], rel=0, abs=0)
    assert _same_weights(straight, resumed)
