"""Optimizers written here, or wrapped (the torch ones are built in ``simpletuner.training.optim``)."""

from simpletuner.training.optimizers.adamw_bf16 import AdamWBF16
from simpletuner.training.optimizers.automagic import Automagic, automagic_param_groups
from simpletuner.training.optimizers.prodigy import prodigy_class

__all__ = ["AdamWBF16", "Automagic", "automagic_param_groups", "prodigy_class"]
