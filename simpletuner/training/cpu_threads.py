"""How many threads torch uses for CPU work, chosen so that a CPU run does not oversubscribe its machine.

torch starts one intra-op thread per core; on a busy machine they wait for each other at every parallel
region and a step slows down many times over. So a CPU run takes the idle cores it may use, shared among
its processes on this machine, at least one (:func:`choose_num_threads`), unless ``num_cpu_threads`` or an
``OMP_NUM_THREADS`` the user set says otherwise; a CUDA run keeps torch's default. The probes are arguments,
so tests pass their own. Order and figures: documentation/PERFORMANCE.md, "Issue 29: CPU threads".
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Literal, Mapping

from simpletuner.configuration.launcher import find_launcher

THREADS_VAR = "OMP_NUM_THREADS"
#: cgroup v2: "QUOTA PERIOD" (microseconds), or "max PERIOD" without a limit.
CPU_MAX_PATH = "/sys/fs/cgroup/cpu.max"
#: Where launchers say how many processes of the run share this machine.
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE")
_LAUNCH_FLAG = "--num_cpu_threads_per_process"


@dataclass(frozen=True)
class CpuThreads:
    """The decision: ``num_threads`` for torch (None: torch's own count, left alone), the start-up
    log line that says why, and the level it is logged at."""

    num_threads: int | None
    line: str
    level: int = logging.INFO


def choose_num_threads(
    num_usable_cores: int, num_local_processes: int, load_average: float, num_cores: int | None = None
) -> tuple[int, str]:
    """Threads for each of ``num_local_processes`` processes sharing ``num_usable_cores`` cores, at a
    1-minute ``load_average`` of the whole machine (``num_cores`` of them; default: the usable ones).

    The load is taken as spread evenly over the machine's cores; the cores left idle on ours are split
    among the processes and rounded to the nearest whole thread, at least 1 and at most an even share of
    the usable cores. The run's own start-up counts in the load too, which errs toward fewer threads.
    Returns the count and the sentence that explains it.
    """
    usable = max(1, num_usable_cores)
    processes = max(1, num_local_processes)
    cores = max(usable, num_cores or usable)
    busy = min(max(load_average, 0.0), cores) * usable / cores
    idle = usable - busy
    share = max(1, usable // processes)
    threads = max(1, min(share, int(idle / processes + 0.5)))
    who = "this process" if processes == 1 else f"each of the run's {processes} processes on this machine"
    why = (
        f"{usable} core(s) usable, load average {load_average:.2f} over the last minute"
        f"{'' if cores == usable else f' on {cores} cores'}: about {idle:.1f} idle, shared by {who}"
    )
    return threads, why


def cgroup_cpu_limit(path: str = CPU_MAX_PATH) -> float | None:
    """This process's cgroup CPU quota in cores (cgroup v2 ``cpu.max``); None without one or where unreadable."""
    try:
        with open(path, encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        return int(quota) / int(period)
    except (OSError, ValueError):  # no such file, "max", or an odd line
        return None


def usable_cores(affinity: int | None = None, quota: float | None = None) -> int:
    """Cores this process may run on: its CPU affinity, capped by its cgroup quota (whole cores, at least 1).
    ``affinity`` / ``quota``: None reads them from the system."""
    if affinity is None:
        try:
            affinity = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            affinity = os.cpu_count() or 1
    quota = cgroup_cpu_limit() if quota is None else quota
    return max(1, min(affinity, int(quota)) if quota else affinity)


def local_processes(environ: Mapping[str, str]) -> int:
    """Processes of this run on this machine, as the launcher says (1 without a launcher)."""
    for var in LOCAL_SIZE_VARS:
        try:
            return max(1, int(environ[var]))
        except (KeyError, ValueError):
            continue
    return 1


def _read_environ(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    pairs = (part.decode(errors="replace").partition("=") for part in raw.split(b"\0") if part)
    return {key: value for key, _, value in pairs}


def user_thread_request(
    environ: Mapping[str, str],
    launcher: tuple[int, list[str]] | None | Literal["auto"] = "auto",
    read_environ: Callable[[int], Mapping[str, str] | None] = _read_environ,
) -> tuple[str, str] | None:
    """``(OMP_NUM_THREADS, where it came from)`` when the user set it; None when it is unset or is the
    value ``accelerate launch`` writes for every launch when it was told nothing (one thread, or one per
    physical core and process with ``--cpu``). ``launcher``: the ``accelerate launch`` above this process as
    ``(pid, arguments)`` ("auto": looked up; None: none). Where the launcher's own environment cannot be
    read, a value that is set counts as the user's."""
    value = environ.get(THREADS_VAR)
    if not value:
        return None
    found = find_launcher() if isinstance(launcher, str) else launcher
    if found is None:
        return value, f"{THREADS_VAR}={value} in the environment"
    pid, args = found
    if any(arg == _LAUNCH_FLAG or arg.startswith(_LAUNCH_FLAG + "=") for arg in args):
        return value, f"`accelerate launch {_LAUNCH_FLAG} {value}`"
    launcher_environ = read_environ(pid)
    if launcher_environ is None or launcher_environ.get(THREADS_VAR):
        return value, f"{THREADS_VAR}={value} in the environment"
    return None


def decide_cpu_threads(
    setting: int | None,
    *,
    is_cuda: bool,
    environ: Mapping[str, str],
    request: tuple[str, str] | None,
    load_average: float,
    num_usable_cores: int,
    num_cores: int,
) -> CpuThreads:
    """The thread count and its log line, from the config's ``num_cpu_threads`` (``setting``), the user's
    ``OMP_NUM_THREADS`` (``request``, :func:`user_thread_request`) and the machine (see the module doc)."""
    auto, why = choose_num_threads(num_usable_cores, local_processes(environ), load_average, num_cores)
    load = f"load average {load_average:.2f} over the last minute"
    if setting is not None:
        beside = f"; it overrides {request[1]}" if request is not None else ""
        return CpuThreads(setting, f"CPU threads: {setting}, from num_cpu_threads in the config{beside} ({load})")
    if request is not None:
        value, where = request
        count = int(value) if value.isdigit() and int(value) > 0 else None
        hint = (
            f"; at this load the run would choose {auto}" if count is not None and count > auto and not is_cuda else ""
        )
        left = "" if count is not None else ", left to torch"
        return CpuThreads(
            count, f"CPU threads: {value}, from {where}{left} ({load}{hint}; num_cpu_threads overrides it)"
        )
    if is_cuda:
        return CpuThreads(
            None,
            f"CPU threads: torch's default, a CUDA run ({load}; set num_cpu_threads or OMP_NUM_THREADS to choose)",
            logging.DEBUG,
        )
    return CpuThreads(
        auto,
        f"CPU threads: {auto}, chosen for this CPU run: {why} (set num_cpu_threads in the config, or "
        f"{THREADS_VAR}, to choose)",
    )


def apply_cpu_threads(choice: CpuThreads) -> None:
    """Give torch ``choice.num_threads`` intra-op threads, and as many inter-op threads where torch still
    allows it (only before its first inter-op work, once per process)."""
    if choice.num_threads is None:
        return
    import torch

    torch.set_num_threads(choice.num_threads)
    try:
        torch.set_num_interop_threads(choice.num_threads)
    except RuntimeError:  # already started or set: those threads stay as they are
        pass


def settle_cpu_threads(setting: int | None, is_cuda: bool, environ: Mapping[str, str] = os.environ) -> CpuThreads:
    """Decide from this machine and process (:func:`decide_cpu_threads`), apply, and return the decision."""
    try:
        load_average = os.getloadavg()[0]
    except OSError:  # no load average here: judge the cores alone
        load_average = 0.0
    choice = decide_cpu_threads(
        setting,
        is_cuda=is_cuda,
        environ=environ,
        request=user_thread_request(environ),
        load_average=load_average,
        num_usable_cores=usable_cores(),
        num_cores=os.cpu_count() or 1,
    )
    apply_cpu_threads(choice)
    return choice
