"""Turn ``cache_config`` and ``gh200_optimizations`` into runtime decisions for one run.

Called by ``Trainer._configure_gh200_runtime()``, after the trainer has built its accumulation
policy (:mod:`simpletuner.training.accumulation`: the ramp or a fixed window): applies the
unified-memory hint override and records what was decided, the policy's ``state_dict`` included,
in the StateTracker and, on the main process of a run that configures the GH200 layer
(:func:`gh200_layer_requests`), in ``<output_dir>/gh200_runtime.json``. An ordinary run writes
no file and logs one DEBUG line ("GH200 unified-memory hints are off: off by default").
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping

import orjson

from simpletuner.gh200.managed_memory import check_managed_memory, start_managed_memory
from simpletuner.gh200.uvm import (
    ENV_ALIAS,
    ENV_VAR,
    cache_type_used,
    env_hint_request,
    gh200_uvm_enabled,
    set_uvm_hint_override,
    unified_memory_status,
)
from simpletuner.host import collect_host
from simpletuner.state import StateTracker

logger = logging.getLogger(__name__)

RUNTIME_FILE = "gh200_runtime.json"


def uvm_hint_decision(config, environ: Mapping[str, str] | None = None) -> tuple[bool | None, str]:
    """``(override, the setting behind it)`` for :func:`~simpletuner.gh200.uvm.set_uvm_hint_override`.

    An explicit ``gh200_optimizations.enable_uvm_hints`` wins; else the environment
    (``SIMPLETUNER_GH200_UVM_HINTS`` or its alias ``SIMPLETUNER_GH200_ENABLE_UVM_HINTS``; None
    hands it the choice); else a `unified_memory` cache turns hints on; else None (off).

    Raises:
        ValueError: the two environment names disagree (checked even when the config decides).
    """
    opts, cache = config.gh200_optimizations, config.cache_config
    from_env, env_source = env_hint_request(environ)
    if opts.enable_uvm_hints is not None:
        setting = f"gh200_optimizations.enable_uvm_hints={str(opts.enable_uvm_hints).lower()}"
        if from_env is not None and from_env != opts.enable_uvm_hints:
            setting += f" (the config overrides {env_source})"
        return opts.enable_uvm_hints, setting
    if from_env is not None:
        return None, env_source
    unified = [
        f"{name}_cache_type" for name in ("vae", "text") if getattr(cache, f"{name}_cache_type") == "unified_memory"
    ]
    if unified:
        return True, f"cache_config.{' and '.join(unified)} = unified_memory"
    return None, "nothing asks for them"


def gh200_layer_requests(config, environ: Mapping[str, str] | None = None) -> list[str]:
    """The settings that configure the GH200 layer in this run; empty: an ordinary run.

    The layer is configured by any of: a cache of type ``memory`` or ``unified_memory``
    (``cache_config.vae_cache_type`` / ``text_cache_type``), a dataset of ``type: in_memory``,
    ``gh200_optimizations.enable_uvm_hints`` set (true or false), the ramp
    (``gh200_optimizations.enable_batch_size_rampup``), or a hint environment variable
    (``SIMPLETUNER_GH200_UVM_HINTS`` / ``SIMPLETUNER_GH200_ENABLE_UVM_HINTS``) set to anything.
    Only then are the decisions written to ``<output_dir>/gh200_runtime.json``.
    """
    environ = os.environ if environ is None else environ
    cache, opts = config.cache_config, config.gh200_optimizations
    found = [
        f"cache_config.{name}_cache_type={getattr(cache, f'{name}_cache_type')}"
        for name in ("vae", "text")
        if getattr(cache, f"{name}_cache_type") in ("memory", "unified_memory")
    ]
    found += [
        f"datasets[{i}].type=in_memory"
        for i, dataset in enumerate(config.datasets or [])
        if getattr(dataset, "type", None) == "in_memory"
    ]
    if opts.enable_uvm_hints is not None:
        found.append(f"gh200_optimizations.enable_uvm_hints={str(opts.enable_uvm_hints).lower()}")
    if opts.enable_batch_size_rampup:
        found.append("gh200_optimizations.enable_batch_size_rampup=true")
    if opts.managed_memory != "caches":
        found.append(f"gh200_optimizations.managed_memory={opts.managed_memory}")
    found += [name for name in (ENV_VAR, ENV_ALIAS) if environ.get(name, "").strip()]
    return found


def configure_runtime(
    state: StateTracker,
    num_processes: int,
    is_main_process: bool,
    output_dir: Path,
    *,
    accumulation: Mapping[str, Any],
) -> dict[str, Any]:
    """Apply hints and record the decisions; returns what was recorded.

    ``accumulation``: the ``state_dict`` of the accumulation policy the trainer built for this
    run, recorded as it is.

    ``decided["managed_memory"]`` is the run's
    :class:`~simpletuner.gh200.managed_memory.ManagedMemoryPlan` (``all`` starts routing every CUDA
    allocation to the managed pool here, before the caches and the model are built).

    Raises:
        ValueError: the hint environment variables disagree, or ``gh200_optimizations.managed_memory``
            cannot run here (every reason at once); before anything is decided or written.
    """
    config = state.config
    override, setting = uvm_hint_decision(config, os.environ)  # before anything loads: a conflict stops here
    host = collect_host() if config.gh200_optimizations.managed_memory == "all" else {}
    managed = check_managed_memory(
        config,
        available_host_bytes=host.get("ram_available_bytes"),
        environ=os.environ,
        memory_only_numa_bytes=host.get("memory_only_numa_bytes", 0),
    )
    set_uvm_hint_override(override, setting)
    start_managed_memory(managed)
    active = gh200_uvm_enabled()
    if active:
        logger.info("GH200 unified-memory hints are on: %s", setting)  # off: uvm says why, once
    unified = unified_memory_status()
    problem = (unified["device"] or {}).get("problem")
    if problem:  # CUDA works but cuda-bindings cannot talk to the driver: the run goes on without the layer
        logger.warning("the GH200 unified-memory layer is off for this run: %s", problem)
    cache = config.cache_config
    decided: dict[str, Any] = {
        "uvm_hint_override": override,
        "uvm_hints_active": active,
        "uvm_hints_setting": setting,
        "unified_memory": unified,
        "vae_cache_type": cache.vae_cache_type,
        "text_cache_type": cache.text_cache_type,
        "vae_cache_type_in_use": cache_type_used(cache.vae_cache_type),  # what holds the entries, not the ask
        "text_cache_type_in_use": cache_type_used(cache.text_cache_type),
        "persistent_cache": cache.persistent_cache,
        "cache_dir": cache.cache_dir,
        "managed_memory": managed,
        "accumulation": dict(accumulation),
        "num_processes": num_processes,
    }
    state.set_gh200_runtime_config(decided)
    requests = gh200_layer_requests(config, os.environ)
    if not requests:  # an ordinary run: uvm's one DEBUG line ("hints are off: off by default") says it all
        return decided
    if is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / RUNTIME_FILE).write_bytes(orjson.dumps(decided, option=orjson.OPT_INDENT_2, default=str))
    return decided
