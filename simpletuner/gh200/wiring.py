"""Turn ``cache_config`` and ``gh200_optimizations`` into one run's :class:`RuntimeDecisions`.

:func:`configure_runtime` runs once at the start of a run, after the trainer built its accumulation policy
(:mod:`simpletuner.training.accumulation`). It applies the unified-memory hint override (the process setting
``gh200/uvm.py`` reads), starts managed memory where ``gh200_optimizations.managed_memory`` asks for it, and, on
the main process of a run that configures the GH200 layer (:func:`gh200_layer_requests`), writes the decisions
to ``<output_dir>/gh200_runtime.json``. An ordinary run writes no file and logs one DEBUG line ("GH200
unified-memory hints are off: off by default").
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

import orjson

from simpletuner.gh200.managed_memory import ManagedMemoryPlan, check_managed_memory, start_managed_memory
from simpletuner.gh200.uvm import (
    ENV_ALIAS,
    ENV_VAR,
    cache_type_used,
    env_hint_request,
    gh200_uvm_enabled,
    set_uvm_hint_override,
    unified_memory_status,
)
from simpletuner.hardware.host import collect_host

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
    kinds = {"vae": cache.vae_cache_type, "text": cache.text_cache_type}
    unified = [f"{name}_cache_type" for name, kind in kinds.items() if kind == "unified_memory"]
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
    kinds = {"vae": cache.vae_cache_type, "text": cache.text_cache_type}
    found = [
        f"cache_config.{name}_cache_type={kind}" for name, kind in kinds.items() if kind in ("memory", "unified_memory")
    ]
    found += [
        f"datasets[{i}].type=in_memory"
        for i, dataset in enumerate(config.datasets or [])
        if dataset.type == "in_memory"
    ]
    if opts.enable_uvm_hints is not None:
        found.append(f"gh200_optimizations.enable_uvm_hints={str(opts.enable_uvm_hints).lower()}")
    if opts.enable_batch_size_rampup:
        found.append("gh200_optimizations.enable_batch_size_rampup=true")
    if opts.managed_memory != "caches":
        found.append(f"gh200_optimizations.managed_memory={opts.managed_memory}")
    found += [name for name in (ENV_VAR, ENV_ALIAS) if environ.get(name, "").strip()]
    return found


@dataclass(frozen=True)
class RuntimeDecisions:
    """What ``cache_config`` and ``gh200_optimizations`` come to in one run; the fields are
    ``gh200_runtime.json``'s keys (:meth:`as_record`)."""

    uvm_hint_override: bool | None  # hints forced on or off by a setting; None: nothing forces them
    uvm_hints_active: bool
    uvm_hints_setting: str  # the setting behind the hints' state, in words
    unified_memory: dict[str, Any]  # uvm.unified_memory_status()
    vae_cache_type: str  # what the config asks for
    text_cache_type: str
    vae_cache_type_in_use: str  # what holds the entries
    text_cache_type_in_use: str
    persistent_cache: bool
    cache_dir: str
    managed_memory: ManagedMemoryPlan
    accumulation: dict[str, Any]  # the accumulation policy's state_dict
    num_processes: int

    def as_record(self) -> dict[str, Any]:
        """The decisions by name, as ``gh200_runtime.json`` and the StateTracker keep them."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def configure_runtime(
    config,
    num_processes: int,
    is_main_process: bool,
    output_dir: Path,
    *,
    accumulation: Mapping[str, Any],
) -> RuntimeDecisions:
    """Apply hints and start managed memory; returns the decisions (written to ``gh200_runtime.json`` when
    the run configures the GH200 layer). ``accumulation``: the ``state_dict`` of the run's accumulation policy.
    ``managed_memory: all`` routes every CUDA allocation to the managed pool from here on (before the caches
    and the model are built): the caller ends it with :func:`~simpletuner.gh200.managed_memory.stop_managed_memory`.

    Raises:
        ValueError: the hint environment variables disagree, or ``gh200_optimizations.managed_memory``
            cannot run here (every reason at once); before anything is decided or written.
    """
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
    decisions = RuntimeDecisions(
        uvm_hint_override=override,
        uvm_hints_active=active,
        uvm_hints_setting=setting,
        unified_memory=unified,
        vae_cache_type=cache.vae_cache_type,
        text_cache_type=cache.text_cache_type,
        vae_cache_type_in_use=cache_type_used(cache.vae_cache_type),
        text_cache_type_in_use=cache_type_used(cache.text_cache_type),
        persistent_cache=cache.persistent_cache,
        cache_dir=cache.cache_dir,
        managed_memory=managed,
        accumulation=dict(accumulation),
        num_processes=num_processes,
    )
    if is_main_process and gh200_layer_requests(config, os.environ):  # an ordinary run: uvm's one DEBUG line says it
        output_dir.mkdir(parents=True, exist_ok=True)
        record = orjson.dumps(decisions.as_record(), option=orjson.OPT_INDENT_2, default=str)
        (output_dir / RUNTIME_FILE).write_bytes(record)
    return decisions
