"""Regularisation datasets (``is_regularisation_data``): in an adapter run their target is the frozen
base model's own prediction on the same noisy input ("parent-student"); a full fine-tune trains
them on the usual target. Checked on the tiny SD UNet against a separately built base UNet."""

from __future__ import annotations

import pytest
import torch
from fakes import data_only_config
from PIL import Image
from training_helpers import step_trainer

from simpletuner.configuration import validate_config
from simpletuner.data_backend import LocalDataBackend, build_metadata
from simpletuner.data_backend.metadata import Sample
from simpletuner.models import get_model_spec
from simpletuner.training.batches import Batch
from simpletuner.training.trainer import Trainer

LATENT_SHAPE = (4, 8, 8)  # the tiny UNet at resolution 64
TOKENS, WIDTH = 6, 32


def _batch(num_samples: int, seed: int, regularisation: bool) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn((num_samples, *LATENT_SHAPE), generator=gen)
    samples = [
        Sample(
            f"reg/{seed}-{i}.png",
            "reg" if regularisation else "main",
            f"{seed}-{i}.png",
            "a shape",
            (64, 64),
            (64, 64),
            "center",
            0,
            is_regularisation_data=regularisation,
        )
        for i in range(num_samples)
    ]
    return Batch(latents, {"prompt_embeds": torch.randn((num_samples, TOKENS, WIDTH), generator=gen)}, samples)


def _adapted(spec, config):
    """The tiny UNet with the run's adapter, its up-projections made nonzero (:func:`_perturb_adapter`)."""
    return _perturb_adapter(spec.prepare_denoiser(spec.load_denoiser(torch.float32), torch.float32), config)


def _perturb_adapter(denoiser, config):
    """Make the adapter's up-projections of ``denoiser`` nonzero, in place (a fresh adapter is the identity,
    which would make any target test pass); returns it."""
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in denoiser.named_parameters():
            if p.requires_grad and ("lora_B" in name or "lora_up" in name or config.lora_type == "lycoris"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return denoiser


def _draws(seed: int, batch: Batch, scheduler):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch.latents.shape, generator=g)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (batch.num_samples,), generator=g)
    return noise, timesteps, g


@pytest.mark.parametrize("lora_type", ["standard", "lycoris"])
def test_regularisation_target_is_the_base_models_prediction(make_config, lora_type):
    if lora_type == "lycoris":
        pytest.importorskip("lycoris")
    extra = {"lora_type": "lycoris", "lycoris": {"algo": "locon"}} if lora_type == "lycoris" else {}
    config = validate_config(make_config(lora_rank=4, **extra))
    spec = get_model_spec(config)
    model = _adapted(spec, config)
    base = spec.load_denoiser(torch.float32).eval()  # built apart: no adapter ever touched it
    trainable = [p for p in model.parameters() if p.requires_grad]
    batch = _batch(2, 0, regularisation=True)
    embeds = batch.conditioning["prompt_embeds"]

    got = spec.training_loss(model, batch.latents, batch.conditioning, torch.Generator().manual_seed(3), True)

    scheduler = spec.load_noise_scheduler()
    noise, timesteps, _ = _draws(3, batch, scheduler)
    noisy = scheduler.add_noise(batch.latents, noise, timesteps)
    with torch.no_grad():
        base_pred = base(noisy, timesteps, embeds, return_dict=False)[0]
    student = model(noisy, timesteps, embeds, return_dict=False)[0]
    want = ((student - base_pred) ** 2).mean(dim=(1, 2, 3))
    plain = ((student - noise) ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (got, want)
    assert not torch.allclose(got, plain, rtol=1e-2)
    assert want.min() > 1e-6  # the adapter moves the prediction: the target is not the student's own

    # Gradients: only the adapter's tensors, all as the hand-made loss gives them, none on the base.
    got_grads = torch.autograd.grad(got.sum(), trainable)
    want_grads = torch.autograd.grad(want.sum(), trainable)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(got_grads, want_grads))
    assert any(g.abs().sum() > 0 for g in got_grads)
    assert [p for p in model.parameters() if p.requires_grad] == trainable  # switches restored
    if lora_type == "lycoris":
        assert model.lycoris.multiplier == 1.0
    # The adapter is back on: the model's prediction is the student's again.
    with torch.no_grad():
        again = model(noisy, timesteps, embeds, return_dict=False)[0]
    assert torch.equal(again, student.detach())


def _trainer(make_config, **overrides) -> Trainer:
    """A Trainer holding what ``train_step`` touches (training_helpers.step_trainer), its adapter made nonzero."""
    trainer = step_trainer(make_config, lr_scheduler="constant", max_grad_norm=None, lora_rank=4, **overrides)
    _perturb_adapter(trainer.model, trainer.config)
    return trainer


def test_a_window_mixes_regularisation_and_normal_batches(make_config):
    trainer = _trainer(make_config)
    spec, model = trainer.spec, trainer.model
    reg, normal = _batch(2, 0, regularisation=True), _batch(2, 1, regularisation=False)
    base = spec.load_denoiser(torch.float32).eval()
    scheduler = spec.load_noise_scheduler()

    g = torch.Generator()
    g.set_state(trainer.generator.get_state())
    with torch.no_grad():
        per_sample = []
        for batch, is_reg in ((reg, True), (normal, False)):
            noise = torch.randn(batch.latents.shape, generator=g)
            timesteps = torch.randint(0, 1000, (2,), generator=g)
            noisy = scheduler.add_noise(batch.latents, noise, timesteps)
            embeds = batch.conditioning["prompt_embeds"]
            student = model(noisy, timesteps, embeds, return_dict=False)[0]
            target = base(noisy, timesteps, embeds, return_dict=False)[0] if is_reg else noise
            per_sample.append(((student - target) ** 2).mean(dim=(1, 2, 3)))
    want = torch.cat(per_sample).sum() / 4

    outcome = trainer.train_step([reg, normal])
    assert not outcome.skipped and outcome.num_samples == 4
    assert torch.allclose(outcome.loss, want, rtol=1e-5), (outcome.loss, want)
    assert torch.equal(trainer.generator.get_state(), g.get_state())  # no extra draws for the parent


def test_full_fine_tune_trains_regularisation_data_on_the_usual_target(make_config):
    config = validate_config(make_config(training_type="full"))
    spec = get_model_spec(config)
    model = spec.prepare_denoiser(spec.load_denoiser(torch.float32), torch.float32)
    batch = _batch(2, 0, regularisation=True)
    with torch.no_grad():
        reg = spec.training_loss(model, batch.latents, batch.conditioning, torch.Generator().manual_seed(3), True)
        plain = spec.training_loss(model, batch.latents, batch.conditioning, torch.Generator().manual_seed(3))
    assert torch.equal(reg, plain)


def test_the_dataset_flag_reaches_every_sample_and_batch(tmp_path):
    folder = tmp_path / "reg"
    folder.mkdir()
    for i in range(2):
        Image.new("RGB", (64, 64), (i * 100, 0, 0)).save(folder / f"{i}.png")
    raw = data_only_config({"id": "reg", "type": "local", "instance_data_dir": str(folder)})
    raw["datasets"].append({"id": "main", "type": "local", "instance_data_dir": str(folder)})
    raw["datasets"][0]["is_regularisation_data"] = True
    config = validate_config(raw, check_files=False)
    assert [d.is_regularisation_data for d in config.datasets] == [True, False]
    for ds in config.datasets:
        samples = build_metadata(LocalDataBackend(folder, ds.id), ds, config, seed=0).samples
        assert {s.is_regularisation_data for s in samples} == {ds.is_regularisation_data}
        batch = Batch(torch.zeros(len(samples), *LATENT_SHAPE), {}, samples)
        assert batch.is_regularisation_data is ds.is_regularisation_data


def test_the_american_spelling_is_pointed_at_ours():
    raw = data_only_config({"id": "reg", "type": "local", "instance_data_dir": "/x", "is_regularization_data": True})
    with pytest.raises(ValueError, match="is_regularization_data.*use `is_regularisation_data`"):
        validate_config(raw, check_files=False)
