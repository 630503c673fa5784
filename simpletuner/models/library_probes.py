"""Quiet model libraries: no torchao or bitsandbytes unless a run uses it, no torchvision fallback notices.

:func:`quiet_model_libraries` (called when :mod:`simpletuner.models` is imported, before any model library
loads) makes transformers', diffusers' and peft's "is torchao installed?" probes answer no
(:func:`hide_from_library_probes`; ``import torchao`` itself still works), until
:func:`torchao_in_use` gives peft the true answer for a config that quantises with torchao; keeps peft from
importing bitsandbytes as it loads and as it wraps a layer (its CUDA library probe, and its error on a machine
without a matching build, in every run): an 8-bit optimizer imports it itself, and peft's LoRA never needs it
here (no bitsandbytes-quantised layers); and installs
:class:`TorchvisionFallbackFilter`, which drops transformers' "falling back to the PIL image processor"
warning and nothing else. Why and what it saves: documentation/MODEL_FAMILIES.md, "Quiet model libraries".
"""

from __future__ import annotations

import importlib.util
import logging
import sys

logger = logging.getLogger(__name__)

_TORCHAO = "torchao"
_BITSANDBYTES = "bitsandbytes"
#: The transformers logger that announces the PIL fallback.
TRANSFORMERS_IMPORT_LOGGER = "transformers.utils.import_utils"


class TorchvisionFallbackFilter(logging.Filter):
    """Drops transformers' "`XImageProcessor` requires torchvision (not installed); falling back
    to `XImageProcessorPil`" notice; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (
            "requires torchvision (not installed); falling back to" in message and "ImageProcessorPil" in message
        )


def quiet_model_libraries() -> None:
    """Hide torchao and bitsandbytes from the libraries' probes and filter the torchvision fallback notice
    (idempotent)."""
    hide_from_library_probes()
    target = logging.getLogger(TRANSFORMERS_IMPORT_LOGGER)
    if not any(isinstance(f, TorchvisionFallbackFilter) for f in target.filters):
        target.addFilter(TorchvisionFallbackFilter())


def hide_from_library_probes() -> bool:
    """Make transformers', diffusers' and peft's cached "torchao installed?" answers False, and load peft
    without bitsandbytes.

    torchao is left alone when it is not installed or is already imported (someone uses it), bitsandbytes
    when it is not installed, already imported, or peft already loaded. Answers that a library has already
    cached are left as they are. Returns True when the torchao answers were set.
    """
    hide = {
        _TORCHAO: _TORCHAO not in sys.modules,
        _BITSANDBYTES: _BITSANDBYTES not in sys.modules and "peft" not in sys.modules,  # peft.helpers imports it
    }
    hidden = [name for name, wanted in hide.items() if wanted and importlib.util.find_spec(name) is not None]
    if not hidden:
        return False
    for name in hidden:
        # find_spec() -> None, `import x` -> ModuleNotFoundError, for now (typeshed types the values as modules only)
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        import diffusers.utils.import_utils  # noqa: F401  computes diffusers' _torchao_available on import
        import peft.import_utils
        import transformers.utils.import_utils

        probes = {  # each lru_cache'd
            _TORCHAO: (
                getattr(transformers.utils.import_utils, "is_torchao_available", None),
                getattr(peft.import_utils, "is_torchao_available", None),
            ),
            # peft's LoRA imports its bitsandbytes layers (and bitsandbytes) when these answer yes
            _BITSANDBYTES: (
                getattr(peft.import_utils, "is_bnb_available", None),
                getattr(peft.import_utils, "is_bnb_4bit_available", None),
            ),
        }
        for probe in (probe for name in hidden for probe in probes[name]):
            if probe is not None:  # another version without this probe: nothing to answer
                probe()
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    logger.debug("installed but not imported, hidden from transformers, diffusers and peft as they load: %s", hidden)
    return _TORCHAO in hidden


def torchao_in_use() -> None:
    """Called where a config quantises with torchao: peft asks again, and now finds it."""
    peft_utils = sys.modules.get("peft.import_utils")
    probe = getattr(peft_utils, "is_torchao_available", None)
    if probe is not None and hasattr(probe, "cache_clear"):
        probe.cache_clear()
