"""Helpers the training tests share: run a config through the real Trainer, and a comparable loss."""

from __future__ import annotations

import torch

from simpletuner.configuration import validate_config
from simpletuner.state import StateTracker
from simpletuner.training.trainer import Trainer


def train(raw) -> tuple[Trainer, object]:
    """Validate ``raw``, train it, and return ``(trainer, TrainResult)``."""
    trainer = Trainer(StateTracker(validate_config(raw), raw))
    return trainer, trainer.train()


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
