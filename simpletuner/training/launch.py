"""Launch checks and start-up helpers of a run: the process count Accelerate joined against what
the launcher promised, every rank holding the same config and seeing one output_dir, the Accelerator's
construction. (The start-up phases: :mod:`simpletuner.startup`; values shared between ranks: :mod:`simpletuner.ranks`;
Accelerate's process-wide precision state is reset by :func:`simpletuner.precision.reset_accelerate_state`.)"""

from __future__ import annotations

import logging
from pathlib import Path

import orjson

from simpletuner.configuration.errors import ConfigError
from simpletuner.ranks import from_every_process, probe_shared_folder

logger = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """The launch does not match the processes Accelerate joined."""


_CPU_FIX = (
    "On CPU launch with `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N --num_machines 1 "
    "--mixed_precision no --dynamo_backend no simpletuner/train.py ...`."
)


def launch_request(launch_args, env) -> tuple[int, int]:
    """``(num_processes, num_machines)`` the ``accelerate launch`` arguments ``launch_args`` (or its
    config file) ask for, 1 where they say nothing or do not parse."""
    from accelerate.commands.launch import launch_command_parser

    from simpletuner.configuration.launcher import parse_launch_command

    command = parse_launch_command(launch_args, env)
    try:
        parsed = launch_command_parser().parse_args(list(launch_args))
    except SystemExit:
        return 1, 1
    values = command.file_values if command is not None else {}

    def asked(name: str) -> int:
        value = getattr(parsed, name, None)
        value = values.get(name) if value is None else value
        if value is None:
            return 1
        try:
            return max(int(value), 1)
        except (TypeError, ValueError):
            return 1

    return asked("num_processes"), asked("num_machines")


def check_launch_matches(num_processes: int, env, launch_args="auto") -> None:
    """Raise when the launch environment promises more processes than Accelerate has joined:
    each process would otherwise train the whole run on its own (or one would do all the work).

    ``launch_args``: the arguments of the ``accelerate launch`` above this process ("auto": read
    from /proc; None: none). Without ``--multi_gpu`` (or ``distributed_type: MULTI_GPU``) a launch on
    a machine with one GPU or none starts each machine's process alone, whatever ``--num_processes``
    and ``--num_machines`` say."""
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if env.get(var) and int(env[var]) != num_processes:
            raise LaunchError(
                f"the launcher set {var}={env[var]} but Accelerate joined {num_processes} process(es): each process "
                f"would train the whole run on its own. {_CPU_FIX}"
            )
    if (
        num_processes == 1
        and "WORLD_SIZE" not in env
        and env.get("MASTER_ADDR")
        and env.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
    ):
        raise LaunchError(
            "`accelerate launch --cpu --num_processes N` starts ONE process unless MPI is set up (MASTER_ADDR is set "
            f"but no WORLD_SIZE), so the run would not be distributed. {_CPU_FIX} For one process drop --num_processes."
        )
    if num_processes == 1 and "WORLD_SIZE" not in env:
        if launch_args == "auto":
            from simpletuner.configuration.launcher import find_launch_command

            launch_args = find_launch_command()
        processes, machines = launch_request(launch_args, env) if launch_args is not None else (1, 1)
        if processes > 1 or machines > 1:
            raise LaunchError(
                f"`accelerate launch` was asked for {processes} process(es) on {machines} machine(s) but started this "
                "one alone: it starts a distributed launch only with --multi_gpu (or `distributed_type: MULTI_GPU` in "
                "its config file) on a machine with fewer than two GPUs, so each machine would train the whole run on "
                "its own. Add --multi_gpu to the `accelerate launch` of every machine (also with one GPU per machine)."
            )


class ConfigMismatch(ConfigError):
    """The processes of one launch were started with different configs (a node joined with another
    file, other ``--set`` overrides or other launch flags). Raised on every rank, with the same
    message: rank 0 prints it (a ConfigError, as train.py handles it), every rank exits 2."""

    def __init__(self, message: str, problems: list[str]):
        ValueError.__init__(self, message)
        self.problems = problems
        self.source = None


#: Config keys whose values a mismatch message leaves out (it names them only): a value there may be a secret.
_SECRET_WORDS = ("secret", "token", "password", "credential", "access_key", "api_key")
#: How many differing keys a mismatch message names per group of ranks, and how long a shown value may be.
_MAX_KEYS, _MAX_VALUE = 12, 80


def flatten_config(value, prefix: str = "") -> dict[str, str]:
    """``{dotted path: canonical JSON of the leaf}`` (``datasets[0].crop``), dicts and lists recursed into."""
    if isinstance(value, dict):
        if not value:
            return {prefix: "{}"}
        out: dict[str, str] = {}
        for key, item in value.items():
            out.update(flatten_config(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, (list, tuple)):
        if not value:
            return {prefix: "[]"}
        out = {}
        for index, item in enumerate(value):
            out.update(flatten_config(item, f"{prefix}[{index}]"))
        return out
    return {prefix: orjson.dumps(value, option=orjson.OPT_SORT_KEYS, default=str).decode()}


def _shown(path: str, flat: dict[str, str]) -> str:
    if path not in flat:
        return "not set"
    if any(word in path.rsplit(".", 1)[-1].lower() for word in _SECRET_WORDS):
        return "<hidden>"
    text = flat[path]
    return text if len(text) <= _MAX_VALUE else text[: _MAX_VALUE - 3] + "..."


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def describe_config_differences(configs: list[dict[str, str]], hosts: list[str]) -> list[str]:
    """One line per group of ranks whose flattened config (``flatten_config``) differs from rank 0's: the
    ranks, their hosts, and each differing key with both values. Empty when every rank agrees."""
    reference = configs[0]
    groups: dict[tuple, list[int]] = {}
    for rank, flat in enumerate(configs[1:], start=1):
        if flat != reference:
            groups.setdefault(tuple(sorted(flat.items())), []).append(rank)
    lines = []
    for ranks in groups.values():
        flat = configs[ranks[0]]
        paths = sorted(p for p in reference.keys() | flat.keys() if reference.get(p) != flat.get(p))
        shown = [f"{p} (rank 0: {_shown(p, reference)}; {_ranks(ranks)}: {_shown(p, flat)})" for p in paths[:_MAX_KEYS]]
        if len(paths) > _MAX_KEYS:
            shown.append(f"and {len(paths) - _MAX_KEYS} more key(s)")
        where = ", ".join(sorted({hosts[r] for r in ranks}))
        lines.append(f"{_ranks(ranks)} (host {where}) differ from rank 0 (host {hosts[0]}) in: " + ", ".join(shown))
    return lines


def check_same_config(accelerator, config: dict) -> None:
    """Raise :class:`ConfigMismatch` on every rank when the ranks of this launch hold different configs.

    ``config``: the validated config as JSON values (``TrainingConfig.model_dump(mode="json")``), so
    the same value written two ways (``"1e-4"`` and ``0.0001``) is no difference, and what a
    ``data_backend_config`` file or a launch flag (``--mixed_precision``) put in is compared too.
    No key is exempt, paths included: output_dir takes files from every rank (each writes its RNG
    state into the checkpoint rank 0 completes), so it must be one folder at one path on every node;
    a node-local cache or model copy is given the same path on every node. Each rank sends its
    flattened config (a few KB) and host name once, before anything is written. Rank 0 prints the
    message (train.py); the first process of every other node logs it too, so each node's console
    says why it stopped."""
    if accelerator.num_processes <= 1:
        return
    import socket

    gathered = from_every_process(accelerator, (flatten_config(config), socket.gethostname()))
    lines = describe_config_differences([flat for flat, _ in gathered], [host for _, host in gathered])
    if not lines:
        return
    fix = (
        "start every node with the same config: the same file contents (copy it, or read it from the shared "
        "filesystem), the same --set overrides and --preset, and the same `accelerate launch` flags apart from "
        "--machine_rank. Nothing was written."
    )
    message = (
        "the processes of this launch were started with different configs, so they would not train one run "
        "together:\n" + "\n".join(f"  - {line}" for line in lines) + f"\nFix: {fix}"
    )
    if accelerator.is_local_main_process and not accelerator.is_main_process:
        logger.error("%s", message)  # rank 0 prints it (train.py); this node's own console says it too
    raise ConfigMismatch(message, lines)


class OutputDirNotShared(ConfigError):
    """``output_dir`` is not one folder for every rank (a node-local disk at the same path): raised on
    every rank with the same message; rank 0 prints it, every rank exits 2."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        self.problems = [message]
        self.source = None


def check_shared_output_dir(accelerator, output_dir: Path) -> None:
    """Raise :class:`OutputDirNotShared` on every rank when some rank does not see ``output_dir`` as rank 0 does.

    Every rank writes its RNG state into each checkpoint rank 0 completes in ``output_dir``, so the
    folder must be on a filesystem all nodes mount at this path; otherwise the first checkpoint would
    fail, after the steps before it. Call after rank 0 has claimed (created) the folder."""
    if accelerator.num_processes <= 1:
        return
    failed, results = probe_shared_folder(accelerator, output_dir)
    if failed is not None:
        raise OutputDirNotShared(f"output_dir {output_dir}: rank 0 could not write a file there ({failed})")
    blind = [rank for rank, (ok, _) in enumerate(results) if not ok]
    if not blind:
        return
    hosts = ", ".join(sorted({results[r][1] for r in blind}))
    message = (
        f"output_dir {output_dir} is not one shared folder: {_ranks(blind)} (host {hosts}) cannot see the file rank 0 "
        f"(host {results[0][1]}) wrote there. Every rank writes its part of each checkpoint into output_dir and "
        "rank 0 completes it, so the first checkpoint would fail. Fix: put output_dir on a filesystem every node "
        f"mounts at {output_dir} (NFS, Lustre, ...), or set output_dir to a path on one that is."
    )
    if accelerator.is_local_main_process and not accelerator.is_main_process:
        logger.error("%s", message)  # rank 0 prints it (train.py); this node's own console says it too
    raise OutputDirNotShared(message)


def make_accelerator(mixed_precision: str, report_to: str, output_dir: Path, find_unused_parameters: bool):
    """The run's Accelerator. Every setting the launcher could also make is passed explicitly: the
    config already holds the launcher's value or stopped on a conflict (configuration/launcher.py).
    The trainer owns accumulation (an Accelerate count > 1 would divide every loss) and compiling
    (enable_compile), so Accelerate's are pinned off. ``find_unused_parameters``: a model whose
    micro-batch may reach only part of it (one Wan 2.2 expert) needs DDP to look for unused ones.
    A launch with ``distributed_type: FSDP`` gets FSDP2, also on CPU (training/sharded_state.py)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin, ProjectConfiguration

    from simpletuner.training.sharded_state import enable_fsdp, fsdp_requested, refuse_deepspeed

    refuse_deepspeed()  # before Accelerate starts a DeepSpeed engine
    has_cuda = torch.cuda.is_available()
    if mixed_precision == "fp16" and not has_cuda:
        raise ValueError("mixed_precision 'fp16' needs a CUDA GPU; use 'bf16' or 'no' on this machine")
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True)] if find_unused_parameters else []
    accelerator = Accelerator(
        cpu=not has_cuda,
        kwargs_handlers=handlers,
        mixed_precision=mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1),
        dynamo_backend="no",
        log_with=None if report_to == "none" else report_to,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(Path(output_dir) / "logs")),
    )
    if fsdp_requested():  # the launcher's accelerate config says distributed_type: FSDP
        enable_fsdp(accelerator)  # FSDP2 only; on CPU Accelerate would silently train DDP
    return accelerator


def check_launch(accelerator, config) -> None:
    """The checks of a launch before anything is written, the same on every rank: the launcher started as
    many processes as joined, an FSDP launch trains what FSDP can, and every node was given this config."""
    import os

    from simpletuner.training.sharded_state import check_fsdp_run

    check_launch_matches(accelerator.num_processes, os.environ)
    check_fsdp_run(config, accelerator)
    check_same_config(accelerator, config.model_dump(mode="json"))
