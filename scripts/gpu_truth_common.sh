# Shared by scripts/gpu_truth.sh and scripts/gpu_truth_perf.sh (sourced, not run): arguments, the
# environment, one JSON line per step, running a step under its own `timeout`, and the install step.
# shellcheck shell=bash
# shellcheck disable=SC2034 # FAILED, NO_CUDA, RC: read by the scripts that source this file

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The modules the carried wheels provide (scripts/gpu_wheels.sh), imported once they are installed; not
# torch (seconds): diffusers is only found here, the later steps import it.
IMPORT_CHECK="import pydantic, orjson, lz4.frame, snappy, cramjam, simpletuner.configuration, importlib.util as u"
IMPORT_CHECK+="; assert u.find_spec('diffusers'), 'diffusers is not installed'"

# truth_init NAME SCRIPT ARGS...: parse --out DIR / --no-install / --help; set OUT_DIR, JSONL ($OUT_DIR/NAME.jsonl),
# LOG ($OUT_DIR/NAME.log, every step's output), WORK (scratch outside $OUT_DIR: the device tool brings back
# only 8 files); export the environment every step runs with; cd to the repo root.
truth_init() {
    local name=$1 script=$2
    shift 2
    NO_INSTALL=0
    OUT_DIR="${OUT:-gpu_truth_out}"
    while [ $# -gt 0 ]; do
        case "$1" in
        --out)
            OUT_DIR="${2:?--out needs a folder}"
            shift 2
            ;;
        --out=*)
            OUT_DIR="${1#--out=}"
            shift
            ;;
        --no-install)
            NO_INSTALL=1
            shift
            ;;
        -h | --help)
            sed -n '2,/^set -uo pipefail/p' "$script" | sed -e '$d' -e 's/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "$(basename "$script"): unknown argument '$1' (see --help)" >&2
            exit 2
            ;;
        esac
    done
    mkdir -p "$OUT_DIR" || exit 2
    OUT_DIR="$(cd "$OUT_DIR" && pwd)"
    JSONL="$OUT_DIR/$name.jsonl"
    LOG="$OUT_DIR/$name.log"
    WORK="$(mktemp -d "${TMPDIR:-/tmp}/$name.XXXXXX")" || exit 2
    # shellcheck disable=SC2064 # WORK is fixed now
    trap "rm -rf '$WORK'" EXIT
    cd "$ROOT" || exit 2
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    FAILED=0
    NO_CUDA=""
    echo "$(basename "$script"): writing $JSONL and $LOG (python3: $(command -v python3))"
}

now() { date +%s.%N; }

# record STEP STATUS START [REASON] [DETAIL]: one JSON line to stdout and $JSONL; DETAIL is JSON or text.
record() {
    local step=$1 status=$2 start=$3 reason=${4:-} detail=${5:-}
    if [ "$status" = failed ]; then FAILED=1; fi
    python3 - "$JSONL" "$step" "$status" "$start" "$reason" "$detail" <<'EOF' ||
import json, sys, time
path, step, status, start, reason, detail = sys.argv[1:7]
line = {"step": step, "status": status, "seconds": round(time.time() - float(start), 2)}
if reason:
    line["reason"] = reason
if detail:
    try:
        line["detail"] = json.loads(detail)
    except ValueError:
        line["detail"] = detail[-3000:]
text = json.dumps(line)
print(text, flush=True)
with open(path, "a") as sink:
    sink.write(text + "\n")
EOF
        printf '{"step": "%s", "status": "%s", "reason": "python3 could not write this line"}\n' "$step" "$status" |
        tee -a "$JSONL"
}

# run_step STEP LIMIT CMD...: CMD under `timeout LIMIT`, stdout to $WORK/STEP.out and stderr to
# $WORK/STEP.err, both then appended to $LOG; sets RC (124: timed out).
run_step() {
    local step=$1 limit=$2
    shift 2
    echo "--- $step (limit ${limit} s): $*" | tee -a "$LOG"
    timeout -k 5 "$limit" "$@" >"$WORK/$step.out" 2>"$WORK/$step.err"
    RC=$?
    if [ "$RC" -eq 137 ]; then RC=124; fi
    { cat "$WORK/$step.out" "$WORK/$step.err"; echo "--- $step: exit code $RC"; } >>"$LOG"
}

# tail_of STEP: the end of a step's output, for a failed step's detail.
tail_of() { tail -c 1500 "$WORK/$1.err" "$WORK/$1.out" 2>/dev/null; }

# failed_rc STEP START [COMMAND]: the line of a step whose command (run_step name, default STEP) failed.
failed_rc() {
    local why="exit code $RC"
    if [ "$RC" -eq 124 ]; then why="timed out"; fi
    record "$1" failed "$2" "${3:-$1}: $why (see $(basename "$LOG"))" "$(tail_of "${3:-$1}")"
}

# step_install LIMIT: install the carried .whl/*.whl into this python3 (the image's own), leaving out a
# package the image already has at that version or newer (into a folder first on PYTHONPATH where the
# interpreter's site-packages is read-only); then import what they provide. Of LIMIT, 5 s choose the
# wheels, 15 s import, the rest installs.
step_install() {
    local limit=$1 start
    start=$(now)
    shopt -s nullglob
    local carried=("$ROOT"/.whl/*.whl)
    shopt -u nullglob
    if [ "$NO_INSTALL" = 1 ]; then
        record install skipped "$start" "--no-install: the carried wheels are not installed"
        return
    fi
    if [ "${#carried[@]}" -eq 0 ]; then
        record install skipped "$start" "no .whl/*.whl here (scripts/gpu_wheels.sh downloads them)"
        return
    fi
    run_step install_select 5 python3 - "${carried[@]}" <<'EOF'
import importlib.metadata as md
import os
import sys
import sysconfig
from pathlib import Path

if not os.access(sysconfig.get_paths()["purelib"], os.W_OK):
    print("@target")  # this interpreter's site-packages is read-only: install beside it
try:
    from packaging.version import Version
except ImportError:  # no packaging: install every wheel
    Version = None
for path in sys.argv[1:]:
    name, version = Path(path).name.split("-")[:2]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have is not None and Version is not None and Version(have) >= Version(version):
        print(f"kept {name} {have} (carried {version})", file=sys.stderr)
    else:
        print(path)
EOF
    if [ "$RC" -ne 0 ]; then
        failed_rc install "$start" install_select
        return
    fi
    local wanted=() where=()
    mapfile -t wanted <"$WORK/install_select.out"
    if [ "${wanted[0]:-}" = "@target" ]; then  # read-only site-packages: a folder of ours, first on PYTHONPATH
        wanted=("${wanted[@]:1}")
        where=(--target "$WORK/site")
        export PYTHONPATH="$ROOT:$WORK/site${PYTHONPATH#"$ROOT"}"
    fi
    if [ "${#wanted[@]}" -gt 0 ]; then
        run_step install $((limit - 20)) python3 -m pip install -q --no-index --no-deps --no-compile "${where[@]}" \
            "${wanted[@]}"
        if [ "$RC" -ne 0 ]; then
            failed_rc install "$start"
            return
        fi
    fi
    run_step install_check 15 python3 -c "$IMPORT_CHECK"
    if [ "$RC" -ne 0 ]; then
        failed_rc install "$start" install_check
        return
    fi
    local names=()
    for w in "${wanted[@]}"; do names+=("$(basename "$w")"); done
    record install passed "$start" "" \
        "installed${where[*]:+ in $WORK/site}: ${names[*]:-nothing new}; $(tr '\n' ';' <"$WORK/install_select.err")"
}

# step_versions LIMIT: versions, PyTorch APIs and device attributes (gpu_probe.py --env); sets NO_CUDA.
step_versions() {
    local start
    start=$(now)
    run_step versions "$1" python3 scripts/gpu_probe.py --env
    local line
    line="$(grep '^{' "$WORK/versions.out" | tail -n 1)"
    if [ "$RC" -ne 0 ] || [ -z "$line" ]; then
        failed_rc versions "$start"
        return
    fi
    NO_CUDA="$(python3 -c 'import json, sys; print(json.loads(sys.argv[1]).get("no_cuda") or "")' "$line")"
    record versions passed "$start" "" "$line"
}

# gpu_check_step STEP LIMIT NAME ARGS...: scripts/gpu_check.py ARGS with --out $WORK/gpu_check and a
# budget 10 s under LIMIT; its JSON copied to $OUT_DIR/NAME.json; exit 3 (no CUDA device) is "skipped"
# where step 2 saw no CUDA either.
gpu_check_step() {
    local step=$1 limit=$2 name=$3 start
    shift 3
    start=$(now)
    mkdir -p "$WORK/gpu_check" && touch "$WORK/$step.started"
    run_step "$step" "$limit" python3 scripts/gpu_check.py --out "$WORK/gpu_check" --budget-s $((limit - 10)) "$@"
    find "$WORK/gpu_check" -maxdepth 1 -name '*.log' -newer "$WORK/$step.started" -exec tail -n 200 {} + >>"$LOG"
    cp "$WORK/gpu_check/gpu_check.json" "$OUT_DIR/$name.json" 2>/dev/null
    local figures
    figures="$(python3 - "$WORK/gpu_check/gpu_check.json" <<'EOF' 2>/dev/null
import json, sys
data = json.load(open(sys.argv[1]))
print(json.dumps({c["name"]: {"status": c["status"], "figures": c["figures"], "reason": c["reason"]} for c in data["checks"]}))
EOF
)"
    case "$RC" in
    0) record "$step" passed "$start" "" "$figures" ;;
    3)
        if [ -n "$NO_CUDA" ]; then
            record "$step" skipped "$start" "$NO_CUDA" "$figures"
        else  # CUDA was seen in step 2 (or step 2 failed): gpu_check.py's own probe did not see it
            record "$step" failed "$start" "gpu_check.py found no CUDA device (exit code 3)" "$figures"
        fi
        ;;
    1) record "$step" failed "$start" "a check failed (see $(basename "$LOG"))" "$figures" ;;
    *) failed_rc "$step" "$start" ;;
    esac
}
