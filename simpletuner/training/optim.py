"""Optimizer and learning-rate schedule from the config."""

from __future__ import annotations

from typing import Iterable

import torch

from simpletuner.configuration import TrainingConfig


def build_optimizer(config: TrainingConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer named by ``config.optimizer`` over ``params``."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("nothing to train: no parameter requires a gradient (check training_type and lora_target_modules)")
    adam = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}.get(config.optimizer)
    if adam is not None:
        return adam(
            params,
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_epsilon,
            weight_decay=config.weight_decay,
        )
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.learning_rate, momentum=0.9, weight_decay=config.weight_decay)
    if config.optimizer == "automagic":
        from simpletuner.training.optimizers import Automagic

        # The same seed on every rank: data-parallel copies round their bf16 weights identically.
        return Automagic(params, lr=config.learning_rate, min_lr=config.min_lr, max_lr=config.max_lr,
                         lr_bump=config.lr_bump, weight_decay=config.weight_decay, seed=config.seed)
    raise ValueError(f"optimizer {config.optimizer!r} is not supported")


def build_lr_scheduler(config: TrainingConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    """diffusers' named schedules, stepped once per optimizer step."""
    from diffusers.optimization import get_scheduler

    return get_scheduler(
        config.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=config.lr_warmup_steps,
        num_training_steps=total_steps,
    )
