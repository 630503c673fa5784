#!/usr/bin/env bash
# Wheels for the GPU test machines (run here, on a machine that reaches the package index):
#
#   scripts/gpu_wheels.sh
#
# Downloads into .whl/ at the repo root (ignored by git) exactly the cp312 manylinux x86-64 wheels
# that the GPU machines' image lacks for simpletuner (their image: Python 3.12, torch 2.11+cu130,
# no registry; it already has torch, accelerate, transformers, peft, huggingface-hub, safetensors,
# numpy, pillow, tqdm, pyarrow, pyyaml, pytest and friends). scripts/gpu_truth.sh installs them there
# with `pip install --no-index --no-deps`. Pins are the versions of the dev venv (.venv), so the CPU
# tests and the GPU run import the same code; tests/test_gpu_truth.py checks that every third-party
# import of simpletuner/ is either on the image or in this list.
#
# Idempotent: a wheel already in .whl/ is kept; a wheel of a package or version not pinned below is
# removed (two versions of one package stop the whole install). Prints each wheel, whether it was
# fetched or kept, its size and the total (must stay under 64 MiB: the device tool's limit for what
# travels). Exit code: 0 done, 1 a download failed or the total is too big.
set -uo pipefail

# name==version, one per line (tests/test_gpu_truth.py parses this block). typing-extensions is on the
# image, but pydantic 2.14 needs >= 4.16 (it imports TypeForm and Sentinel) and the image's version is
# unknown: it travels, and gpu_truth.sh installs a wheel only where the image has no version as new. starlette and
# uvicorn: the web UI's (`simpletuner ui`), pure-Python wheels; the image has their h11 and click.
WHEELS=(
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    orjson==3.13.0
    diffusers==0.42.1
    lz4==4.4.5
    python-snappy==0.7.3
    cramjam==2.14.0
    typing-extensions==4.16.0
    starlette==1.10.0
    uvicorn==0.54.0
)
LIMIT_MIB=64

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.whl"
python="${PYTHON:-python3}"
mkdir -p "$dest"

# pip's wheel-name form of a project name: lower case, runs of - _ . as one _
norm() { tr '[:upper:]' '[:lower:]' <<<"$1" | sed -E 's/[-_.]+/_/g'; }

declare -A pinned=()
for spec in "${WHEELS[@]}"; do
    pinned["$(norm "${spec%%==*}")"]="${spec##*==}"
done

shopt -s nullglob
before=("$dest"/*.whl)
declare -A had=()
for f in "${before[@]}"; do had["$(basename "$f")"]=1; done

# Drop what is not pinned (another version, or a package no longer listed) before downloading.
for f in "${before[@]}"; do
    base="$(basename "$f")"
    name="$(norm "${base%%-*}")"
    rest="${base#*-}"
    version="${rest%%-*}"
    if [ "${pinned[$name]:-}" != "$version" ]; then
        echo "removed $base (not pinned: ${name}==${pinned[$name]:-none})"
        rm -f -- "$f"
        unset "had[$base]"
    fi
done

# --platform: pip matches each manylinux tag exactly, so name the ones these packages publish.
if ! "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
    -d "$dest" "${WHEELS[@]}"; then
    echo "gpu_wheels: pip download failed (see above)" >&2
    exit 1
fi

rc=0
total=0
for spec in "${WHEELS[@]}"; do
    name="$(norm "${spec%%==*}")"
    files=("$dest/${name}-${spec##*==}-"*.whl)
    if [ "${#files[@]}" -ne 1 ]; then
        echo "gpu_wheels: expected one wheel for $spec in .whl/, found ${#files[@]}" >&2
        rc=1
        continue
    fi
    base="$(basename "${files[0]}")"
    size=$(stat -c %s "${files[0]}")
    total=$((total + size))
    if [ -n "${had[$base]:-}" ]; then how=kept; else how=fetched; fi
    printf '%-8s %-96s %6.2f MiB\n' "$how" "$base" "$(awk -v b="$size" 'BEGIN { print b / 1048576 }')"
done

printf 'total    %d wheels in %s: %.2f MiB (limit %d MiB)\n' "${#WHEELS[@]}" "$dest" \
    "$(awk -v b="$total" 'BEGIN { print b / 1048576 }')" "$LIMIT_MIB"
if [ "$total" -ge $((LIMIT_MIB * 1048576)) ]; then
    echo "gpu_wheels: the wheels exceed ${LIMIT_MIB} MiB: the device tool will not carry them" >&2
    rc=1
fi

# Drift: a pin that differs from the dev venv's version means the CPU tests ran other code.
if [ -x "$root/.venv/bin/python" ]; then
    "$root/.venv/bin/python" - "${WHEELS[@]}" <<'EOF'
import importlib.metadata as md
import sys

for spec in sys.argv[1:]:
    name, version = spec.split("==")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have != version:
        print(f"note: .venv has {name} {have}, the GPU machines get {version}")
EOF
fi
exit "$rc"
