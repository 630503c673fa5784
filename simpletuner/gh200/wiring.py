"""Turn ``cache_config`` and ``gh200_optimizations`` into runtime decisions for one run.

Called by ``Trainer._configure_gh200_runtime()``: applies the unified-memory hint override,
builds the accumulation policy (the ramp or a fixed window) and records what was decided in
the StateTracker and, on the main process, in ``<output_dir>/gh200_runtime.json``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import orjson

from simpletuner.gh200.ramp import GH200GradientRamp
from simpletuner.state import StateTracker
from simpletuner.training.accumulation import AccumulationPolicy, FixedAccumulation

logger = logging.getLogger(__name__)

RUNTIME_FILE = "gh200_runtime.json"


def uvm_hint_override(config) -> bool | None:
    """Config beats environment: an explicit ``enable_uvm_hints`` wins; a `unified_memory`
    cache turns hints on; otherwise None leaves the choice to SIMPLETUNER_GH200_UVM_HINTS."""
    opts, cache = config.gh200_optimizations, config.cache_config
    if opts.enable_uvm_hints is not None:
        return opts.enable_uvm_hints
    if "unified_memory" in (cache.vae_cache_type, cache.text_cache_type):
        return True
    return None


def build_accumulation(config, num_processes: int) -> AccumulationPolicy:
    """The ramp when enabled, else ``gradient_accumulation_steps`` fixed windows."""
    opts = config.gh200_optimizations
    if not opts.enable_batch_size_rampup:
        return FixedAccumulation(config.gradient_accumulation_steps)
    if config.gradient_accumulation_steps != 1:
        logger.info(
            "gradient_accumulation_steps=%d is ignored: the GH200 ramp decides the accumulation",
            config.gradient_accumulation_steps,
        )
    return GH200GradientRamp(
        opts.initial_effective_batch_size,
        opts.target_effective_batch_size,
        opts.batch_rampup_steps,
        config.train_batch_size,
        num_processes,
    )


def configure_runtime(state: StateTracker, num_processes: int, is_main_process: bool, output_dir: Path) -> AccumulationPolicy:
    """Apply hints, build the accumulation policy, record the decisions; returns the policy."""
    from simpletuner.gh200.uvm import gh200_uvm_enabled, set_uvm_hint_override, unified_memory_status

    config = state.config
    override = uvm_hint_override(config)
    set_uvm_hint_override(override)
    policy = build_accumulation(config, num_processes)
    cache = config.cache_config
    decided: dict[str, Any] = {
        "uvm_hint_override": override,
        "uvm_hints_active": gh200_uvm_enabled(),
        "unified_memory": unified_memory_status(),
        "vae_cache_type": cache.vae_cache_type,
        "text_cache_type": cache.text_cache_type,
        "persistent_cache": cache.persistent_cache,
        "cache_dir": cache.cache_dir,
        "accumulation": policy.state_dict(),
        "num_processes": num_processes,
    }
    state.set_gh200_runtime_config(decided)
    if is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / RUNTIME_FILE).write_bytes(orjson.dumps(decided, option=orjson.OPT_INDENT_2, default=str))
    return policy
