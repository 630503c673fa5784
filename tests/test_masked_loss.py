"""Masked loss (``mask_data_dir``, ``mask_type``, ``masked_loss_probability``): a mask follows its image's resize,
crop and flip, is cached with the latents, and weights the loss of each latent pixel as SimpleTuner's
``loss * mask`` then ``mean`` does (common.py:6409-6426 at SIMPLETUNER_COMMIT)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from PIL import Image
from training_helpers import cached_data, training_sampler

from simpletuner.caching.reencode import PixelLoader
from simpletuner.configuration import ConfigError, load_config, validate_config
from simpletuner.configuration.simpletuner import translate as dialect
from simpletuner.data_backend import build_datasets
from simpletuner.data_backend.augment import apply_params, draw_params
from simpletuner.data_backend.masks import MASK_KEY, augment_mask, latent_mask, mask_draw, mask_pixels
from simpletuner.training.batches import MaskedLoss

#: The image and its mask: 160x128 pixels; resolution 64 with a square crop resizes them by 1/2 to 80x64 and
#: cuts 8 pixels off the left. The mask is white over x 48..79, y 16..47 of the file: 24..39 x 8..23 resized,
#: 16..31 x 8..23 in the 64x64 crop: latent cells (8 px each) x 2..3, y 1..2.
SIZE = (160, 128)
WHITE = (48, 16, 80, 48)
REGION = (slice(1, 3), slice(2, 4))  # latent rows, columns
FLIPPED = (slice(1, 3), slice(4, 6))  # mirrored: pixels 32..47 of the crop
GRID = (8, 8)


def _write_pair(root, name="a", white=WHITE):
    gen = torch.Generator().manual_seed(0)
    pixels = (torch.rand(SIZE[1], SIZE[0], 3, generator=gen) * 255).to(torch.uint8).numpy()
    (root / "img").mkdir(exist_ok=True)
    (root / "masks").mkdir(exist_ok=True)
    Image.fromarray(pixels).save(root / "img" / f"{name}.png")
    (root / "img" / f"{name}.txt").write_text("a photo")
    mask = Image.new("L", SIZE, 0)
    mask.paste(255, white)
    mask.save(root / "masks" / f"{name}.png")


def _dataset(root, **extra):
    return {
        "id": "masked",
        "type": "local",
        "instance_data_dir": str(root / "img"),
        "mask_data_dir": str(root / "masks"),
        "crop": True,
        "crop_aspect": "square",
        "resolution_type": "pixel",
        **extra,
    }


def _hand_mask(region, batch=1) -> torch.Tensor:
    mask = torch.zeros(batch, 1, *GRID)
    mask[(slice(None), slice(None), *region)] = 1.0
    return mask


@pytest.fixture
def pair(tmp_path):
    _write_pair(tmp_path)
    return tmp_path


@pytest.mark.parametrize("flip", [0.0, 1.0])
def test_the_cached_mask_is_the_region_the_image_shows_there(make_config, pair, flip):
    """Resize (1/2), square centre crop and flip: the cached weights are 1 exactly on the latent cells the white
    region lands on, 0 elsewhere."""
    data, datasets, config, _ = cached_data(
        make_config, datasets=[_dataset(pair)], augmentations={"flip_probability": flip}, train_batch_size=1
    )
    (sample,) = datasets[0].samples
    assert (sample.bucket, sample.original_size, sample.mask_type) == ((64, 64), SIZE, "mask")
    batch = data.batch([sample], torch.device("cpu"))
    assert torch.equal(batch.conditioning[MASK_KEY], _hand_mask(FLIPPED if flip else REGION))


def test_a_mask_takes_the_images_augmentation_window(make_config, pair):
    """Crop jitter and a flip move a mask as they move its image: an image made of the mask comes out as the mask."""
    from simpletuner.configuration.sections import Augmentations

    config = validate_config(make_config(datasets=[_dataset(pair)]))
    (dataset,) = build_datasets(config)
    (sample,) = dataset.samples
    params = draw_params(Augmentations(flip_probability=1.0, crop_jitter=0.2), 7, sample.key, 0)
    assert params.flip and params.crop_scale > 1
    loaded = PixelLoader(config).load(dataset, sample, None)
    assert loaded is not None and loaded.mask is not None
    mask = loaded.mask[0]
    assert torch.equal(mask, mask_pixels(sample))
    as_image = apply_params(mask.mul(2).sub(1).expand(3, -1, -1), params)
    moved = augment_mask(mask, params)
    assert not torch.equal(moved, mask)
    torch.testing.assert_close(as_image[:1].add(1).mul(0.5), moved)


def test_the_loss_is_the_loss_on_the_masked_region(make_config, pair):
    """sd (DDPM): the masked loss is the squared error summed over the region's latent pixels, divided by every
    element (SimpleTuner's mean of ``loss * mask``), computed here from the denoiser's own prediction."""
    data, datasets, config, spec = cached_data(make_config, datasets=[_dataset(pair)], train_batch_size=1)
    batch = data.batch(datasets[0].samples, torch.device("cpu"))
    denoiser = spec.load_denoiser()
    masked = spec.training_loss(denoiser, batch.latents, batch.conditioning, torch.Generator().manual_seed(3))

    gen = torch.Generator().manual_seed(3)  # the draws training_loss makes, in its order
    latents = batch.latents
    noise = torch.randn(latents.shape, generator=gen, dtype=torch.float32)
    scheduler = spec.load_noise_scheduler()
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (1,), generator=gen)
    with torch.no_grad():
        pred = spec.predict(denoiser, scheduler.add_noise(latents, noise, timesteps), timesteps, batch.conditioning)
    squared = (pred.float() - noise) ** 2
    by_hand = squared[(slice(None), slice(None), *REGION)].sum() / squared.numel()
    assert masked.shape == (1,)
    torch.testing.assert_close(masked[0], by_hand, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_flow_families_weigh_the_same_latent_pixels(zoo_config, pair, family):
    """flux (2x2 packed tokens) and sd3: the pipeline's mask is the hand-built one, the loss is linear in it, and
    the region's loss plus the rest's is the unmasked loss."""
    data, datasets, config, spec = cached_data(
        lambda **kw: zoo_config(family, **kw), datasets=[_dataset(pair)], train_batch_size=1
    )
    batch = data.batch(datasets[0].samples, torch.device("cpu"))
    hand = _hand_mask(REGION)
    assert torch.equal(batch.conditioning[MASK_KEY], hand)
    denoiser = spec.load_denoiser()

    def loss(mask):
        conditioning = {k: v for k, v in batch.conditioning.items() if k != MASK_KEY}
        if mask is not None:
            conditioning[MASK_KEY] = mask
        with torch.no_grad():
            return spec.training_loss(denoiser, batch.latents, conditioning, torch.Generator().manual_seed(5))

    region, rest, whole = loss(hand), loss(1 - hand), loss(None)
    torch.testing.assert_close(region + rest, whole, rtol=1e-5, atol=1e-7)
    assert 0 < region.item() < whole.item()
    torch.testing.assert_close(loss(torch.ones_like(hand)), whole)


def test_segmentation_keeps_any_latent_pixel_a_mask_touches():
    pixels = torch.zeros(2, 1, 16, 16)
    pixels[:, :, 0, 0] = 0.1  # one dim pixel in the first 8x8 cell
    pixels[:, :, 8:, 8:] = 1.0
    grey = latent_mask(pixels, (2, 2), torch.tensor([False, True]))
    assert grey[0, 0].tolist() == [[pytest.approx(0.1 / 64), 0.0], [0.0, 1.0]]
    assert grey[1, 0].tolist() == [[1.0, 0.0], [0.0, 1.0]]


def test_masked_loss_probability_draws_segmentation_batches_only(make_config, pair):
    data, datasets, config, _ = cached_data(
        make_config, datasets=[_dataset(pair, mask_type="segmentation")], train_batch_size=1
    )
    sampler = training_sampler(datasets, config)
    draws = [mask_draw(config.seed, 0, i) for i in range(200)]
    assert 0.35 < sum(d < 0.5 for d in draws) / len(draws) < 0.65
    data.masked_loss = MaskedLoss(config.seed, 0.5)
    batches = data.iterate(sampler, torch.device("cpu"))
    kept, drawn = [], []
    for _ in range(12):
        kept.append(MASK_KEY in next(batches).conditioning)
        drawn.append(mask_draw(config.seed, sampler.epoch, sampler.batch_index - 1) < 0.5)
    assert kept == drawn and any(kept) and not all(kept)
    grey = [dataclasses.replace(s, mask_type="mask") for s in datasets[0].samples]
    assert MaskedLoss(config.seed, 0.0).uses_mask(sampler, grey)  # a `mask` dataset's batches always mask
    assert not MaskedLoss(config.seed, 0.0).uses_mask(sampler, datasets[0].samples)


def test_an_image_without_a_mask_is_named(make_config, pair):
    _write_pair(pair, "b")
    (pair / "masks" / "b.png").unlink()
    with pytest.raises(ValueError, match=r"1 image\(s\) have no mask there: b\.png"):
        build_datasets(validate_config(make_config(datasets=[_dataset(pair)])))


def test_the_cache_key_follows_the_mask_file(make_config, pair):
    data, datasets, config, _ = cached_data(make_config, datasets=[_dataset(pair)], train_batch_size=1)
    key = next(iter(data.latent_keys.values()))
    mask = Image.new("L", SIZE, 255)
    mask.save(pair / "masks" / "a.png")
    again, *_ = cached_data(make_config, datasets=[_dataset(pair)], train_batch_size=1)
    assert next(iter(again.latent_keys.values())) != key
    batch = again.batch(datasets[0].samples[:1], torch.device("cpu"))
    assert torch.equal(batch.conditioning[MASK_KEY], torch.ones(1, 1, *GRID))


def test_config_refuses_masks_where_they_cannot_pair(make_config, pair):
    video = _dataset(pair, dataset_type="video", num_frames=1)
    with pytest.raises(ConfigError, match="pairs masks with still images only"):
        validate_config(make_config(datasets=[video]))
    with pytest.raises(ConfigError, match="set `mask_data_dir` too"):
        validate_config(
            make_config(
                datasets=[
                    {"id": "d", "type": "local", "instance_data_dir": str(pair / "img"), "mask_type": "segmentation"}
                ]
            )
        )
    shards = {"id": "w", "type": "webdataset", "instance_data_dir": str(pair), "mask_data_dir": str(pair / "masks")}
    with pytest.raises(ConfigError, match="pairs masks with files on disk"):
        validate_config(make_config(datasets=[shards]))


def test_a_relative_mask_folder_is_taken_from_the_config_files_folder(make_config, pair):
    raw = make_config(datasets=[{**_dataset(pair), "mask_data_dir": "masks"}])
    (pair / "config.json").write_text(json.dumps(raw))
    assert load_config(pair / "config.json").config.datasets[0].mask_data_dir == str(pair / "masks")


def test_simpletuners_mask_dataset_translates(pair):
    """SimpleTuner's DREAMBOOTH.md layout: an image dataset naming a `conditioning_type: mask` entry."""
    (pair / "model").mkdir()
    entries = [
        {"id": "d", "type": "local", "instance_data_dir": "img", "conditioning_data": "m"},
        {
            "id": "m",
            "type": "local",
            "dataset_type": "conditioning",
            "instance_data_dir": "masks",
            "conditioning_type": "segmentation",
        },
    ]
    (pair / "multidatabackend.json").write_text(json.dumps(entries))
    top = {
        "model_type": "lora",
        "model_family": "sd1x",
        "pretrained_model_name_or_path": "model",
        "data_backend_config": "multidatabackend.json",
        "masked_loss_probability": "0.25",
    }
    native, _ = dialect.translate(top, None, pair)
    (ds,) = native["datasets"]
    assert (ds["mask_data_dir"], ds["mask_type"], native["masked_loss_probability"]) == (
        str(pair / "masks"),
        "segmentation",
        0.25,
    )
    assert "conditioning_data_dir" not in ds


def test_a_masked_run_trains(make_config, pair):
    """The real Trainer, two steps on a segmentation dataset at masked_loss_probability 0.5: finite losses."""
    from training_helpers import train

    _write_pair(pair, "b", (0, 0, 160, 64))
    raw = make_config(
        datasets=[_dataset(pair, mask_type="segmentation")], masked_loss_probability=0.5, max_train_steps=2
    )
    trainer, result = train(raw)
    assert result.global_step == 2 and all(torch.isfinite(torch.tensor(result.losses)))
    assert trainer.data.masked_loss == MaskedLoss(raw["seed"], 0.5)


def test_the_estimate_counts_one_weight_per_latent_pixel(make_config, pair):
    """`simpletuner estimate`: the batch holds [B, 1, h, w] float32 weights, and its fake step applies them."""
    from simpletuner.memory.estimator import batch_shapes, estimate_memory

    plain = validate_config(make_config(train_batch_size=2))
    masked = validate_config(make_config(datasets=[_dataset(pair)], train_batch_size=2))
    assert MASK_KEY not in batch_shapes(plain, 2)[1]
    latents, shapes = batch_shapes(masked, 2)
    assert shapes[MASK_KEY].shape == (2, 1, 8, 8) and shapes[MASK_KEY].dtype == torch.float32
    estimate = estimate_memory(masked, device_kind="cpu")
    assert estimate.batch_data == latents.nbytes + sum(s.nbytes for s in shapes.values())
