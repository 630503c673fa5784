#!/usr/bin/env bash
# The GPU performance check: MFU through the real trainer, and `simpletuner estimate` against
# `estimate --profile`, on the generated mid-size SD-1.5-like model, in at most 8 minutes of command
# time on one H100 or H200 from the GPU machines' bare image (the second half of GPU-REVIEW section 3).
#
#   scripts/gpu_truth_perf.sh [--out DIR] [--no-install]
#
# Same conventions as scripts/gpu_truth.sh. Steps, each under its own `timeout`; the limits sum to 480 s:
#   install 40 + versions 20 + estimate_vs_profile 245 + mfu 175 = 480
#  1 install              .whl/*.whl into python3 (--no-index --no-deps), then import what they provide
#  2 versions             versions and device attributes (scripts/gpu_probe.py --env)
#  3 estimate_vs_profile  scripts/gpu_check.py --checks estimate_vs_profile: writes the mid-size model,
#                         then the estimate and the measured peak of 3 profiled steps
#  4 mfu                  scripts/gpu_check.py --checks mfu: the same model (not written again), 8 steps
#                         of the real trainer in bf16, medians of MFU, TFLOPS, samples/s, step time
#
# Every step appends one JSON line to DIR/perf.jsonl as it ends (DIR: --out, else $OUT, else
# gpu_truth_out/); also there: perf.log, estimate_check.json, mfu_check.json. Without CUDA
# steps 3-4 are "skipped" with "no CUDA: <why>". Exit code: 0 no step failed, 1 a step failed.
set -uo pipefail

LIMIT_install=40
LIMIT_versions=20
LIMIT_estimate_vs_profile=245
LIMIT_mfu=175

# shellcheck source=scripts/gpu_truth_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_truth_common.sh"
truth_init perf "${BASH_SOURCE[0]}" "$@"

step_install "$LIMIT_install"
step_versions "$LIMIT_versions"
# Both share $WORK/gpu_check, so the second finds the model the first wrote.
gpu_check_step estimate_vs_profile "$LIMIT_estimate_vs_profile" estimate_check --checks estimate_vs_profile
gpu_check_step mfu "$LIMIT_mfu" mfu_check --checks mfu

echo "gpu_truth_perf: done, $(grep -c '"status": "failed"' "$JSONL" 2>/dev/null || true) failed line(s) in $JSONL"
exit "$FAILED"
