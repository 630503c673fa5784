#!/usr/bin/env bash
# The GPU truth check: what a first GPU says about simpletuner's CUDA paths, in at most 8 minutes of
# command time on one H100 or H200 from the GPU machines' bare image (GPU-REVIEW section 3).
#
#   scripts/gpu_truth.sh [--out DIR] [--no-install]
#
# Run from the repo root, with .whl/ made by scripts/gpu_wheels.sh beside it. Steps, each under its
# own `timeout`; the limits sum to 480 s:
#   install 40 + versions 20 + probe 135 + diagnostic 25 + gpu_tests 85 + managed_modes 175 = 480
#  1 install        .whl/*.whl into python3 (--no-index --no-deps), then import what they provide
#  2 versions       torch / CUDA / cuda-bindings / driver versions, the PyTorch APIs used, device attributes
#  3 probe          scripts/gpu_probe.py: caches path, error path, routing on every thread, end_routing,
#                   bound / OOM / empty_cache with and without the `all` allocator settings, the
#                   cross-stream leak, eviction of managed pages, frozen_weights numerics
#  4 diagnostic     gh200_diagnostic.py --json (never --force)
#  5 gpu_tests      the gpu-marked tests of the four files that have them (-n 0)
#  6 managed_modes  caches / frozen_weights / all through scripts/gpu_check.py at 0.15 x HBM
#
# Every step appends one JSON line {"step", "status": passed|failed|skipped, "seconds", "reason",
# "detail"} to DIR/truth.jsonl as it ends, so a run cut off still reports. DIR: --out, else $OUT,
# else gpu_truth_out/. Also there: truth.log (every step's output), probe.jsonl (one line per probe
# case), diagnostic.json, modes_check.json: 5 files, none deeper than DIR. A GPU step on a machine
# without CUDA is "skipped" with "no CUDA: <why>". Managed memory stays far below free HBM.
# Exit code: 0 no step failed, 1 a step failed.
set -uo pipefail

LIMIT_install=40
LIMIT_versions=20
LIMIT_probe=135
LIMIT_diagnostic=25
LIMIT_gpu_tests=85
LIMIT_managed_modes=175
GPU_TEST_FILES=(tests/test_gh200_runtime.py tests/test_gh200_batch_hook.py tests/test_gh200_diagnostic.py
    tests/test_memory_cli.py)

# shellcheck source=scripts/gpu_truth_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_truth_common.sh"
truth_init truth "${BASH_SOURCE[0]}" "$@"

step_install "$LIMIT_install"
step_versions "$LIMIT_versions"

# 3: the probe; every case's line is in probe.jsonl as soon as it ends
start=$(now)
run_step probe "$LIMIT_probe" python3 scripts/gpu_probe.py --out "$OUT_DIR/probe.jsonl" \
    --budget-s $((LIMIT_probe - 10))
summary="$(python3 - "$WORK/probe.out" <<'EOF'
import json, sys
lines = [json.loads(t) for t in open(sys.argv[1]) if t.startswith("{")]
skipped = [x for x in lines if "skipped" in x]
print(json.dumps({
    "cases": len(lines),
    "errors": [x["case"] for x in lines if "error" in x],
    "skipped": [x["case"] for x in skipped],
    "all_skipped": bool(lines) and len(skipped) == len(lines),
    "skip_reason": skipped[0]["skipped"] if skipped else None,
}))
EOF
)"
if [ "$RC" -eq 0 ] && [[ "$summary" == *'"all_skipped": true'* ]]; then
    reason="$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["skip_reason"])' "$summary")"
    record probe skipped "$start" "$reason" "$summary"
elif [ "$RC" -eq 0 ]; then
    record probe passed "$start" "" "$summary"
elif [ "$RC" -eq 1 ]; then
    record probe failed "$start" "a case ended in error (see probe.jsonl)" "$summary"
else
    failed_rc probe "$start"
fi

# 4: the diagnostic end to end with the real runtime (exit 3: a verdict failed)
start=$(now)
run_step diagnostic "$LIMIT_diagnostic" python3 gh200_diagnostic.py --json
cp "$WORK/diagnostic.out" "$OUT_DIR/diagnostic.json"
verdicts="$(python3 - "$WORK/diagnostic.out" <<'EOF' 2>/dev/null
import json, sys
data = json.load(open(sys.argv[1]))
print(json.dumps({"versions": data.get("versions"), "verdicts": [f"[{v['status']}] {v['what']}" for v in data["verdicts"]]}))
EOF
)"
if [ "$RC" -eq 0 ] && [ -n "$NO_CUDA" ]; then
    record diagnostic skipped "$start" "$NO_CUDA (the diagnostic ran: exit code 0)" "$verdicts"
elif [ "$RC" -eq 0 ]; then
    record diagnostic passed "$start" "" "$verdicts"
elif [ "$RC" -eq 3 ] && [ -n "$verdicts" ]; then
    record diagnostic failed "$start" "a verdict failed (exit code 3)" "$verdicts"
else
    failed_rc diagnostic "$start"
fi

# 5: the gpu-marked tests of these files only (others import packages the image lacks)
start=$(now)
run_step gpu_tests "$LIMIT_gpu_tests" python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu "${GPU_TEST_FILES[@]}"
counts="$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$WORK/gpu_tests.out" | tail -n 1)"
if [ "$RC" -eq 0 ] && [[ "$counts" != *passed* ]] && [[ "$counts" == *skipped* ]]; then
    record gpu_tests skipped "$start" "${NO_CUDA:-no CUDA}: every gpu test skipped itself" "$counts"
elif [ "$RC" -eq 0 ]; then
    record gpu_tests passed "$start" "" "$counts"
else
    failed_rc gpu_tests "$start"
fi

# 6: the three managed-memory modes through the real worker, frozen weights of 0.15 x HBM
gpu_check_step managed_modes "$LIMIT_managed_modes" modes_check --checks managed_modes --hbm-fraction 0.15

echo "gpu_truth: done, $(grep -c '"status": "failed"' "$JSONL" 2>/dev/null || true) failed line(s) in $JSONL"
exit "$FAILED"
