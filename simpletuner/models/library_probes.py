"""Quiet model libraries: no torchao unless a run uses it, no torchvision fallback notices.

:func:`quiet_model_libraries` (called when :mod:`simpletuner.models` is imported, before any model library
loads) makes transformers', diffusers' and peft's "is torchao installed?" probes answer no
(:func:`hide_torchao_from_library_probes`; ``import torchao`` itself still works), until
:func:`torchao_in_use` gives peft the true answer for a config that quantises with torchao; and installs
:class:`TorchvisionFallbackFilter`, which drops transformers' "falling back to the PIL image processor"
warning and nothing else. Why and what it saves: documentation/MODEL_FAMILIES.md, "Quiet model libraries".
"""

from __future__ import annotations

import importlib.util
import logging
import sys

logger = logging.getLogger(__name__)

_TORCHAO = "torchao"
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
    """Hide torchao from the libraries' probes and filter the torchvision fallback notice (idempotent)."""
    hide_torchao_from_library_probes()
    target = logging.getLogger(TRANSFORMERS_IMPORT_LOGGER)
    if not any(isinstance(f, TorchvisionFallbackFilter) for f in target.filters):
        target.addFilter(TorchvisionFallbackFilter())


def hide_torchao_from_library_probes() -> bool:
    """Make transformers', diffusers' and peft's cached "torchao installed?" answers False.

    Does nothing (returns False) when torchao is not installed or is already imported (someone
    uses it). Answers that a library has already cached are left as they are. Returns True when
    the answers were set.
    """
    if _TORCHAO in sys.modules or importlib.util.find_spec(_TORCHAO) is None:
        return False
    # find_spec() -> None, `import torchao` -> ModuleNotFoundError, for now (typeshed types the values as modules only)
    sys.modules[_TORCHAO] = None  # type: ignore[assignment]
    try:
        import diffusers.utils.import_utils  # noqa: F401  computes diffusers' _torchao_available on import
        import peft.import_utils
        import transformers.utils.import_utils

        for probe in (
            getattr(transformers.utils.import_utils, "is_torchao_available", None),  # both lru_cache'd
            getattr(peft.import_utils, "is_torchao_available", None),
        ):
            if probe is not None:  # another version without this probe: nothing to answer
                probe()
    finally:
        if sys.modules.get(_TORCHAO, 0) is None:
            del sys.modules[_TORCHAO]
    logger.debug(
        "torchao is installed but not imported: transformers, diffusers and peft were told it is absent "
        "(a torchao base_model_precision tells peft again)"
    )
    return True


def torchao_in_use() -> None:
    """Called where a config quantises with torchao: peft asks again, and now finds it."""
    peft_utils = sys.modules.get("peft.import_utils")
    probe = getattr(peft_utils, "is_torchao_available", None)
    if probe is not None and hasattr(probe, "cache_clear"):
        probe.cache_clear()
