"""Which learning-rate schedules read `lr_end` and `lr_power`, their defaults when unset, and the rule that
refuses a setting no schedule reads (a value that would do nothing is a mistake worth naming)."""

from __future__ import annotations

from typing import Iterator

#: SimpleTuner's floor of its own `cosine` (its registry default of `lr_end`).
SIMPLETUNER_LR_END = 4e-7

#: Schedules that read `lr_end` -> its value when unset: diffusers' polynomial default, and SimpleTuner's
#: default for the shape named after it.
LR_END_DEFAULTS: dict[str, float] = {"polynomial": 1e-7, "simpletuner_cosine": SIMPLETUNER_LR_END}

#: Schedules that read `lr_power` -> its value when unset (diffusers' polynomial default).
LR_POWER_DEFAULTS: dict[str, float] = {"polynomial": 1.0}

#: SimpleTuner's cosine falls back to this many scheduler steps of half-period when `lr_warmup_steps` is 0.
SIMPLETUNER_COSINE_DEFAULT_PERIOD = 1000


def lr_end(cfg) -> float:
    """The floor `cfg.lr_scheduler` decays to (its default when `lr_end` is unset)."""
    return cfg.lr_end if cfg.lr_end is not None else LR_END_DEFAULTS[cfg.lr_scheduler]


def lr_power(cfg) -> float:
    """`polynomial`'s exponent (its default when `lr_power` is unset)."""
    return cfg.lr_power if cfg.lr_power is not None else LR_POWER_DEFAULTS[cfg.lr_scheduler]


def schedule_problems(cfg) -> Iterator[str]:
    """`lr_end` / `lr_power` set for a schedule that does not read them; a polynomial floor at or above the peak."""
    for key, readers in (("lr_end", LR_END_DEFAULTS), ("lr_power", LR_POWER_DEFAULTS)):
        if getattr(cfg, key) is not None and cfg.lr_scheduler not in readers:
            yield (
                f"{key} {getattr(cfg, key)} is not read by lr_scheduler {cfg.lr_scheduler!r} (only by "
                f"{' and '.join(readers)}): remove {key} or pick one of those schedules"
            )
    if cfg.lr_scheduler == "polynomial" and lr_end(cfg) >= cfg.learning_rate:
        yield (
            f"lr_end {lr_end(cfg)} is not below learning_rate {cfg.learning_rate}: polynomial decays from "
            "learning_rate down to lr_end; lower lr_end"
        )
