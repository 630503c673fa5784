"""Helpers the training tests share: the tiny run's config, a run through the real Trainer, a
comparable loss before and after training, and weight comparison."""

from __future__ import annotations

from pathlib import Path

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from simpletuner.configuration import validate_config
from simpletuner.state import StateTracker
from simpletuner.training.trainer import Trainer


def tiny_config(model: Path, data: Path, root: Path, **overrides) -> dict:
    """The raw config most training tests start from: the tiny SD folder ``model``, the shapes
    dataset ``data``, 4 steps of batch 2; output and cache folders under ``root``. Keyword
    overrides replace keys."""
    raw = {
        "pretrained_model_name_or_path": str(model),
        "model_family": "sd",
        "output_dir": str(root / "output"),
        "resolution": 64,
        "aspect_bucket_alignment": 16,
        "train_batch_size": 2,
        "max_train_steps": 4,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "seed": 123,
        "cache_config": {"cache_dir": str(root / "cache")},
        "datasets": [{"id": "shapes", "type": "local", "instance_data_dir": str(data)}],
    }
    raw.update(overrides)
    return raw


def train(raw) -> tuple[Trainer, object]:
    """Validate ``raw``, train it, and return ``(trainer, TrainResult)``."""
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    return trainer, trainer.train()


def config_problems(raw: dict) -> str:
    """The ConfigError ``validate_config(raw)`` raises, as text (the test fails where it raises none)."""
    from simpletuner.configuration import ConfigError

    try:
        validate_config(raw)
    except ConfigError as exc:
        return str(exc)
    raise AssertionError("the config validated: a ConfigError was expected")


def straight_and_resumed(make_config, root: Path, steps: int, resume_at: int, **common):
    """``train`` for ``steps`` straight (in ``root/a``), and for ``resume_at`` steps with a checkpoint there, then
    resumed to ``steps`` (in ``root/b``): ``((trainer, result) straight, (trainer, result) resumed)``."""
    straight = train(make_config(max_train_steps=steps, output_dir=str(root / "a"), **common))
    out = root / "b"
    train(make_config(max_train_steps=resume_at, checkpointing_steps=resume_at, output_dir=str(out), **common))
    resumed = train(make_config(max_train_steps=steps, output_dir=str(out), resume_from_checkpoint="latest", **common))
    return straight, resumed


def fixed_loss(trainer: Trainer) -> float:
    """Loss on a fixed batch with fixed noise/timesteps: comparable before and after training."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    all_samples = trainer.state.datasets[0].samples
    samples = [s for s in all_samples if s.bucket == all_samples[0].bucket][:4]
    batch = trainer.data.batch(samples, trainer.accelerator.device)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        losses = [trainer.spec.training_loss(model, batch.latents, batch.conditioning, gen).mean() for _ in range(8)]
    return float(torch.stack(losses).mean())


def untrained_loss(trainer: Trainer) -> float:
    """``fixed_loss`` of the model before training, taken from the trained one: with every LoRA layer
    switched off it is the frozen base, which is what a fresh LoRA (B = 0, the identity) computes."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    assert layers, "untrained_loss is for LoRA runs: the model has no LoRA layer"
    for layer in layers:
        layer.enable_adapters(False)
    try:
        return fixed_loss(trainer)
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same tensor names, each bit for bit equal."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


#: The tiny UNet's latents at resolution 64, and prompt embeddings it takes (any length; its width).
LATENT_SHAPE = (4, 8, 8)
TOKENS, WIDTH = 6, 32


def step_trainer(make_config, **overrides) -> Trainer:
    """A Trainer set up by its own builders as far as ``train_step`` / ``run_window`` need, without data (no
    dataset, no cache fill, no output_dir): ``_setup_process`` (the tiny SD spec, Accelerate, the noise
    generator), the run's accumulation policy, ``_setup_model`` and ``_setup_optimizer`` over 10 steps.
    Keyword overrides go to the config."""
    from simpletuner.gh200.managed_memory import check_managed_memory
    from simpletuner.training.accumulation import build_accumulation

    raw = make_config(**{"nonfinite_policy": "skip", **overrides})
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    trainer._setup_process()
    trainer.accumulation = build_accumulation(trainer.config, trainer.accelerator.num_processes)
    denoiser = trainer._setup_model(check_managed_memory(trainer.config))
    trainer._setup_optimizer(denoiser, total_steps=10)
    return trainer


def fixed_batch(num_samples: int, seed: int, nan: bool = False):
    """A micro-batch of random latents and prompt embeddings for the tiny UNet, drawn from ``seed``;
    ``nan`` puts one NaN in the latents."""
    from simpletuner.data_backend.metadata import Sample
    from simpletuner.training.batches import Batch

    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn((num_samples, *LATENT_SHAPE), generator=gen)
    if nan:
        latents[0, 0, 0, 0] = float("nan")
    samples = [
        Sample(f"fixed/{seed}-{i}.png", "fixed", f"{seed}-{i}.png", "a shape", (64, 64), (64, 64), "center", 0)
        for i in range(num_samples)
    ]
    return Batch(latents, {"prompt_embeds": torch.randn((num_samples, TOKENS, WIDTH), generator=gen)}, samples)


def cached_data(make_config, **overrides):
    """The tiny run's datasets scanned and its caches filled as training fills them (no Trainer):
    ``(CachedData, datasets, config, spec)``."""
    from simpletuner.caching.fill import fill_caches
    from simpletuner.data_backend import build_datasets
    from simpletuner.models import get_model_spec
    from simpletuner.training.batches import CachedData, CaptionDropout

    raw = make_config(**overrides)
    config = validate_config(raw)
    state = StateTracker(config, raw)
    datasets = build_datasets(state.config)
    spec = get_model_spec(config)
    cpu = torch.device("cpu")
    filled, _ = fill_caches(
        spec,
        datasets,
        Path(config.cache_config.cache_dir),
        cpu,
        torch.float32,
        locks=None,
        record_cache_dir=state.register_cache_dir,
    )
    data = CachedData.of(filled, CaptionDropout(config.seed, config.caption_dropout_probability))
    return data, datasets, config, spec


def training_sampler(datasets, config):
    """A one-process sampler over every sample of ``datasets``, as the trainer builds it."""
    from simpletuner.data_backend import BucketSampler

    return BucketSampler([s for ds in datasets for s in ds.samples], config.train_batch_size, 1, 0, config.seed)


def resumed_batches(data, datasets, config, num_before: int, num_after: int):
    """``(before, after, again)``: ``num_before`` then ``num_after`` training batches of one straight run of
    ``data`` (a CachedData), and ``num_after`` batches of a run whose sampler resumed from the state saved
    between the two, as a resume from a checkpoint taken there would."""
    cpu = torch.device("cpu")
    sampler = training_sampler(datasets, config)
    straight = data.iterate(sampler, cpu)
    before = [next(straight) for _ in range(num_before)]
    state = sampler.state_dict()
    after = [next(straight) for _ in range(num_after)]
    resumed_sampler = training_sampler(datasets, config)
    resumed_sampler.load_state_dict(state)
    resumed = data.iterate(resumed_sampler, cpu)
    return before, after, [next(resumed) for _ in range(num_after)]
