"""The run's precision: the torch dtype of each ``mixed_precision`` mode, the bf16 -> fp16 fallback on GPUs
without bf16 (:func:`run_dtype` applies both), and the reset of Accelerate's process-wide precision state.

A leaf: training, caching and the memory estimator all read it, so it imports nothing from simpletuner.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

logger = logging.getLogger(__name__)

#: The torch dtype of each ``mixed_precision`` mode: frozen LoRA bases and text embeddings use it.
PRECISION_DTYPES: dict[str, torch.dtype] = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_mixed_precision(requested: str, cuda: Any = torch.cuda) -> str:
    """``requested``, except bf16 on a CUDA GPU without bf16 (before Ampere) becomes fp16 (said once)."""
    if requested != "bf16" or not cuda.is_available():
        return requested
    if cuda.is_bf16_supported():
        return requested
    logger.warning(
        "mixed_precision 'bf16' is not supported by %s; using 'fp16' (set mixed_precision to 'fp16' or 'no' to "
        "silence this)",
        cuda.get_device_name(),
    )
    return "fp16"


def run_dtype(config: TrainingConfig, cuda: Any = torch.cuda) -> torch.dtype:
    """The torch dtype the run computes in: ``config.mixed_precision``'s, after the bf16 -> fp16 fallback on
    ``cuda``'s GPU (:func:`resolve_mixed_precision`); ``cuda=None``: the dtype asked for, on a GPU with bf16
    (the memory estimate, made for a target GPU rather than this machine's). Frozen LoRA bases and cached
    text embeddings are stored in it."""
    if cuda is None:
        return PRECISION_DTYPES[config.mixed_precision]
    return PRECISION_DTYPES[resolve_mixed_precision(config.mixed_precision, cuda)]


def reset_accelerate_state() -> None:
    """Accelerate keeps precision choices in process-wide state; clear them when a run starts so
    each run in a process (tests, notebooks) chooses its own. The process group stays up."""
    from accelerate.state import AcceleratorState, GradientState  # accelerate loads only when a run starts

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
