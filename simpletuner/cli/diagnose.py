"""``simpletuner diagnose`` (or ``python gh200_diagnostic.py`` in a checkout): what this machine offers
for unified-memory training, and what is missing.

The report is the machine's facts (:mod:`simpletuner.hardware`) and the GH200 checks
(:mod:`simpletuner.gh200.diagnostic`), printed as readable text or, with ``--json``, as one JSON
object. Exit codes: 0 report written and no verdict failed (verdicts that do not apply here, such as
the GPU ones on a machine without an NVIDIA GPU, do not fail), 1 the oversubscription test failed,
2 the oversubscription test was refused (discrete GPU, or more than the machine holds) or a flag
was wrong, 3 the report was written and at least one verdict failed (its ``[--]`` line names the fix).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from simpletuner.diskspace import format_gib
from simpletuner.gh200.diagnostic import (
    FORK_UVM_STATS,
    check_oversubscription,
    collect_environment,
    collect_pool,
    collect_versions,
    run_oversubscription,
    verdicts,
)
from simpletuner.hardware.host import collect_host
from simpletuner.hardware.machine import collect_device
from simpletuner.hardware.runtime import UnifiedMemoryRuntime, get_runtime


def collect_summary(runtime: UnifiedMemoryRuntime | None = None, environ=None) -> dict[str, Any]:
    """Everything the report shows, as one JSON-serialisable dict."""
    runtime = runtime or get_runtime()
    summary: dict[str, Any] = {
        "versions": collect_versions(runtime),
        "device": collect_device(runtime),
        "host": collect_host(),
        "environment": collect_environment(environ),
        "managed_pool": collect_pool(runtime),
    }
    summary["verdicts"] = verdicts(summary)
    return summary


def format_report(summary: dict) -> str:
    """The summary as readable text."""
    v, d, h, env = summary["versions"], summary["device"], summary["host"], summary["environment"]
    lines = [
        "== versions ==",
        f"torch {v.get('torch')}  CUDA build {v.get('cuda_build') or 'none'}  driver {v.get('driver') or 'none'}  "
        f"cuda-bindings {v.get('cuda_bindings') or 'not installed'}",
    ]
    lines += [f"missing: {m['what']} -> {m['fix']}" for m in v["missing"]]
    lines.append("== device ==")
    if d is None:
        lines.append("no CUDA device")
    else:
        lines += [
            f"{d['name']}  sm_{d['compute_capability'][0]}{d['compute_capability'][1]}  "
            f"total {format_gib(d['total_bytes'])}  free {format_gib(d['free_bytes'])}",
            f"managed memory {d['managed_memory']}  concurrent managed access {d['concurrent_managed_access']}  "
            f"pageable memory access {d['pageable_memory_access']}  uses host page tables "
            f"{d['pageable_uses_host_page_tables']}  integrated {d['integrated']}",
            f"kind: {d['kind']}  (unified: {d['unified']})",
        ]
    lines += [
        "== host ==",
        f"CPUs {h['cpu_count']} (usable {h['cpu_affinity'] if h['cpu_affinity'] is not None else 'unknown'})  "
        f"RAM total {format_gib(h['ram_total_bytes'])}  available {format_gib(h['ram_available_bytes'])}",
        "== environment ==",
    ]
    lines += [f"{name}={value if value is not None else '(unset)'}" for name, value in env["variables"].items()]
    lines += [f"warning: {w}" for w in env["warnings"]]
    pool = summary["managed_pool"]
    lines += ["== managed pool ==", pool["status"] + (f"  {pool['stats']}" if pool["stats"] else "")]
    lines.append(f"note: {FORK_UVM_STATS}")
    over = summary.get("oversubscription")
    if over is not None:
        lines.append("== oversubscription ==")
        if over["status"] == "ok":
            lines.append(
                f"{format_gib(over['requested_bytes'])} in {over['num_chunks']} chunk(s) "
                f"({over['scale']} x device memory): prefetch to GPU {over['gb_per_s']['to_gpu']:.1f} GB/s, "
                f"to CPU {over['gb_per_s']['to_cpu']:.1f} GB/s"
            )
        else:
            lines.append(f"{over['status']}: {over['reason']}")
    lines.append("== verdict ==")
    for item in summary["verdicts"]:
        mark = {"ok": "ok", "failed": "--", "advice": "tip"}.get(item.get("status"), "n/a")
        lines.append(f"[{mark}] {item['what']}" + ("" if item["ready"] else f" -> {item['fix']}"))
    return "\n".join(lines)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0 (a multiple of device memory, e.g. 1.5), not {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The diagnostic's options (``simpletuner diagnose``, ``python gh200_diagnostic.py``)."""
    parser.description = "What this machine offers for GH200 / GB10 unified-memory training, and what is missing."
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object only")
    parser.add_argument(
        "--oversubscription-scale",
        type=_positive_float,
        metavar="S",
        help="allocate S x device memory as managed memory, prefetch it both ways and report GB/s "
        "(unified memory only)",
    )
    parser.add_argument(
        "--force", action="store_true", help="run the oversubscription test on a discrete GPU too (can hang it)"
    )


def build_parser(prog: str = "gh200_diagnostic.py") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = "gh200_diagnostic.py") -> int:
    """``python gh200_diagnostic.py ARGV`` (``prog`` names it); returns the exit code."""
    return run(build_parser(prog).parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """The diagnostic behind both ``python gh200_diagnostic.py`` and ``simpletuner diagnose``; returns the exit code."""
    runtime = get_runtime()
    code = 0
    over = None
    if args.oversubscription_scale is not None:
        over, warnings = check_oversubscription(runtime, args.oversubscription_scale, args.force, collect_host())
        for warning in warnings:
            print(warning, file=sys.stderr)
        if over is None:
            print(f"oversubscription test: {args.oversubscription_scale} x device memory ...", file=sys.stderr)
            try:
                over = run_oversubscription(runtime, args.oversubscription_scale)
            except RuntimeError as exc:  # CUDA / out-of-memory errors: report them, the memory is already freed
                over, code = {"status": "failed", "reason": str(exc)}, 1
        elif over["status"] == "refused":
            print(over["reason"], file=sys.stderr)
            code = 2
    summary = collect_summary(runtime)
    if over is not None:
        summary["oversubscription"] = over
    print(json.dumps(summary, indent=2) if args.json else format_report(summary))
    if code == 0 and any(item["status"] == "failed" for item in summary["verdicts"]):
        code = 3  # scripts can tell "this machine is not ready" from "report written"
    return code
