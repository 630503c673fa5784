"""Every RNG a run draws from (torch, CUDA, numpy, Python and the noise generator), captured for a
checkpoint and restored on resume, per rank: a resumed run draws what the uninterrupted one would."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def noise_generator(seed: int, process_index: int) -> torch.Generator:
    """The CPU generator rank ``process_index`` draws noise and timesteps from (one per rank)."""
    return torch.Generator().manual_seed(seed + 7919 * process_index)


def capture_rng(generator: torch.Generator) -> dict[str, Any]:
    """Every RNG the run draws from, in a form torch.load(weights_only=True) accepts."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # legacy=True: numpy's MT19937 tuple
    py_state = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "gauss": float(np_state[4]),
        },
        "python": {"version": py_state[0], "state": list(py_state[1]), "gauss": py_state[2]},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any], generator: torch.Generator) -> None:
    """Put back what :func:`capture_rng` captured (CUDA states only where CUDA is available)."""
    torch.set_rng_state(state["torch"])
    generator.set_state(state["generator"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
