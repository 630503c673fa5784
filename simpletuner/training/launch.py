"""Launch checks and start-up helpers of a run: the process count Accelerate joined against what
the launcher promised, the Accelerator's construction, values shared between ranks, and a clock for
the start-up phases. (Accelerate's process-wide precision state is reset by
:func:`simpletuner.precision.reset_accelerate_state`.)"""

from __future__ import annotations

import time
from pathlib import Path


class LaunchError(RuntimeError):
    """The launch does not match the processes Accelerate joined."""


_CPU_FIX = (
    "On CPU launch with `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N --num_machines 1 "
    "--mixed_precision no --dynamo_backend no simpletuner/train.py ...`."
)


def check_launch_matches(num_processes: int, env) -> None:
    """Raise when the launch environment promises more processes than Accelerate has joined:
    each process would otherwise train the whole run on its own (or one would do all the work)."""
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


class PhaseClock:
    """Seconds spent in each named phase of start-up."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._last
        self._last = now


def from_main_process(accelerator, value):
    """``value`` as rank 0 has it, on every rank (one object collective when there are several).

    How every process of a launch comes to the same decision about something only rank 0 checked
    (a lock, a full disk): each then acts on it the same way, and none is left waiting in a
    collective for a rank that gave up."""
    if accelerator.num_processes <= 1:
        return value
    from accelerate.utils import broadcast_object_list

    return broadcast_object_list([value], from_process=0)[0]


def from_every_process(accelerator, value) -> list:
    """Every rank's ``value``, in rank order, on every rank."""
    if accelerator.num_processes <= 1:
        return [value]
    from accelerate.utils import gather_object

    return gather_object([value])


def make_accelerator(mixed_precision: str, report_to: str, output_dir: Path, find_unused_parameters: bool):
    """The run's Accelerator. Every setting the launcher could also make is passed explicitly: the
    config already holds the launcher's value or stopped on a conflict (configuration/launcher.py).
    The trainer owns accumulation (an Accelerate count > 1 would divide every loss) and compiling
    (enable_compile), so Accelerate's are pinned off. ``find_unused_parameters``: a model whose
    micro-batch may reach only part of it (one Wan 2.2 expert) needs DDP to look for unused ones."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, GradientAccumulationPlugin, ProjectConfiguration

    has_cuda = torch.cuda.is_available()
    if mixed_precision == "fp16" and not has_cuda:
        raise ValueError("mixed_precision 'fp16' needs a CUDA GPU; use 'bf16' or 'no' on this machine")
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True)] if find_unused_parameters else []
    return Accelerator(
        cpu=not has_cuda,
        kwargs_handlers=handlers,
        mixed_precision=mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1),
        dynamo_backend="no",
        log_with=None if report_to == "none" else report_to,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(Path(output_dir) / "logs")),
    )
