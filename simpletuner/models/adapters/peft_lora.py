"""A trainable fp32 peft LoRA (diffusers' ``add_adapter``; DoRA with ``lora_use_dora``) on a frozen denoiser."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from simpletuner.configuration import TrainingConfig

if TYPE_CHECKING:
    from diffusers.models.modeling_utils import ModelMixin


def add_peft_lora(denoiser: ModelMixin, targets: list[str], config: TrainingConfig) -> ModelMixin:
    """Add a trainable fp32 peft LoRA (DoRA with ``lora_use_dora``) on ``targets`` of a frozen denoiser."""
    from peft import LoraConfig  # optional heavy import: only runs that train a peft LoRA pay for it

    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.effective_lora_alpha,  # type: ignore[arg-type]  # peft says int; it divides by r (floats work)
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
