"""Where a run is and what its steps did: the counters a checkpoint saves (:class:`Progress`), one
optimizer step's outcome (:class:`StepOutcome`), the ``nonfinite_policy`` for a window that was
not finite (:class:`NonFinitePolicy`, whose verdict the trainer acts on) and what a finished
``train()`` returns."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from simpletuner.training.reliability import NonFiniteLoss

logger = logging.getLogger(__name__)


@dataclass
class Progress:
    """Where the run is: the counters every checkpoint saves (``trainer_state.json``'s top-level keys)."""

    global_step: int = 0
    micro_batches_seen: int = 0
    samples_seen: int = 0
    skipped_steps: int = 0  # windows whose loss or gradient was not finite (never applied)

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """From a checkpoint's trainer state."""
        self.global_step, self.micro_batches_seen = state["global_step"], state["micro_batches_seen"]
        self.samples_seen, self.skipped_steps = state["samples_seen"], state["skipped_steps"]


@dataclass(frozen=True)
class NonFiniteStop:
    """The policy's verdict on a window that was not finite: save the last good state, then raise :meth:`error`."""

    where: str  # the window (describe_window)
    why: str  # the setting that stops the run

    def error(self, saved: Path) -> NonFiniteLoss:
        """The error that stops the run, naming ``saved``, the checkpoint of the last good state."""
        return NonFiniteLoss(
            f"non-finite loss or gradient in {self.where}; {self.why}. The last good state is saved as {saved} (those "
            "weights never saw the bad window). Try a lower learning_rate, max_grad_norm (gradient clipping), bf16 "
            "instead of fp16, or nonfinite_policy 'skip' to step over rare bad batches; then resume_from_checkpoint "
            "'latest'"
        )


@dataclass(frozen=True)
class StepOutcome:
    """What :meth:`Trainer.train_step` did with one window of micro-batches, and what the loop must do next."""

    loss: torch.Tensor  # the window loss, on the device (reading it is a host sync)
    skipped: bool  # loss or gradient not finite: nothing was applied, nothing advanced
    num_samples: int  # this rank's samples in the window
    preempt_signum: int | None = None  # a stop signal every rank agreed on at this step: save and stop
    nonfinite_stop: NonFiniteStop | None = None  # a skipped window the nonfinite_policy stops on


@dataclass
class TrainResult:
    """What a finished ``train()`` returns (for callers and tests)."""

    global_step: int
    losses: list[float] = field(default_factory=list)  # window loss per optimizer step this run
    output_path: Path | None = None
    validation_images: list[Path] = field(default_factory=list)


def describe_window(step: int, loss: torch.Tensor, norm: torch.Tensor, micro_batches: list) -> str:
    """``the window after step N (loss .., gradient norm ..; samples ..)``: its first eight sample keys."""
    keys = [s.key for b in micro_batches for s in b.samples]
    return (
        f"the window after step {step} (loss {loss.item():.4g}, gradient norm "
        f"{norm.item():.4g}; samples {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''})"
    )


class NonFinitePolicy:
    """``nonfinite_policy`` for a window whose loss or gradient was not finite (its gradients are
    dropped): skip it, up to ``max_consecutive_nonfinite`` in a row, or stop the run with the last
    good state saved (:class:`NonFiniteStop`; :class:`NonFiniteLoss`, exit 3)."""

    def __init__(self, config):
        self.config = config
        self.consecutive = 0  # not-finite windows in a row

    def passed(self) -> None:
        """A finite window: the count of bad ones in a row starts again."""
        self.consecutive = 0

    def failed(self, where: str, skipped_steps: int) -> NonFiniteStop | None:
        """Count the window ``where`` describes: None when it is skipped (logged), else the verdict to stop."""
        cfg = self.config
        self.consecutive += 1
        if cfg.nonfinite_policy == "skip" and self.consecutive < cfg.max_consecutive_nonfinite:
            logger.warning("skipped %s: not finite (%d in a row, %d this run)", where, self.consecutive, skipped_steps)
            return None
        why = (
            f"{self.consecutive} windows in a row were not finite (max_consecutive_nonfinite="
            f"{cfg.max_consecutive_nonfinite})"
            if cfg.nonfinite_policy == "skip"
            else "nonfinite_policy is 'stop'"
        )
        return NonFiniteStop(where, why)
