"""torch-optimi's optimizers under SimpleTuner's names (``optimi-adamw``, ``optimi-adam``, ``optimi-sgd``,
``optimi-lion``, ``optimi-stableadamw``, ``optimi-radam``, ``optimi-ranger``, ``optimi-adan``), built from optimi's
own classes as SimpleTuner builds them (its optimizer table, helpers/training/optimizer_param.py:290-410), so every
setting its configs give them (``decouple_lr``, ``max_lr``, ``kahan_sum``, ``decouple_wd``, ...) means the same.

``betas`` come from ``adam_beta1`` / ``adam_beta2`` (and Adan's third from ``optimizer_config.beta3``), ``eps`` from
``adam_epsilon`` (not Lion's or SGD's), then ``weight_decay`` and the other ``optimizer_config`` settings. Kahan
summation acts only on bf16 / fp16 weights; the adapters and full fine-tunes here train fp32 weights. Why optimi's
classes and not torch's for AdamW / Adam / SGD: documentation/CONFIG.md, "Optimizers under SimpleTuner's names".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

if TYPE_CHECKING:
    from simpletuner.configuration import TrainingConfig

#: Our optimizer name -> optimi's class.
OPTIMI_CLASSES = {
    "optimi-adamw": "AdamW",
    "optimi-adam": "Adam",
    "optimi-sgd": "SGD",
    "optimi-lion": "Lion",
    "optimi-stableadamw": "StableAdamW",
    "optimi-radam": "RAdam",
    "optimi-ranger": "Ranger",
    "optimi-adan": "Adan",
}
#: Optimizers whose class takes no ``eps`` / no ``betas``.
_NO_EPS = frozenset({"optimi-lion", "optimi-sgd"})
_NO_BETAS = frozenset({"optimi-sgd"})


def optimi_class(name: str) -> type:
    """optimi's class for ``name`` (a key of :data:`OPTIMI_CLASSES`); ValueError naming the extra when torch-optimi
    is not installed."""
    try:
        import optimi
    except ImportError as exc:
        raise ValueError(
            f'optimizer {name!r} needs torch-optimi: pip install -e ".[optimi]" in the simpletuner checkout '
            "(or pip install torch-optimi), or choose another optimizer"
        ) from exc
    return getattr(optimi, OPTIMI_CLASSES[name])


def build_optimi(
    config: TrainingConfig, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]
) -> torch.optim.Optimizer:
    """optimi's optimizer ``config.optimizer`` over ``params`` (parameters or param groups, a group may carry its own
    ``lr``), with ``config.optimizer_config`` as the class's other keyword arguments (checked with the config;
    Adan's ``beta3`` joins ``betas``)."""
    name = config.optimizer
    kwargs: dict[str, Any] = dict(config.optimizer_config)
    betas = (config.adam_beta1, config.adam_beta2)
    if name not in _NO_BETAS:
        kwargs["betas"] = (*betas, kwargs.pop("beta3")) if name == "optimi-adan" else betas
    if name not in _NO_EPS:
        kwargs["eps"] = config.adam_epsilon
    return optimi_class(name)(params, lr=config.learning_rate, weight_decay=config.weight_decay, **kwargs)
