"""LoRA adapters on the denoiser through peft (diffusers' ``add_adapter``)."""

from __future__ import annotations

import torch
from torch import nn

from simpletuner.configuration import TrainingConfig


def apply_lora(denoiser: nn.Module, targets: list[str], config: TrainingConfig, base_dtype: torch.dtype) -> nn.Module:
    """Freeze the base weights (cast to ``base_dtype``) and add a trainable fp32 LoRA adapter."""
    from peft import LoraConfig

    denoiser.requires_grad_(False)
    if denoiser.dtype != base_dtype:
        denoiser.to(dtype=base_dtype)
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.effective_lora_alpha,
        lora_dropout=config.lora_dropout,
        init_lora_weights="gaussian",
        target_modules=targets,
        use_dora=config.lora_use_dora,
    )
    try:
        denoiser.add_adapter(lora)
    except ValueError as exc:
        if "not found" in str(exc) or "Target modules" in str(exc):
            raise ValueError(
                f"lora_target_modules {targets} match no module of the {type(denoiser).__name__}; "
                "use names of its Linear/Conv layers (e.g. to_q, to_k, to_v, to_out.0)"
            ) from exc
        raise
    for p in denoiser.parameters():
        if p.requires_grad:  # adapters train in fp32 whatever the base precision
            p.data = p.data.float()
    return denoiser


def prepare_for_training(denoiser: nn.Module, targets: list[str], config: TrainingConfig, weight_dtype: torch.dtype) -> nn.Module:
    """The trainer's set-up of a loaded denoiser: a LoRA on a frozen base in ``weight_dtype``, or
    every weight trainable (full); gradient checkpointing if configured; train mode.

    The memory estimator calls this on a meta-device model, so estimate and run cannot drift.
    """
    if config.training_type == "lora":
        denoiser = apply_lora(denoiser, targets, config, base_dtype=weight_dtype)
    else:
        denoiser.requires_grad_(True)
    if config.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    return denoiser.train()


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters being trained, by name (what a checkpoint must restore)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}
