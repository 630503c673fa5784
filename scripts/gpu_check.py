"""Every check that needs a GPU, in one run: one JSON and one Markdown table (run it through
``scripts/gpu_check.sh``).

Checks (each recorded as name, status passed|failed|skipped|refused, seconds, figures, reason, command):

1. ``pytest -m gpu tests``: the gpu-marked tests.
2. ``gh200_diagnostic.py --json --oversubscription-scale S``: S = 1.25 on a unified device, bounded
   so that S x device memory <= 0.8 x what the machine can back; on a discrete GPU no ``--force``:
   the diagnostic's refusal is the expected result.
3. ``simpletuner estimate`` vs ``estimate --profile`` on a generated SD-1.5-like model (``bench_mfu.py``).
4. MFU: ``bench_mfu.py`` (real trainer, bf16) on the same model.
5. managed-memory modes caches / frozen_weights / all, each in its own process (``all`` routes the
   whole process): a stack of frozen Linear blocks of ``--hbm-fraction`` x HBM with a small trainable
   adapter per block, a few steps each. Managed memory is capped at 0.8 x what the machine can back
   and, on a discrete GPU, at 0.9 x the card's free memory; more than that is refused before allocating.

Every check has its own timeout inside an overall budget (``--quick``: 510 s, unmeasured on a GPU); results are
written after each check, so a run that is killed keeps what it measured. Exit code: 0 every check
passed, or was skipped / refused for a stated reason; 1 a check failed; 3 no CUDA device (nothing
measured; the JSON and Markdown still written, every check "skipped" with the reason).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The subprocesses (machine probe, one managed-memory mode each): the orchestrator never opens CUDA.
WORKERS = Path(__file__).resolve().with_name("gpu_check_workers.py")
GiB = 1 << 30
CHECKS = ("gpu_tests", "diagnostic", "estimate_vs_profile", "mfu", "managed_modes")
MODES = ("caches", "frozen_weights", "all")
UNIFIED_SCALE = 1.25  # the oversubscription scale and the default --hbm-fraction on GH200 / GB10
DISCRETE_FRACTION = 0.4  # the default --hbm-fraction on a discrete GPU
BACKABLE_SHARE = 0.8  # managed memory <= this share of what the machine can back
DISCRETE_FREE_SHARE = 0.9  # and, on a discrete GPU, <= this share of the card's free memory
#: Seconds per check (and per mode, per step count), and the overall budget, for each profile.
PROFILES = {
    "quick": {"gpu_tests": 150, "diagnostic": 90, "model": 120, "estimate": 60, "profile": 120, "mfu": 120,
              "mode": 70, "mfu_steps": 8, "mode_steps": 3, "budget": 510},
    "full": {"gpu_tests": 600, "diagnostic": 300, "model": 300, "estimate": 120, "profile": 300, "mfu": 600,
             "mode": 300, "mfu_steps": 30, "mode_steps": 10, "budget": 3600},
}  # fmt: skip


@dataclass
class CheckResult:
    """One check's outcome; ``figures`` are the scalars the table shows, ``details`` the rest."""

    name: str
    status: str  # passed | failed | skipped | refused
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    reason: str | None = None
    command: str | None = None
    details: dict = field(default_factory=dict)


# --- sizing: pure functions of what the device and the host report ---------------------------------
def default_fraction(info) -> float:
    """The frozen weights' size over HBM for the modes check: above 1 where managed memory can hold it."""
    return UNIFIED_SCALE if info.unified else DISCRETE_FRACTION


def all_mode_alloc_conf() -> str:
    """PYTORCH_CUDA_ALLOC_CONF for the ``all`` worker: what a training run in that mode adds."""
    from simpletuner.configuration.alloc_conf import format_alloc_conf
    from simpletuner.gh200.managed_memory import ALL_MODE_ALLOCATOR

    return format_alloc_conf(ALL_MODE_ALLOCATOR)


def managed_cap(
    info, free_bytes: int, available_host_bytes: int | None, memory_only_numa_bytes: int | None = None
) -> int | None:
    """The most managed memory this script allocates: 0.8 x what the machine can back (the GPU's memory
    counted once where it is a NUMA node of the host, ``memory_only_numa_bytes``; None: read this machine's),
    and on a discrete GPU at most 0.9 x the card's free memory; None when host memory is unknown."""
    from simpletuner.gh200.managed_memory import backable_bytes
    from simpletuner.hardware.host import hbm_in_host_memory
    from simpletuner.hardware.host import memory_only_numa_bytes as numa_bytes

    numa = numa_bytes() if memory_only_numa_bytes is None else memory_only_numa_bytes
    hbm_in_host = not info.integrated and hbm_in_host_memory(info.total_bytes, numa)
    backable = backable_bytes(info, free_bytes, available_host_bytes, hbm_in_host)
    if backable is None:
        return None
    cap = int(BACKABLE_SHARE * backable)
    return cap if info.unified else min(cap, int(DISCRETE_FREE_SHARE * free_bytes))


def diagnostic_scale(info, free_bytes: int, available_host_bytes: int | None) -> tuple[float | None, str]:
    """(scale for ``--oversubscription-scale``, what to expect: "run" | "refused" | the reason to skip).

    Discrete: 1.25 without ``--force``, so the diagnostic refuses. Unified: 1.25, lowered (to two
    decimals, down) so that scale x device memory <= 0.8 x what the machine can back."""
    if not info.unified:
        return UNIFIED_SCALE, "refused"
    cap = managed_cap(info, free_bytes, available_host_bytes)
    if cap is None:
        return None, "host memory unknown (MemAvailable unreadable): cannot bound the oversubscription test"
    scale = min(UNIFIED_SCALE, math.floor(100 * cap / info.total_bytes) / 100)
    if scale <= 0:
        return None, f"the machine can back only {cap / GiB:.1f} GiB of managed memory now"
    return scale, "run"


@dataclass(frozen=True)
class ModeSizing:
    """What one mode run allocates and expects: ``expect`` is "run", "oom" (caches with frozen
    weights bigger than the card: the expected outcome) or "refused" (with ``reason``)."""

    mode: str
    fraction: float
    model_bytes: int
    expect: str
    cap_bytes: int | None = None  # managed memory may not pass this (the ``all`` pool's bound)
    force: bool = False  # discrete GPU: the modes with managed memory run with consent
    reason: str | None = None
    oversubscription_ratio: float | None = None  # ``all``: the pool's bound over HBM (rounded down, <= cap)


def size_mode(mode: str, info, free_bytes: int, available_host_bytes: int | None, fraction: float) -> ModeSizing:
    """The model size and the bounds of one managed-memory mode run."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if not fraction > 0:
        raise ValueError(f"--hbm-fraction must be > 0, got {fraction}")
    model = int(fraction * info.total_bytes)
    base = {"mode": mode, "fraction": fraction, "model_bytes": model}
    if mode == "caches":  # frozen weights in plain GPU memory
        return ModeSizing(**base, expect="oom" if model >= free_bytes else "run")
    cap = managed_cap(info, free_bytes, available_host_bytes)
    force = not info.unified
    if cap is None:
        why = "host memory unknown (MemAvailable unreadable): managed memory cannot be bounded"
        return ModeSizing(**base, expect="refused", force=force, reason=why)
    if model > cap:
        where = "0.8 x available host memory" + ("" if info.integrated else " + free GPU memory")
        if not info.unified:
            where += ", and 0.9 x the card's free memory"
        why = (
            f"{model / GiB:.1f} GiB of frozen weights in managed memory is more than this machine may give it "
            f"({cap / GiB:.1f} GiB: {where}); lower --hbm-fraction"
        )
        return ModeSizing(**base, expect="refused", cap_bytes=cap, force=force, reason=why)
    # `all`: the pool holds the weights and everything else (activations, optimizer state): bounded at
    # the weights + one HBM's worth, never past the cap
    ratio = (
        math.floor(10_000 * min(cap, model + info.total_bytes) / info.total_bytes) / 10_000 if mode == "all" else None
    )
    return ModeSizing(**base, expect="run", cap_bytes=cap, force=force, oversubscription_ratio=ratio)


# --- rendering ---------------------------------------------------------------------------------------
def _cell(value) -> str:
    if isinstance(value, float):
        text = f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def key_figures(result: CheckResult) -> str:
    """The table's "key figures" cell: the figures as ``name value``, then the reason if any."""
    parts = [f"{k} {_cell(v)}" for k, v in result.figures.items() if v is not None]
    if result.reason:
        parts.append(_cell(result.reason))
    return "; ".join(parts) or "-"


def _gib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / GiB:.1f}"


def machine_line(machine: dict) -> str:
    device = machine.get("device") or {}
    versions = machine.get("versions") or {}
    host = machine.get("host") or {}
    gpu = (
        f"{device['name']}, {_gib(device.get('total_bytes'))} GiB, {device.get('kind')}"
        if device
        else f"no CUDA device ({machine.get('reason') or 'unknown'})"
    )
    return (
        f"{gpu}; driver {versions.get('driver')}, torch {versions.get('torch')}, CUDA build "
        f"{versions.get('cuda_build')}, cuda-bindings {versions.get('cuda_bindings')}; host RAM "
        f"{_gib(host.get('ram_total_bytes'))} GiB ({_gib(host.get('ram_available_bytes'))} available); "
        f"{machine.get('date')}; profile {machine.get('profile')}"
    )


def outcome_text(row: dict, with_step: bool = False) -> str:
    """A mode run's outcome in words: ran (OOM expected), OOM (expected), refused: why, timed out..."""
    outcome, expect = row.get("outcome", "?"), row.get("expect")
    if outcome == "ran":
        step = f" {row['step_s']:.3f} s/step" if with_step and row.get("step_s") is not None else ""
        return f"ran{step}" + (" (OOM was expected)" if expect == "oom" else "")
    if outcome == "oom":
        return "OOM (expected)" if expect == "oom" else "OOM (unexpected)"
    if outcome in ("refused", "error") and (row.get("reason") or row.get("error")):
        return f"{outcome}: {row.get('reason') or row.get('error')}"
    return str(outcome)


def mode_rows(results: list[CheckResult]) -> list[dict]:
    modes = next((r for r in results if r.name == "managed_modes"), None)
    return [] if modes is None else modes.details.get("modes", [])


def render_markdown(machine: dict, results: list[CheckResult]) -> str:
    """The check table and the per-mode table, ready to paste into documentation/PERFORMANCE.md."""
    lines = [f"Machine: {_cell(machine_line(machine))}", "", "| check | status | key figures |", "|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {key_figures(r)} |" for r in results]
    rows = mode_rows(results)
    if rows:
        lines += ["", "| mode | model GiB | step s | peak HBM GiB | pool GiB | outcome |", "|---|---|---|---|---|---|"]
        for row in rows:
            step = row.get("step_s")
            lines.append(
                f"| {row['mode']} | {_gib(row.get('model_bytes'))} | {'-' if step is None else f'{step:.3f}'} | "
                f"{_gib(row.get('peak_hbm_bytes'))} | {_gib(row.get('pool_bytes'))} | {_cell(outcome_text(row))} |"
            )
    return "\n".join(lines) + "\n"


def exit_code(machine: dict, results: list[CheckResult]) -> int:
    if not machine.get("cuda"):
        return 3
    return 1 if any(r.status == "failed" for r in results) else 0


def write_outputs(out: Path, machine: dict, results: list[CheckResult]) -> None:
    """gpu_check.json and gpu_check.md (temp file + rename: a kill never leaves half a file)."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine, "checks": [asdict(r) for r in results], "exit_code": exit_code(machine, results)}
    for name, text in (
        ("gpu_check.json", json.dumps(payload, indent=2, default=str)),
        ("gpu_check.md", render_markdown(machine, results)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


# --- running commands ---------------------------------------------------------------------------------
def last_json(text: str) -> dict | None:
    """The last JSON object in ``text`` that starts at the beginning of a line (logs may precede it)."""
    starts = [m.start() for m in re.finditer(r"(?m)^\{", text)]
    for start in reversed(starts):
        try:
            return json.loads(text[start:])
        except json.JSONDecodeError:
            continue
    return None


def run_process(cmd: list[str], timeout: float, log: Path, env: dict | None = None) -> tuple[int, str, float]:
    """Run ``cmd`` in its own process group (killed whole on timeout: rc 124); stderr to ``log``."""
    start = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            rc = 124
    return rc, out or "", time.perf_counter() - start


def parse_pytest(text: str) -> dict:
    """Counts from pytest's summary line ("3 passed, 1 skipped, 2 deselected in 4.2s")."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", text):
        key = "errors" if word.startswith("error") else word
        counts[key] = counts.get(key, 0) + int(number)
    return counts


# --- the checks ---------------------------------------------------------------------------------------
@dataclass
class Session:
    """One gpu_check run: where it writes, its profile and deadline, the machine, the results so far."""

    out: Path
    profile: dict
    deadline: float
    machine: dict
    fraction: float | None = None
    results: list[CheckResult] = field(default_factory=list)

    def record(self, result: CheckResult) -> CheckResult:
        """Add (or replace, by name) a result and rewrite both output files."""
        self.results = [r for r in self.results if r.name != result.name] + [result]
        write_outputs(self.out, self.machine, self.results)
        return result

    def call(self, name: str, cmd: list[str], seconds: float, env: dict | None = None) -> tuple[int, str, float] | None:
        """Run ``cmd`` with ``seconds`` or what is left of the budget; None when under 10 s are left."""
        timeout = min(seconds, self.deadline - time.monotonic())
        if timeout < 10:
            return None
        rc, out, took = run_process(cmd, timeout, self.out / f"{name}.log", env)
        (self.out / f"{name}.out").write_text(out)
        return rc, out, took


def _cmd(cmd: list[str]) -> str:
    return " ".join(cmd).replace(str(ROOT) + "/", "")


def _device_info(machine: dict):
    from dataclasses import fields

    from simpletuner.hardware.runtime import DeviceMemoryInfo

    d = machine["device"]
    values = {f.name: d[f.name] for f in fields(DeviceMemoryInfo)}
    return DeviceMemoryInfo(**{**values, "compute_capability": tuple(values["compute_capability"])})


def _failed_run(name: str, cmd: list[str], done, what: str, log: str | None = None, **figures) -> CheckResult:
    """The result of a command that gave no answer: skipped when the budget left no time to run it."""
    if done is None:
        return CheckResult(name, "skipped", figures=figures, reason="out of time budget", command=_cmd(cmd))
    why = "timed out" if done[0] == 124 else f"exit code {done[0]}"
    reason = f"{what} ({why}; see {log or name}.log)"
    return CheckResult(name, "failed", done[2], figures, reason, _cmd(cmd))


def check_gpu_tests(s: Session) -> CheckResult:
    # -n 0: one process (the suite's default is two xdist workers, which would share the GPU)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-m", "gpu", "tests"]
    done = s.call("gpu_tests", cmd, s.profile["gpu_tests"])
    if done is None:
        return CheckResult("gpu_tests", "skipped", reason="out of time budget", command=_cmd(cmd))
    rc, out, took = done
    counts = parse_pytest(out)
    counts.pop("deselected", None)
    status = "passed" if rc == 0 else "skipped" if rc == 5 else "failed"
    reason = {0: None, 5: "no gpu-marked tests collected", 124: "timed out"}.get(rc, f"pytest exit code {rc}")
    if status == "passed" and counts["passed"] == 0:
        status, reason = "skipped", "every gpu-marked test skipped itself (see gpu_tests.out)"
    return CheckResult("gpu_tests", status, took, counts, reason, _cmd(cmd), {"tail": out[-2000:]})


def check_diagnostic(s: Session) -> CheckResult:
    info = _device_info(s.machine)
    scale, expect = diagnostic_scale(info, s.machine["device"]["free_bytes"], s.machine["host"]["ram_available_bytes"])
    if scale is None:
        return CheckResult("diagnostic", "skipped", reason=expect)
    cmd = [sys.executable, str(ROOT / "gh200_diagnostic.py"), "--json", "--oversubscription-scale", str(scale)]
    done = s.call("diagnostic", cmd, s.profile["diagnostic"])
    if done is None:
        return CheckResult("diagnostic", "skipped", reason="out of time budget", command=_cmd(cmd))
    rc, out, took = done
    over = (last_json(out) or {}).get("oversubscription")
    if over is None:
        return _failed_run("diagnostic", cmd, done, "no oversubscription result")
    status = {"ok": "passed", "refused": "refused", "skipped": "skipped"}.get(over["status"], "failed")
    figures = {"scale": scale, "expected": expect}
    if over["status"] == "ok":
        figures.update(
            requested_gib=over["requested_bytes"] / GiB,
            to_gpu_gb_s=over["gb_per_s"]["to_gpu"],
            to_cpu_gb_s=over["gb_per_s"]["to_cpu"],
        )
    return CheckResult("diagnostic", status, took, figures, over.get("reason"), _cmd(cmd), {"oversubscription": over})


def prepare_model(s: Session) -> tuple[Path | None, str | None]:
    """The mid-size model, data and config for checks 3 and 4 (written once, under ``--out``)."""
    work = s.out / "model_work"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_mfu.py"), "--work", str(work), "--size", "mid", "--write-only"]
    done = s.call("prepare_model", cmd, s.profile["model"])
    if done is None:
        return None, "out of time budget"
    rc, out, _ = done
    written = last_json(out)
    if rc != 0 or not written:
        return None, f"writing the mid-size model failed (exit code {rc}; see prepare_model.log)"
    return Path(written["config"]), None


def check_estimate(s: Session, config: Path | None, why: str | None) -> CheckResult:
    if config is None:
        return CheckResult("estimate_vs_profile", "skipped", reason=why)
    base = [sys.executable, "-m", "simpletuner.cli", "estimate", "--config", str(config), "--json"]
    done = s.call("estimate", base, s.profile["estimate"])
    estimate = last_json(done[1]) if done else None
    if not estimate or "total_bytes" not in estimate:
        return _failed_run("estimate_vs_profile", base, done, "no estimate", log="estimate")
    total = estimate["total_bytes"]
    cmd = [*base, "--profile", "--profile-steps", "3"]
    done2 = s.call("profile", cmd, s.profile["profile"])
    profile = (last_json(done2[1]) or {}).get("profile") if done2 else None
    if not profile:
        failed = _failed_run(
            "estimate_vs_profile", cmd, done2, "no profile result", "profile", estimated_total_gib=total / GiB
        )
        failed.seconds += done[2]
        return failed
    took, reserved = done[2] + done2[2], profile["measured_reserved"]
    figures = {
        "estimated_total_gib": total / GiB,
        "measured_reserved_gib": reserved / GiB,
        "ratio": total / reserved if reserved else None,
        "measured_total_gib": None if profile.get("measured_total") is None else profile["measured_total"] / GiB,
    }
    return CheckResult("estimate_vs_profile", "passed", took, figures, None, _cmd(cmd), {"profile": profile})


def check_mfu(s: Session, config: Path | None, why: str | None) -> CheckResult:
    if config is None:
        return CheckResult("mfu", "skipped", reason=why)
    steps, timeout = s.profile["mfu_steps"], s.profile["mfu"]
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_mfu.py"), "--work", str(s.out / "model_work")]
    cmd += ["--config", str(config), "--steps", str(steps), "--warmup", "2", "--timeout", str(timeout - 10)]
    done = s.call("mfu", cmd, timeout)
    result = last_json(done[1]) if done else None
    if not result or result.get("status") != "ok":
        return _failed_run("mfu", cmd, done, "the MFU run failed")
    keys = ("mfu", "tflops", "samples_per_s", "step_time_s", "peak_memory_gib")
    return CheckResult("mfu", "passed", done[2], {k: result.get(k) for k in keys}, None, _cmd(cmd), result)


def mode_status(row: dict) -> str:
    """passed: ran, or ran out of memory where that is the expected outcome; refused; failed."""
    outcome = row.get("outcome")
    if outcome == "ran" or (outcome == "oom" and row.get("expect") == "oom"):
        return "passed"
    return outcome if outcome in ("refused", "skipped") else "failed"


def check_modes(s: Session) -> CheckResult:
    rows: list[dict] = []
    result = CheckResult("managed_modes", "skipped", details={"modes": rows})
    for mode in MODES:
        path = s.out / f"mode_{mode}.json"
        cmd = [sys.executable, str(WORKERS), mode, "--result", str(path)]
        cmd += ["--steps", str(s.profile["mode_steps"])]
        if s.fraction is not None:
            cmd += ["--hbm-fraction", str(s.fraction)]
        # `all` routes every allocation to a pool with its own allocator: expandable segments cannot apply there,
        # and it runs with the allocator settings a training run in that mode gets (ALL_MODE_ALLOCATOR)
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": all_mode_alloc_conf()} if mode == "all" else None
        path.unlink(missing_ok=True)
        done = s.call(f"mode_{mode}", cmd, s.profile["mode"], env)
        row = _read_row(path) or {"mode": mode}
        if done is None:
            row.setdefault("outcome", "skipped: out of time budget")
        elif done[0] != 0 and row.get("outcome") in (None, "running"):
            row["outcome"] = "timed out" if done[0] == 124 else f"error (exit code {done[0]}; see mode_{mode}.log)"
        row["status"] = "skipped" if done is None else mode_status(row)
        rows.append(row)
        result.seconds += done[2] if done else 0
        statuses = {r["status"] for r in rows}
        result.status = next((st for st in ("failed", "passed", "refused") if st in statuses), "skipped")
        result.figures = {r["mode"]: outcome_text(r, with_step=True) for r in rows}
        result.command = _cmd(cmd).replace(f"gpu_check_workers.py {mode}", "gpu_check_workers.py MODE")
        s.record(result)
    return result


def _read_row(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# --- main ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Every check that needs a GPU; one JSON and one Markdown table.")
    parser.add_argument("--out", default="gpu_check_out", help="output folder (default: gpu_check_out/)")
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--quick", dest="profile", action="store_const", const="quick", help="a 510 s budget (default)")
    speed.add_argument("--full", dest="profile", action="store_const", const="full", help="more steps, longer limits")
    parser.add_argument(
        "--hbm-fraction",
        type=float,
        metavar="F",
        help="frozen weights of the modes check, over HBM (default: 1.25 on GH200 / GB10, 0.4 on a discrete GPU)",
    )
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    parser.add_argument("--budget-s", type=float, help="overall seconds (default: the profile's)")
    parser.set_defaults(profile="quick")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.hbm_fraction is not None and not args.hbm_fraction > 0:
        raise SystemExit(f"--hbm-fraction must be > 0 (a share of GPU memory, e.g. 0.4), got {args.hbm_fraction}")
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise SystemExit(f"--checks: unknown {', '.join(unknown)}; known: {', '.join(CHECKS)}")
    profile = PROFILES[args.profile]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (args.budget_s or profile["budget"])
    rc, text, _ = run_process([sys.executable, str(WORKERS), "probe"], 60, out / "probe.log")
    machine = last_json(text) or {"cuda": False, "reason": f"the machine probe failed (exit code {rc}; see probe.log)"}
    machine.update(profile=args.profile, checks=checks)
    s = Session(out, profile, deadline, machine, args.hbm_fraction)
    if not machine.get("cuda"):
        for name in checks:
            s.record(CheckResult(name, "skipped", reason=f"no CUDA device: {machine.get('reason')}"))
        write_outputs(out, machine, s.results)
        print(f"gpu_check: no CUDA device ({machine.get('reason')}); nothing measured. Wrote {out}/gpu_check.md")
        return 3
    config, why = (None, None)
    if "estimate_vs_profile" in checks or "mfu" in checks:
        config, why = prepare_model(s)
    runners = {
        "gpu_tests": lambda: check_gpu_tests(s),
        "diagnostic": lambda: check_diagnostic(s),
        "estimate_vs_profile": lambda: check_estimate(s, config, why),
        "mfu": lambda: check_mfu(s, config, why),
        "managed_modes": lambda: check_modes(s),
    }
    for name in checks:
        print(f"gpu_check: {name} ...", flush=True)
        result = s.record(runners[name]())
        print(f"gpu_check: {name}: {result.status} {key_figures(result)}", flush=True)
    write_outputs(out, machine, s.results)
    print(f"gpu_check: wrote {out}/gpu_check.json and {out}/gpu_check.md")
    return exit_code(machine, s.results)


if __name__ == "__main__":
    sys.exit(main())
