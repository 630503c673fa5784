"""What to say when a training step runs out of GPU memory: the estimate and what would fit.

The trainer's one door into this module (``simpletuner/layers.py``): :func:`explain_out_of_memory`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from simpletuner.exit_codes import first_line
from simpletuner.hardware.machine import detect_hardware
from simpletuner.memory.autoconfig import DoesNotFit, EstimateCache, plan_batch

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

logger = logging.getLogger(__name__)


def explain_out_of_memory(
    config: "TrainingConfig", exc: BaseException, usable_bytes: int | None = None, num_processes: int = 1
) -> str:
    """The failure, the estimator's breakdown for this config, and the settings that would fit.

    ``usable_bytes`` defaults to the detected device's usable memory. Estimating needs no GPU
    memory (meta and fake tensors), so it works right after the OOM.
    """
    lines = [f"out of GPU memory during a training step ({first_line(exc)}). Nothing was saved from this step."]
    try:
        if usable_bytes is None:
            usable_bytes = detect_hardware().usable_memory_bytes
        # one cache for the breakdown and the plan: the plan's search looks at the config's own micro-batch too
        estimates = EstimateCache(config, num_processes)
        breakdown = estimates(config.train_batch_size, config.gradient_checkpointing).breakdown
        lines.append("Estimated memory for this config:")
        lines.append(breakdown.table(usable_bytes))
        if usable_bytes:
            try:
                plan = plan_batch(config, usable_bytes, num_processes=num_processes, estimates=estimates)
            except DoesNotFit as no_fit:
                lines.append(str(no_fit))
            else:
                updates = ", ".join(f"{k}: {v}" for k, v in plan.config_updates().items())
                lines.append(
                    f"Settings estimated to fit with the same effective batch: {updates} "
                    f"(`simpletuner estimate --config <cfg> --apply` writes them)."
                )
    except Exception as estimate_error:  # the explanation must never hide the OOM itself
        logger.debug("memory estimate after OOM failed", exc_info=True)
        lines.append(
            f"(the memory estimate could not be made: {estimate_error}; run `simpletuner estimate --config <cfg>`)"
        )
    lines.append('Then resume with resume_from_checkpoint: "latest".')
    return "\n".join(lines)
