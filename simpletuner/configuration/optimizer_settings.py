"""`optimizer_config`: the optimizer's own settings, as a JSON object or SimpleTuner's `key=value,...` string.

Settings that have a config key of their own (`learning_rate`, `adam_beta1` / `adam_beta2`,
`adam_epsilon`, `weight_decay`, `prodigy_steps`) are refused here, naming that key, so each value
has one place. The rest are checked per optimizer before anything loads (:data:`OPTIMIZER_SETTINGS`).

The optimizers named as SimpleTuner names them (`optimi-*`, `bnb-*`, `torch-adafactor`) take SimpleTuner's own
defaults (:data:`NAMED_OPTIMIZER_DEFAULTS`) for what a config leaves out, so a name means the same in both dialects.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Literal, Mapping, Optional

Setting = Optional[object]

#: Every `optimizer` value: ours, then the ones named as SimpleTuner names them.
OptimizerName = Literal[
    "adamw",
    "adam",
    "sgd",
    "automagic",
    "adamw_bf16",
    "prodigy",
    "optimi-adamw",
    "optimi-adam",
    "optimi-sgd",
    "optimi-lion",
    "optimi-stableadamw",
    "optimi-radam",
    "optimi-ranger",
    "optimi-adan",
    "bnb-adamw8bit",
    "bnb-adamw8bit-paged",
    "bnb-lion8bit",
    "torch-adafactor",
]

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


def _optional_flag(value: Any) -> Optional[str]:
    return None if value is None or isinstance(value, bool) else "null or true or false"


def _optional_positive(value: Any) -> Optional[str]:
    return None if value is None or (_number(value) and value > 0) else "null or a number > 0"


def _not_positive(value: Any) -> Optional[str]:
    return None if _number(value) and value <= 0 else "a number <= 0"


def _not_negative(value: Any) -> Optional[str]:
    return None if _number(value) and value >= 0 else "a number >= 0"


def _share(value: Any) -> Optional[str]:
    return None if _number(value) and 0 < value <= 1 else "a number in (0, 1]"


#: optimizer_config key -> (check returning what the value must be, or None when it is fine; what it does).
SettingChecks = dict[str, tuple[Callable[[Any], Optional[str]], str]]

#: prodigyopt.Prodigy's settings (and ``split_groups``, see training/optimizers/prodigy.py).
PRODIGY_SETTINGS: SettingChecks = {
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
SGD_SETTINGS: SettingChecks = {
    "momentum": (_fraction, "momentum factor (default 0.9 here; SimpleTuner's optimi-sgd uses 0)"),
}

#: SGD's momentum when `optimizer_config` does not set it.
SGD_DEFAULT_MOMENTUM = 0.9

#: Settings every optimi optimizer takes (torch-optimi 0.3).
_OPTIMI_SETTINGS: SettingChecks = {
    "decouple_lr": (_flag, "fully decoupled weight decay: not scaled by the learning rate (default false)"),
    "max_lr": (_optional_positive, "with decouple_lr: the schedule's peak learning rate (default: learning_rate)"),
    "kahan_sum": (
        _optional_flag,
        "Kahan-summed updates of bf16 / fp16 weights (default true; the adapters and full fine-tunes here train "
        "fp32 weights, where it does nothing)",
    ),
    "foreach": (
        _optional_flag,
        "optimi's multi-tensor loop (default: optimi's choice, its Triton kernels where installed)",
    ),
}
_DECOUPLE_WD: SettingChecks = {"decouple_wd": (_flag, "decoupled (AdamW-style) weight decay instead of L2")}
_MIN_8BIT_SIZE: SettingChecks = {
    "min_8bit_size": (_whole_positive, "parameters with fewer elements keep 32-bit state (default 4096)"),
}

#: Each optimizer named as SimpleTuner names it -> its optimizer_config settings (the class's own arguments).
NAMED_OPTIMIZER_SETTINGS: dict[str, SettingChecks] = {
    "optimi-adamw": _OPTIMI_SETTINGS,
    "optimi-adam": {**_OPTIMI_SETTINGS, **_DECOUPLE_WD},
    "optimi-sgd": {
        **_OPTIMI_SETTINGS,
        **_DECOUPLE_WD,
        "momentum": (_fraction, "momentum factor (default 0)"),
        "dampening": (_flag, "dampen the momentum by (1 - momentum) (default false)"),
        "torch_init": (_flag, "with dampening: start the momentum at the first gradient, as torch (default false)"),
    },
    "optimi-lion": _OPTIMI_SETTINGS,
    "optimi-stableadamw": _OPTIMI_SETTINGS,
    "optimi-radam": {**_OPTIMI_SETTINGS, **_DECOUPLE_WD},
    "optimi-ranger": {
        **_OPTIMI_SETTINGS,
        **_DECOUPLE_WD,
        "k": (_whole_positive, "Lookahead: steps between syncs of the slow weights (default 6)"),
        "alpha": (_share, "Lookahead: how far the slow weights move toward the fast ones (default 0.5)"),
    },
    "optimi-adan": {
        **_OPTIMI_SETTINGS,
        "beta3": (_fraction, "decay of the squared-gradient average (default 0.999, SimpleTuner's)"),
        "adam_wd": (_flag, "AdamW-style weight decay instead of Adan's proximal one (default false)"),
    },
    "bnb-adamw8bit": _MIN_8BIT_SIZE,
    "bnb-adamw8bit-paged": _MIN_8BIT_SIZE,
    "bnb-lion8bit": _MIN_8BIT_SIZE,
    "torch-adafactor": {
        "beta2_decay": (_not_positive, "decay-rate exponent of the second-moment average (default -0.8)"),
        "d": (_not_negative, "clipping threshold of the update's RMS (default 1.0)"),
        "eps1": (_optional_positive, "added to the second moments (default null: the dtype's smallest step)"),
        "eps2": (_not_negative, "floor of the weights' RMS in the relative step (default 1e-3)"),
    },
}

#: optimizer -> the optimizer_config keys it takes.
OPTIMIZER_SETTINGS: dict[str, SettingChecks] = {
    "prodigy": PRODIGY_SETTINGS,
    "sgd": SGD_SETTINGS,
    **NAMED_OPTIMIZER_SETTINGS,
}

#: Defaults of the optimizers named as SimpleTuner names them: SimpleTuner's `default_settings` for each
#: (simpletuner/helpers/training/optimizer_param.py at the dialect's commit; the line cited), as our keys
#: (`optimizer_config.<key>` for a setting with no key of its own). Written into a config that leaves the key out;
#: listed where SimpleTuner's value differs from our key's default (top-level keys) or from the class's own
#: default (`optimizer_config`; and optimi-sgd's momentum 0, which is optimi's too, but not our `sgd`'s).
#: `eps` of `torch-adafactor` is its (eps1, eps2) pair there, torch's own (None, 1e-3): `eps1` / `eps2` here.
NAMED_OPTIMIZER_DEFAULTS: dict[str, dict[str, tuple[Any, str]]] = {
    "optimi-stableadamw": {
        "adam_beta2": (0.99, "optimizer_param.py:305"),
        "adam_epsilon": (1e-6, "optimizer_param.py:307"),
    },
    "optimi-adamw": {
        "adam_beta2": (0.99, "optimizer_param.py:318"),
        "adam_epsilon": (1e-6, "optimizer_param.py:319"),
        "weight_decay": (0.0, "optimizer_param.py:320"),
    },
    "optimi-lion": {"adam_beta2": (0.99, "optimizer_param.py:330"), "weight_decay": (0.0, "optimizer_param.py:331")},
    "optimi-radam": {
        "adam_beta2": (0.99, "optimizer_param.py:342"),
        "weight_decay": (0.0, "optimizer_param.py:343"),
        "adam_epsilon": (1e-6, "optimizer_param.py:344"),
        "optimizer_config.decouple_wd": (True, "optimizer_param.py:345"),
    },
    "optimi-ranger": {
        "adam_beta2": (0.99, "optimizer_param.py:355"),
        "weight_decay": (0.0, "optimizer_param.py:356"),
        "adam_epsilon": (1e-6, "optimizer_param.py:357"),
    },
    "optimi-adan": {
        "adam_beta1": (0.98, "optimizer_param.py:371"),
        "adam_beta2": (0.92, "optimizer_param.py:371"),
        "optimizer_config.beta3": (0.999, "optimizer_param.py:371"),
        "optimizer_config.kahan_sum": (True, "optimizer_param.py:377"),  # optimi's Adan defaults to false
        "weight_decay": (2e-2, "optimizer_param.py:372"),
        "adam_epsilon": (1e-6, "optimizer_param.py:373"),
    },
    "optimi-adam": {
        "adam_beta2": (0.99, "optimizer_param.py:385"),
        "adam_epsilon": (1e-6, "optimizer_param.py:386"),
        "weight_decay": (0.0, "optimizer_param.py:387"),
    },
    "optimi-sgd": {
        "optimizer_config.momentum": (0.0, "optimizer_param.py:398"),
        "weight_decay": (0.0, "optimizer_param.py:399"),
    },
    "bnb-adamw8bit": {"adam_epsilon": (1e-6, "optimizer_param.py:594")},
    "bnb-adamw8bit-paged": {"adam_epsilon": (1e-6, "optimizer_param.py:612")},
    "bnb-lion8bit": {"adam_beta2": (0.99, "optimizer_param.py:628"), "weight_decay": (0.0, "optimizer_param.py:629")},
    "torch-adafactor": {"weight_decay": (0.0, "optimizer_param.py:160")},
}


def with_optimizer_defaults(data: Any) -> Any:
    """``data`` (a config's mapping, before validation) with its optimizer's :data:`NAMED_OPTIMIZER_DEFAULTS`
    where it leaves a key out. Anything else (not a mapping, another optimizer, an `optimizer_config` that does
    not read) is returned as it is, for the schema to report."""
    if not isinstance(data, Mapping):
        return data
    name = data.get("optimizer")
    defaults = NAMED_OPTIMIZER_DEFAULTS.get(name) if isinstance(name, str) else None
    if not defaults:
        return data
    filled = dict(data)
    settings: Optional[dict[str, Any]] = None
    for key, (value, _) in defaults.items():
        setting = key.removeprefix("optimizer_config.")
        if setting == key:
            filled.setdefault(key, value)
            continue
        if settings is None:
            try:
                parsed = parse_optimizer_config(filled.get("optimizer_config"))
            except ValueError:
                return data
            if not isinstance(parsed, dict):
                return data
            settings = dict(parsed)
        settings.setdefault(setting, value)
    if settings is not None:
        filled["optimizer_config"] = settings
    return filled


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
        if key == "eps" and optimizer == "torch-adafactor":
            yield "optimizer_config.eps: torch-adafactor's epsilons are a pair here: set `eps1` and `eps2`"
        elif key in TOP_LEVEL_SETTINGS:
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
