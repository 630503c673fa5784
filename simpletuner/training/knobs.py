"""Start-up knobs: TF32, the CUDA allocator settings and torch.compile.

The functions take the pieces of the machine they look at as arguments (``cuda`` module,
``torch.backends``, environment), so the CPU tests drive the CUDA branches with a fake that records calls.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, MutableMapping

import torch

from simpletuner.configuration.alloc_conf import ALLOC_CONF_VAR, format_alloc_value

logger = logging.getLogger(__name__)


def apply_tf32(enabled: bool, backends: Any = torch.backends) -> None:
    """Allow (or forbid) TF32 in CUDA matmuls and cuDNN convolutions."""
    backends.cuda.matmul.allow_tf32 = enabled
    backends.cudnn.allow_tf32 = enabled


def apply_cuda_allocator(
    settings: Mapping[str, bool | int | float], environ: MutableMapping[str, str] = os.environ, cuda: Any = torch.cuda
) -> str | None:
    """Merge ``settings`` into PYTORCH_CUDA_ALLOC_CONF (config keys win); returns the value set.

    The allocator reads the variable when CUDA starts, so settings that arrive after that are
    reported as not applied for this process.
    """
    if not settings:
        return environ.get(ALLOC_CONF_VAR)
    merged: dict[str, str] = {}
    for part in filter(None, (environ.get(ALLOC_CONF_VAR) or "").split(",")):
        key, _, value = part.partition(":")
        merged[key.strip()] = value.strip()
    for key, setting in settings.items():
        if key in merged and merged[key] != format_alloc_value(setting):
            logger.info(
                "cuda_allocator.%s=%s overrides %s from the environment", key, format_alloc_value(setting), merged[key]
            )
        merged[key] = format_alloc_value(setting)
    value = ",".join(f"{k}:{v}" for k, v in merged.items())
    environ[ALLOC_CONF_VAR] = value
    if cuda.is_initialized():
        logger.warning(
            "cuda_allocator set %s=%s after CUDA started: it applies to new processes only. Launch through "
            "simpletuner/train.py or export the variable before starting Python",
            ALLOC_CONF_VAR,
            value,
        )
    return value


def maybe_compile(model: torch.nn.Module, enabled: bool) -> torch.nn.Module:
    """``torch.compile(model)`` when enabled (logged); the model unchanged otherwise."""
    if not enabled:
        return model
    logger.info("compiling the denoiser with torch.compile: the first steps (and each new bucket shape) are slow")
    compile_parts = getattr(model, "compile_parts", None)  # only some models have it
    if compile_parts is not None:  # a container that routes in Python (Wan 2.2's experts): compile each part
        compile_parts()
        return model
    # The stub types torch.compile as returning a plain callable; for a Module it returns an OptimizedModule.
    return torch.compile(model)  # type: ignore[return-value]
