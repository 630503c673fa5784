"""SDXL's size and crop micro-conditioning (simpletuner/caching/size_crop.py, models/sdxl.py): the time ids the
trainer feeds the UNet are each image's size before resizing and its crop offset, as diffusers' SDXL training
script computes them; they are stored with the latents (disk, memory and unified-memory caches alike), and a
latent cached without them (by an older version) is a miss and is encoded again.

The expected figures were computed by hand once from diffusers' ``examples/text_to_image/
train_text_to_image_lora_sdxl.py`` (huggingface/diffusers @ 58eb52c0), at ``resolution`` 64 with ``--center_crop``:

- l.949 ``original_sizes.append((image.height, image.width))``: ``(80, 96)`` for a 96x80 (w x h) image,
  ``(96, 80)`` for an 80x96 one;
- l.932 ``transforms.Resize(64)`` resizes the shorter side to 64 and the longer to ``int(64 * 96 / 80)`` = 76
  (torchvision ``_compute_resized_output_size`` truncates);
- l.954-956 ``y1 = max(0, int(round((h - 64) / 2.0)))``, ``x1`` alike: ``(0, 6)`` for the wide image (76 - 64 = 12
  columns over), ``(6, 0)`` for the tall one;
- l.1137-1147 ``compute_time_ids``: ``original_size + crop_top_left + (64, 64)``.

Our own resize rounds the longer side to 77 (``prepare_image``), and our centre offset floors ``(77 - 64) / 2``:
6 as well, so the two crops start at the same place for these images.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel
from PIL import Image

from simpletuner.caching import MemoryTensorStore, ShardedTensorStore
from simpletuner.caching.size_crop import SIZE_CROP, size_crop_of
from simpletuner.caching.vae_cache import sample_latent_key
from simpletuner.cli import main as simpletuner
from simpletuner.configuration import validate_config
from simpletuner.data_backend import build_datasets, load_rgb, prepare_image
from simpletuner.data_backend.augment import AugmentParams, apply_params
from simpletuner.models import get_model_spec
from simpletuner.state import StateTracker
from simpletuner.training.trainer import Trainer

#: file name -> (width, height) of each image, and its time ids in diffusers' script (see the module docstring).
IMAGES = {"wide.png": (96, 80), "tall.png": (80, 96)}
SCRIPT_TIME_IDS = {"wide.png": [80.0, 96.0, 0.0, 6.0, 64.0, 64.0], "tall.png": [96.0, 80.0, 6.0, 0.0, 64.0, 64.0]}
#: What today's pipeline default (and the project before this change) passed for the 64x64 bucket.
BUCKET_TIME_IDS = [64.0, 64.0, 0.0, 0.0, 64.0, 64.0]


def _picture(width: int, height: int) -> Image.Image:
    """A smooth colour gradient, so every crop of it is different."""
    x = torch.linspace(0, 1, width).expand(height, width)
    y = torch.linspace(0, 1, height).unsqueeze(1).expand(height, width)
    rgb = torch.stack([x, y, (x + y) / 2], dim=-1).mul(255).round().to(torch.uint8)
    return Image.fromarray(rgb.numpy())


@pytest.fixture
def crops_dir(tmp_path) -> Path:
    folder = tmp_path / "crops"
    folder.mkdir()
    for name, size in IMAGES.items():
        _picture(*size).save(folder / name)
        (folder / name).with_suffix(".txt").write_text(f"a gradient, {name[:-4]}")
    return folder


@pytest.fixture
def sdxl_raw(zoo_config, crops_dir, tmp_path):
    """A config whose two images both train in one 64x64 bucket, centre-cropped (SimpleTuner's geometry with a
    square crop), one step of batch 2, into the output folder ``run``; keyword overrides go to ``cache_config``."""

    def _make(run: str = "output", **cache) -> dict:
        raw = zoo_config(
            "sdxl",
            output_dir=str(tmp_path / run),
            train_batch_size=2,
            max_train_steps=1,
            datasets=[
                {
                    "id": "crops",
                    "type": "local",
                    "instance_data_dir": str(crops_dir),
                    "crop": True,
                    "crop_aspect": "square",
                    "resolution_type": "pixel",
                    "crop_style": "center",
                }
            ],
        )
        raw["cache_config"].update(cache)
        return raw

    return _make


@pytest.fixture
def fed_time_ids(monkeypatch) -> list[torch.Tensor]:
    """Every ``added_cond_kwargs["time_ids"]`` the UNet is called with."""
    seen: list[torch.Tensor] = []
    forward = UNet2DConditionModel.forward

    def recording(self, *args, **kwargs):
        seen.append(kwargs["added_cond_kwargs"]["time_ids"].detach().clone())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(UNet2DConditionModel, "forward", recording)
    return seen


def _train(raw: dict) -> Trainer:
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    trainer.train()
    return trainer


def _rows(ids: torch.Tensor) -> list[list[float]]:
    return sorted(ids.tolist())


def _by_name(trainer: Trainer) -> dict[str, list]:
    """Sample file name -> the size and crop its batch carries."""
    samples = trainer.state.datasets[0].samples
    batch = trainer.data.batch(samples, torch.device("cpu"))
    return {s.path: batch.conditioning[SIZE_CROP][i].tolist() for i, s in enumerate(samples)}


def _expected_size_crops() -> dict[str, list[float]]:
    return {name: ids[:4] for name, ids in SCRIPT_TIME_IDS.items()}


def test_the_trainer_feeds_each_images_size_and_crop_as_diffusers_script_does_and_the_caches_keep_them(
    sdxl_raw, fed_time_ids, tmp_path
):
    """One run, then the disk and memory caches it filled (one test: both read the same first run)."""
    trainer = _train(sdxl_raw())
    assert trainer.data.fill_reports["latents"].num_computed == 2
    assert fed_time_ids and all(_rows(ids) == sorted(SCRIPT_TIME_IDS.values()) for ids in fed_time_ids)
    assert _by_name(trainer) == _expected_size_crops()

    # The ids move the prediction: the same batch, noise and timesteps with the bucket's default ids differ.
    samples = trainer.state.datasets[0].samples
    batch = trainer.data.batch(samples, torch.device("cpu"))
    model = trainer.accelerator.unwrap_model(trainer.model)
    without = {k: v for k, v in batch.conditioning.items() if k != SIZE_CROP}
    assert _rows(trainer.spec.time_ids(batch.latents)) == [BUCKET_TIME_IDS] * 2  # the pipeline's default
    fed_by_the_run = len(fed_time_ids)
    with torch.no_grad():
        real = trainer.spec.training_loss(model, batch.latents, batch.conditioning, torch.Generator().manual_seed(0))
        bucket = trainer.spec.training_loss(model, batch.latents, without, torch.Generator().manual_seed(0))
    assert not torch.allclose(real, bucket, rtol=0, atol=1e-6), (real, bucket)
    del fed_time_ids[fed_by_the_run:]  # these two calls are this check's, not a run's

    # The values survive the disk and memory caches.
    folder = Path(trainer.config.cache_config.cache_dir) / "sdxl" / "vae"
    on_disk = ShardedTensorStore(folder)
    entries = {key: on_disk.get(key) for key in on_disk.keys()}
    assert len(entries) == 2 and all(set(entry) == {"latents", SIZE_CROP} for entry in entries.values())
    assert sorted(entry[SIZE_CROP].tolist() for entry in entries.values()) == sorted(_expected_size_crops().values())
    # Another process's store on the folder (a shared fill's other rank) indexes the same entries.
    memory = MemoryTensorStore("vae", backing=ShardedTensorStore(folder))
    assert all(torch.equal(memory.get(k)[SIZE_CROP], entries[k][SIZE_CROP]) for k in entries)

    # memory / unified_memory caches loaded from that folder: hits, the same ids fed.
    for kind in ("memory", "unified_memory"):
        again = _train(sdxl_raw(kind, vae_cache_type=kind))
        report = again.data.fill_reports["latents"]
        assert (report.num_hits, report.num_computed) == (2, 0), kind
        assert _by_name(again) == _expected_size_crops(), kind
    # A memory cache of its own (nothing on disk) encodes them itself.
    fresh = _train(sdxl_raw("fresh", vae_cache_type="memory", persistent_cache=False, cache_dir=str(tmp_path / "c")))
    assert fresh.data.fill_reports["latents"].num_computed == 2
    assert _by_name(fresh) == _expected_size_crops()
    assert fed_time_ids and all(_rows(ids) == sorted(SCRIPT_TIME_IDS.values()) for ids in fed_time_ids)


def test_a_latent_cached_without_them_is_a_miss_and_is_encoded_again(sdxl_raw, fed_time_ids, tmp_path):
    raw = sdxl_raw()
    config = validate_config(raw)
    state = StateTracker(config, raw)
    spec = get_model_spec(config)
    (dataset,) = build_datasets(state.config, spec)
    identity = spec.image_encoder_identity()
    # What an older version stored: the latent alone, under the key it used (no size and crop in it).
    old_keys = [sample_latent_key(dataset, s, identity, config.resolution) for s in dataset.samples]
    new_keys = [sample_latent_key(dataset, s, identity, config.resolution, size_crop=True) for s in dataset.samples]
    assert not set(old_keys) & set(new_keys)
    store = ShardedTensorStore(Path(config.cache_config.cache_dir) / "sdxl" / "vae")
    store.put_many({key: {"latents": torch.zeros(4, 8, 8)} for key in old_keys})

    trainer = _train(raw)
    report = trainer.data.fill_reports["latents"]
    assert (report.num_hits, report.num_computed) == (0, 2)
    assert sorted(trainer.data.latent_keys.values()) == sorted(new_keys)
    assert fed_time_ids and all(_rows(ids) == sorted(SCRIPT_TIME_IDS.values()) for ids in fed_time_ids)
    assert _by_name(trainer) == _expected_size_crops()

    # `simpletuner cache clear --stale-only` removes the old entries and keeps the new ones.
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(raw))
    assert simpletuner(["cache", "clear", "--config", str(cfg), "--stale-only", "--yes"]) == 0
    assert sorted(ShardedTensorStore(store.root).keys()) == sorted(new_keys)


# --- the coordinates, image by image ------------------------------------------------------------------------------
def _exif_rotated_jpeg(width: int, height: int, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    _picture(width, height).save(out, format="JPEG", exif=exif)
    return out.getvalue()


def test_the_original_size_is_the_image_as_displayed_after_its_exif_orientation():
    # Stored 96 wide x 80 high, orientation 6 (rotated 90 degrees): displayed, and trained, 80 wide x 96 high.
    image = load_rgb(_exif_rotated_jpeg(96, 80, 6))
    _, info = prepare_image(image, (64, 64), "center", 0)
    assert size_crop_of(info) == (96, 80, 6, 0)


@pytest.mark.parametrize("style", ["center", "random", "corner"])
def test_a_mirrored_window_is_offset_from_the_mirrored_images_left(style):
    """``flip_probability``: the model sees the mirror of the window; its offset is where that mirror lies in the
    mirrored resized image (as the script, which flips before it crops, reports it)."""
    image = _picture(96, 80)
    pixels, info = prepare_image(image, (64, 64), style, crop_seed=3)
    resized, _ = prepare_image(image, info["resized_size"], "corner", 0)  # the same resize, nothing cropped
    assert torch.equal(pixels, resized[:, info["crop_top"] : info["crop_top"] + 64, info["crop_left"] :][..., :64])
    top, left = size_crop_of(info, AugmentParams(flip=True))[2:]
    mirrored = torch.flip(resized, dims=[-1])
    assert torch.equal(apply_params(pixels, AugmentParams(flip=True)), mirrored[:, top : top + 64, left : left + 64])
    assert size_crop_of(info, AugmentParams())[2:] == (info["crop_top"], info["crop_left"])


def test_a_zoomed_window_is_offset_in_the_zoomed_image():
    """``crop_jitter`` enlarges the window and cuts it again: the offset is in the resized image enlarged alike."""
    _, info = prepare_image(_picture(96, 80), (64, 64), "center", 0)  # resized 77 x 64, window at left 6
    params = AugmentParams(crop_scale=1.5, crop_x=1.0, crop_y=0.0)  # 96 x 96, the window at the right edge
    assert size_crop_of(info, params) == (80, 96, 0, 9 + 32)  # 6 * 1.5 = 9 in the enlarged image, then 32 over
    # Mirrored: the enlarged image is 77 * 1.5 = 115.5 -> 116 wide, and the window's right edge 41 + 64 from its left.
    flipped = AugmentParams(flip=True, crop_scale=1.5, crop_x=1.0, crop_y=0.0)
    assert size_crop_of(info, flipped) == (80, 96, 0, 116 - 41 - 64)


@pytest.mark.parametrize("mode", ["static", "refresh_each_epoch", "disable_cache"])
def test_every_cache_mode_feeds_the_size_and_crop_of_the_augmented_window(sdxl_raw, fed_time_ids, mode):
    """Flipped every time: the wide image's window (6 columns from the left of a 77-wide resize) is 7 from the
    left of the mirrored one; the tall image's (full width) stays at 0. Latents cached once (``static``), per
    epoch, or encoded while training: each carries them to the UNet."""
    raw = dict(sdxl_raw(), augmentations={"flip_probability": 1.0}, augmentations_cache_mode=mode)
    trainer = _train(raw)
    flipped = {"wide.png": [80.0, 96.0, 0.0, 7.0, 64.0, 64.0], "tall.png": SCRIPT_TIME_IDS["tall.png"]}
    assert fed_time_ids and all(_rows(ids) == sorted(flipped.values()) for ids in fed_time_ids)
    assert _by_name(trainer) == {name: ids[:4] for name, ids in flipped.items()}


def test_a_sample_trained_with_the_empty_caption_keeps_its_size_and_crop(sdxl_raw, monkeypatch):
    """Caption dropout replaces the text only: the pipeline passes the same time ids to both guidance branches."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    forward = UNet2DConditionModel.forward

    def recording(self, sample, timestep, encoder_hidden_states, *args, **kwargs):
        calls.append((encoder_hidden_states.detach().clone(), kwargs["added_cond_kwargs"]["time_ids"].clone()))
        return forward(self, sample, timestep, encoder_hidden_states, *args, **kwargs)

    monkeypatch.setattr(UNet2DConditionModel, "forward", recording)
    trainer = _train(dict(sdxl_raw(), caption_dropout_probability=0.99))
    empty = trainer.data.text_cache.get(trainer.data.text_keys[""])["prompt_embeds"]
    dropped = [ids for embeds, ids in calls if all(torch.equal(row, empty) for row in embeds)]
    assert dropped, "the training step should have dropped both captions"
    assert all(_rows(ids) == sorted(SCRIPT_TIME_IDS.values()) for ids in dropped)
