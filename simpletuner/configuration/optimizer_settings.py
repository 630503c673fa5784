"""`optimizer_config`: the optimizer's own settings, as a JSON object or SimpleTuner's `key=value,...` string.

Settings that have a config key of their own (`learning_rate`, `adam_beta1` / `adam_beta2`,
`adam_epsilon`, `weight_decay`, `prodigy_steps`) are refused here, naming that key, so each value
has one place. The rest are checked per optimizer before anything loads: `prodigy` and `sgd` take some.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Optional

Setting = Optional[object]

#: optimizer_config keys that are top-level config keys here -> that key (refused in optimizer_config).
TOP_LEVEL_SETTINGS = {
    "lr": "learning_rate",
    "learning_rate": "learning_rate",
    "betas": "adam_beta1 and adam_beta2",
    "eps": "adam_epsilon",
    "weight_decay": "weight_decay",
    "prodigy_steps": "prodigy_steps (a top-level key)",
}

#: Settings of SimpleTuner's `prodigy` (prodigy-plus-schedule-free) that prodigyopt's Prodigy, used
#: here, does not have.
PRODIGY_PLUS_ONLY = frozenset(
    {
        "weight_decay_by_lr",
        "use_speed",
        "split_groups_mean",
        "factored",
        "factored_fp32",
        "fused_back_pass",
        "use_stableadamw",
        "use_cautious",
        "use_grams",
        "use_adopt",
        "stochastic_rounding",
    }
)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: Any) -> Optional[str]:
    return None if _number(value) and value > 0 else "a number > 0"


def _beta(value: Any) -> Optional[str]:
    return None if value is None or (_number(value) and 0 <= value < 1) else "null or a number in [0, 1)"


def _fraction(value: Any) -> Optional[str]:
    return None if _number(value) and 0 <= value < 1 else "a number in [0, 1)"


def _at_least_one(value: Any) -> Optional[str]:
    return None if _number(value) and value >= 1 else "a number >= 1"


def _flag(value: Any) -> Optional[str]:
    return None if isinstance(value, bool) else "true or false"


def _whole_positive(value: Any) -> Optional[str]:
    return None if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else "a whole number >= 1"


#: prodigyopt.Prodigy's settings (and ``split_groups``, see training/optimizers/prodigy.py): key ->
#: (check returning what the value must be, or None when it is fine; what the setting does).
PRODIGY_SETTINGS: dict[str, tuple[Callable[[Any], Optional[str]], str]] = {
    "d_coef": (_positive, "multiplies the estimate of d (default 1.0; 0.5-2 are usual): the preferred knob"),
    "d0": (_positive, "initial d (default 1e-6)"),
    "growth_rate": (_at_least_one, "d grows at most this factor per step (default unbounded; 1.02 warms up)"),
    "beta3": (_beta, "decay of the d statistics (default sqrt(adam_beta2))"),
    "use_bias_correction": (_flag, "Adam's bias correction (default false)"),
    "safeguard_warmup": (_flag, "leave the lr out of the d statistics during warm-up (default false)"),
    "decouple": (_flag, "decoupled (AdamW) weight decay (default true)"),
    "slice_p": (_whole_positive, "estimate d from every p-th element only, to save memory (default 1)"),
    "split_groups": (_flag, "one d per param group, e.g. per Wan 2.2 expert (default true)"),
}

#: SGD's settings (torch.optim.SGD).
SGD_SETTINGS: dict[str, tuple[Callable[[Any], Optional[str]], str]] = {
    "momentum": (_fraction, "momentum factor (default 0.9 here; SimpleTuner's optimi-sgd uses 0)"),
}

#: SGD's momentum when `optimizer_config` does not set it.
SGD_DEFAULT_MOMENTUM = 0.9

#: optimizer -> the optimizer_config keys it takes.
OPTIMIZER_SETTINGS: dict[str, dict[str, tuple[Callable[[Any], Optional[str]], str]]] = {
    "prodigy": PRODIGY_SETTINGS,
    "sgd": SGD_SETTINGS,
}


def _scalar(text: str) -> Setting:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_optimizer_config(value: Any) -> Any:
    """A SimpleTuner string (``"d_coef=0.5,use_bias_correction=true"``: ``true``/``false``, ``none``,
    numbers, else text) as a dict; a dict, or anything else, as it is (pydantic checks the type).

    Raises:
        ValueError: a string piece is not ``key=value``.
    """
    if value is None:
        return {}
    if not isinstance(value, str):
        return value
    settings: dict[str, Setting] = {}
    for piece in value.split(","):
        if not piece.strip():
            continue
        key, sep, text = piece.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"{piece.strip()!r} is not key=value: write the settings as key=value pairs separated by commas "
                '("d_coef=0.5,use_bias_correction=true") or as a JSON object'
            )
        settings[key.strip()] = _scalar(text)
    return settings


def optimizer_config_problems(optimizer: str, settings: dict[str, Any]) -> Iterator[str]:
    """One line per `optimizer_config` key that ``optimizer`` does not take, or value it cannot use."""
    known = OPTIMIZER_SETTINGS.get(optimizer, {})
    for key, value in settings.items():
        if key in TOP_LEVEL_SETTINGS:
            yield f"optimizer_config.{key}: set it with `{TOP_LEVEL_SETTINGS[key]}`, not in optimizer_config"
        elif optimizer == "prodigy" and key in PRODIGY_PLUS_ONLY:
            yield (
                f"optimizer_config.{key} is a setting of SimpleTuner's Prodigy (prodigy-plus-schedule-free); "
                f"optimizer prodigy here is prodigyopt's Prodigy, which has no {key}: remove it "
                f"(it takes {', '.join(sorted(known))})"
            )
        elif key not in known:
            takes = f"it takes {', '.join(sorted(known))}" if known else "it takes no optimizer_config settings"
            yield f"optimizer_config.{key} is not a setting of optimizer {optimizer!r} ({takes}): remove it"
        else:
            must_be = known[key][0](value)
            if must_be:
                yield f"optimizer_config.{key} is {value!r}; it must be {must_be}"


#: Prodigy multiplies its own step-size estimate by the learning rate; below this it barely trains.
PRODIGY_MIN_LR = 0.1


def prodigy_learning_rate_problems(rates: dict[str, float]) -> Iterator[str]:
    """One line per learning-rate key (name -> value) too far below 1.0 for Prodigy."""
    for key, rate in rates.items():
        if rate is not None and rate < PRODIGY_MIN_LR:
            yield (
                f"{key} {rate:g} with optimizer prodigy: Prodigy estimates its own step size and multiplies it by "
                f"{key}, which should be about 1.0 (at least {PRODIGY_MIN_LR:g}); {rate:g} shrinks every step "
                f"{1 / rate:g}-fold. Set {key} to 1.0 (SimpleTuner passes 1.0 to Prodigy whatever its "
                "learning_rate says)"
            )
