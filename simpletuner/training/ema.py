"""An exponential moving average (EMA) of the trained parameters (``use_ema``).

It covers exactly what the run trains, keyed by parameter name as ``trainable.safetensors`` is, and is
updated after a real optimizer step (never a skipped, non-finite window) whose number is a multiple of
``ema_update_interval``, with SimpleTuner's decay schedule (:func:`decay_at`):
``shadow <- decay * shadow + (1 - decay) * param``. It lives on rank 0 only, on ``ema_device``; checkpoints
carry it as ``ema.safetensors`` and the final save writes it under ``output_dir/ema``.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

logger = logging.getLogger(__name__)

#: The folder under ``output_dir`` the final EMA weights go to (same layout as the final weights).
EMA_FOLDER = "ema"
#: The file of a checkpoint that holds the EMA tensors.
EMA_FILE = "ema.safetensors"


def decay_at(step: int, decay: float, warmup_steps: int = 0) -> float:
    """The decay SimpleTuner's EMA uses at optimizer step ``step`` (1 for the first step).

    With ``warmup_steps`` > 0: 0 (the average copies the weights) before step ``warmup_steps``,
    ``decay`` from there on. Otherwise the warm-up ramp ``(1 + s) / (10 + s)`` with ``s = step - 1``,
    capped at ``decay``; 0 at the first step (``s = 0``), so the average starts as a copy.
    """
    if warmup_steps > 0:
        return 0.0 if step < warmup_steps else decay
    s = max(0, step - 1)
    if s <= 0:
        return 0.0
    return min((1 + s) / (10 + s), decay)


class EMA:
    """The shadow copy of ``params`` (name -> trained parameter) and its update rule."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        *,
        decay: float,
        update_interval: int = 1,
        warmup_steps: int = 0,
        device: torch.device | str = "cpu",
    ):
        if not params:
            raise ValueError("use_ema: the model has no trained parameters to average")
        self.names = list(params)
        self.params = list(params.values())
        self.decay, self.update_interval, self.warmup_steps = decay, update_interval, warmup_steps
        self.device = torch.device(device)
        self.shadow = [p.detach().to(self.device, copy=True) for p in self.params]
        self.last_decay: float | None = None  # of the latest update; None before the first

    @classmethod
    def for_model(cls, model: nn.Module, config: TrainingConfig, accelerator_device: torch.device) -> EMA:
        """The EMA a config asks for, over ``model``'s (unwrapped) trained parameters."""
        device = accelerator_device if config.ema_device == "accelerator" else torch.device("cpu")
        params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        ema = cls(
            params,
            decay=config.ema_decay,
            update_interval=config.ema_update_interval,
            warmup_steps=config.ema_warmup_steps,
            device=device,
        )
        count = sum(p.numel() for p in ema.params)
        logger.info(
            "EMA of %d trained parameters (%s) on %s: decay %g, updated every %d step(s)",
            count,
            f"{len(ema.params)} tensors",
            device,
            ema.decay,
            ema.update_interval,
        )
        return ema

    def should_update(self, step: int) -> bool:
        """Whether optimizer step ``step`` updates the average (every ``update_interval``-th step)."""
        return step % self.update_interval == 0

    @torch.no_grad()
    def step(self, step: int) -> bool:
        """After optimizer step ``step`` (counted from 1): update the average when the interval says
        so; returns whether it did."""
        if not self.should_update(step):
            return False
        decay = decay_at(step, self.decay, self.warmup_steps)
        targets = [p.detach().to(s.device, s.dtype, copy=False) for s, p in zip(self.shadow, self.params)]
        # shadow + (1 - decay) * (param - shadow): SimpleTuner's shadow - (1 - decay) * (shadow - param).
        torch._foreach_lerp_(self.shadow, targets, 1.0 - decay)
        self.last_decay = decay
        return True

    def reset(self) -> None:
        """Start the average again from the parameters' current values."""
        for s, p in zip(self.shadow, self.params):
            s.copy_(p.detach())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The shadow tensors by parameter name (what a checkpoint saves)."""
        return dict(zip(self.names, self.shadow))

    def mismatch(self, tensors: dict[str, torch.Tensor]) -> str | None:
        """Why ``tensors`` (a saved :meth:`state_dict`) cannot be loaded here, or None."""
        if set(tensors) != set(self.names):
            return "its EMA tensors do not name this model's trained parameters (a different adapter or model?)"
        for name, s in zip(self.names, self.shadow):
            if tensors[name].shape != s.shape:
                return f"EMA tensor {name} has shape {tuple(tensors[name].shape)}, this model's {tuple(s.shape)}"
        return None

    @torch.no_grad()
    def load_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Put back a saved :meth:`state_dict` exactly."""
        problem = self.mismatch(tensors)
        if problem:
            raise ValueError(problem)
        for name, s in zip(self.names, self.shadow):
            s.copy_(tensors[name])

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The model holds the averaged weights inside the block and its own again after it (the
        trained values wait on the EMA's device meanwhile)."""
        with torch.no_grad():
            kept = [p.detach().to(self.device, copy=True) for p in self.params]
            for s, p in zip(self.shadow, self.params):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for k, p in zip(kept, self.params):
                    p.copy_(k)
