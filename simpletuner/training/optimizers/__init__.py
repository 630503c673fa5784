"""Optimizers written here (the torch ones are built in ``simpletuner.training.optim``)."""

from simpletuner.training.optimizers.automagic import Automagic, automagic_param_groups

__all__ = ["Automagic", "automagic_param_groups"]
