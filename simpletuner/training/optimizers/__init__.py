"""Optimizers written here, or wrapped (the torch ones are built in ``simpletuner.training.optim``), one module
each (``adamw_bf16``, ``automagic``, ``prodigy``, ``optimi``: torch-optimi's, ``bnb``: bitsandbytes' 8-bit ones):
import the one you use from its module, so a run pays only for the optimizer its config names."""
