"""Optimizer and learning-rate schedule from the config (an optimizer module, and its library, is imported only when
a config names it)."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch

from simpletuner.configuration import TrainingConfig, schedules
from simpletuner.configuration.optimizer_settings import SGD_DEFAULT_MOMENTUM
from simpletuner.configuration.schedules import SIMPLETUNER_COSINE_DEFAULT_PERIOD
from simpletuner.models.text_encoder_lora import TEXT_ENCODER_GROUP

#: Per-stage config keys (``{group}_{key}``) -> the optimizer group key they set.
_STAGE_KEYS = {"learning_rate": "lr", "lr_bump": "lr_bump", "min_lr": "min_lr", "max_lr": "max_lr"}


def stage_bounds(config: TrainingConfig) -> dict[str, Any]:
    """The config's learning-rate settings under the names Automagic's groups use: ``lr``,
    ``lr_bump``, ``min_lr``, ``max_lr``, their ``high_noise_*`` / ``low_noise_*`` overrides and ``text_encoder_lr``."""
    bounds: dict[str, Any] = {}
    for key, group_key in _STAGE_KEYS.items():
        bounds[group_key] = getattr(config, key)
        for stage in ("high_noise", "low_noise"):
            bounds[f"{stage}_{group_key}"] = getattr(config, f"{stage}_{key}")
    bounds[f"{TEXT_ENCODER_GROUP}_lr"] = config.text_encoder_lr  # train_text_encoder's group (unset: learning_rate)
    return bounds


def _param_groups(
    config: TrainingConfig, named: Mapping[str, Iterable[torch.nn.Parameter]]
) -> list[torch.nn.Parameter] | list[dict[str, Any]]:
    """Plain parameters for one ``default`` group; else one named group per entry with its own ``lr``
    (and Automagic bounds) from the per-stage keys."""
    trainable = {name: [p for p in params if p.requires_grad] for name, params in named.items()}
    if list(trainable) == ["default"]:
        return trainable["default"]
    from simpletuner.training.optimizers.automagic import automagic_param_groups

    groups = automagic_param_groups(trainable, stage_bounds(config))
    if config.optimizer != "automagic":  # only the learning rate applies to other optimizers
        groups = [{k: v for k, v in g.items() if k not in ("lr_bump", "min_lr", "max_lr")} for g in groups]
    return [g for g in groups if g["params"]]


def build_optimizer(
    config: TrainingConfig, params: Iterable[torch.nn.Parameter] | Mapping[str, Iterable[torch.nn.Parameter]]
) -> torch.optim.Optimizer:
    """The optimizer named by ``config.optimizer`` over ``params``: an iterable of parameters, or
    named groups (``ModelSpec.named_parameter_groups``), each group with its own learning rate
    (``high_noise_learning_rate`` ...) and Automagic bounds."""
    return _make_optimizer(config, _trainable_groups(config, params))


def _trainable_groups(
    config: TrainingConfig, params: Iterable[torch.nn.Parameter] | Mapping[str, Iterable[torch.nn.Parameter]]
) -> list[torch.nn.Parameter] | list[dict[str, Any]]:
    """The parameters that require a gradient, as a list or as the named groups; ValueError when there are none."""
    groups: list[torch.nn.Parameter] | list[dict[str, Any]]
    if isinstance(params, Mapping):
        groups = _param_groups(config, params)
        num_params = sum(len(g["params"]) if isinstance(g, dict) else 1 for g in groups)
    else:
        groups = [p for p in params if p.requires_grad]
        num_params = len(groups)
    if not num_params:
        raise ValueError(
            "nothing to train: no parameter requires a gradient (check training_type and lora_target_modules)"
        )
    return groups


def _make_optimizer(config: TrainingConfig, groups: list) -> torch.optim.Optimizer:
    """The class ``config.optimizer`` names, with the config's settings, over ``groups``."""
    adam = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}.get(config.optimizer)
    if adam is not None:
        return adam(
            groups,
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_epsilon,
            weight_decay=config.weight_decay,
        )
    if config.optimizer == "adamw_bf16":
        from simpletuner.training.optimizers.adamw_bf16 import AdamWBF16

        # The same seed on every rank: data-parallel copies round their bf16 weights identically.
        return AdamWBF16(
            groups,
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_epsilon,
            weight_decay=config.weight_decay,
            seed=config.seed,
        )
    if config.optimizer == "prodigy":
        from simpletuner.training.optimizers.prodigy import prodigy_class

        # learning_rate multiplies Prodigy's estimated step size (about 1.0; a config rule checks it).
        # optimizer_config holds prodigyopt's other settings, checked at config time.
        return prodigy_class()(
            groups,
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_epsilon,
            weight_decay=config.weight_decay,
            prodigy_steps=config.prodigy_steps,
            **config.optimizer_config,
        )
    if config.optimizer == "sgd":
        momentum = config.optimizer_config.get("momentum", SGD_DEFAULT_MOMENTUM)
        # A number, checked with the config; null passes that check but torch's SGD refuses it as well.
        assert isinstance(momentum, (int, float)), f"optimizer_config.momentum {momentum!r}"
        return torch.optim.SGD(groups, lr=config.learning_rate, momentum=momentum, weight_decay=config.weight_decay)
    if config.optimizer == "torch-adafactor":
        # beta2_decay, d, eps1 / eps2: numbers (or null eps1), checked with the config.
        settings: dict[str, Any] = dict(config.optimizer_config)
        if "eps1" in settings or "eps2" in settings:  # torch's pair; (None, 1e-3) is its default
            settings["eps"] = (settings.pop("eps1", None), settings.pop("eps2", 1e-3))
        return torch.optim.Adafactor(groups, lr=config.learning_rate, weight_decay=config.weight_decay, **settings)
    if config.optimizer.startswith(("optimi-", "bnb-")):
        if config.optimizer.startswith("optimi-"):
            from simpletuner.training.optimizers.optimi import build_optimi as build
        else:
            from simpletuner.training.optimizers.bnb import build_bnb as build
        # optimizer_config holds the class's other settings (checked with the config, SimpleTuner's defaults filled).
        return build(config, groups)
    if config.optimizer == "automagic":
        from simpletuner.training.optimizers.automagic import Automagic

        # The same seed on every rank: data-parallel copies round their bf16 weights identically.
        return Automagic(
            groups,
            lr=config.learning_rate,
            min_lr=config.min_lr,
            max_lr=config.max_lr,
            lr_bump=config.lr_bump,
            weight_decay=config.weight_decay,
            seed=config.seed,
        )
    raise ValueError(f"optimizer {config.optimizer!r} is not supported")


def _simpletuner_cosine(base_lr: float, floor: float, period: int, num_processes: int):
    """SimpleTuner's `Cosine` (helpers/training/custom_schedule.py at the dialect's commit), in optimizer steps:
    it is built with ``T_0 = lr_warmup_steps * processes`` scheduler steps (1000 when that is 0) and stepped
    once per process per optimizer step, so optimizer step ``k`` sits at scheduler step ``k * processes``;
    its learning rate is truncated to 1e-9 as there. Returns LambdaLR's factor of ``base_lr``."""

    def factor(step: int) -> float:
        lr = floor + (base_lr - floor) * (1 + math.cos(math.pi * step * num_processes / period)) / 2
        return math.floor(lr * 1e9) / 1e9 / base_lr

    return factor


def build_lr_scheduler(
    config: TrainingConfig, optimizer: torch.optim.Optimizer, total_steps: int, num_processes: int = 1
) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning-rate schedule `config.lr_scheduler` names, stepped once per optimizer step: diffusers' shapes
    (polynomial with `lr_end` / `lr_power`), or `simpletuner_cosine`, whose period depends on ``num_processes``
    when `lr_warmup_steps` is 0, as in SimpleTuner."""
    from diffusers.optimization import get_polynomial_decay_schedule_with_warmup, get_scheduler

    if config.lr_scheduler == "simpletuner_cosine":
        warmup = config.lr_warmup_steps * num_processes
        period = warmup if warmup > 0 else SIMPLETUNER_COSINE_DEFAULT_PERIOD
        floor = schedules.lr_end(config)
        factors = [_simpletuner_cosine(g["lr"], floor, period, num_processes) for g in optimizer.param_groups]
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)
    if config.lr_scheduler == "polynomial":
        return get_polynomial_decay_schedule_with_warmup(
            optimizer,
            num_warmup_steps=config.lr_warmup_steps,
            num_training_steps=total_steps,
            lr_end=schedules.lr_end(config),
            power=schedules.lr_power(config),
        )
    return get_scheduler(
        config.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=config.lr_warmup_steps,
        num_training_steps=total_steps,
    )
