"""The denoiser's training set-up: a frozen base (optionally quantised, ``quantize.py``) under a peft
LoRA (diffusers' ``add_adapter``) or a LyCORIS network (``lycoris_adapter.py``), or full training."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from simpletuner.configuration import TrainingConfig


def freeze_base(denoiser: nn.Module, base_dtype: torch.dtype) -> None:
    """Freeze every weight of ``denoiser`` and cast it to ``base_dtype`` (no-op where it is already)."""
    denoiser.requires_grad_(False)
    if denoiser.dtype != base_dtype:
        denoiser.to(dtype=base_dtype)


def apply_lora(denoiser: nn.Module, targets: list[str], config: TrainingConfig, base_dtype: torch.dtype) -> nn.Module:
    """Freeze the base weights (cast to ``base_dtype``) and add a trainable fp32 peft LoRA adapter."""
    freeze_base(denoiser, base_dtype)
    return add_peft_lora(denoiser, targets, config)


def add_peft_lora(denoiser: nn.Module, targets: list[str], config: TrainingConfig) -> nn.Module:
    """Add a trainable fp32 peft LoRA (DoRA with ``lora_use_dora``) on ``targets`` of a frozen denoiser."""
    from peft import LoraConfig

    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.effective_lora_alpha,
        lora_dropout=config.lora_dropout,
        init_lora_weights="gaussian",
        target_modules=targets,
        use_dora=config.lora_use_dora,
    )
    try:
        with warnings.catch_warnings():
            # peft on torchao-quantised layers: merging would need torchao's config; we never merge.
            warnings.filterwarnings("ignore", message=".*get_apply_tensor_subclass.*")
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


def prepare_for_training(
    denoiser: nn.Module,
    targets: list[str],
    config: TrainingConfig,
    weight_dtype: torch.dtype,
    device: torch.device | None = None,
) -> nn.Module:
    """The trainer's set-up of a loaded denoiser: an fp32 adapter (``lora_type``: peft LoRA or
    LyCORIS) on a frozen base in ``weight_dtype`` whose Linear weights ``base_model_precision`` may
    quantise first, or every weight trainable (full); gradient checkpointing if configured; train mode.

    ``device``: where quantised layers go as they are quantised (the GPU: fast, and the full-precision
    base never sits there whole); None quantises where the model is. The memory estimator calls
    this on a meta-device model (quantisation is then skipped and counted by the estimator), so
    estimate and run cannot drift.
    """
    if config.training_type == "lora":
        from simpletuner.training.quantize import check_adapter_support, quantize_base

        check_adapter_support(config.base_model_precision, config.lora_type, config.lora_use_dora)
        freeze_base(denoiser, weight_dtype)
        quantize_base(denoiser, config.base_model_precision, device)  # before the adapter wraps the layers
        if config.lora_type == "lycoris":
            from simpletuner.training.lycoris_adapter import apply_lycoris

            apply_lycoris(denoiser, targets, config)
        else:
            denoiser = add_peft_lora(denoiser, targets, config)
    else:
        denoiser.requires_grad_(True)
    if config.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    return denoiser.train()


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters being trained, by name (what a checkpoint must restore)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}
