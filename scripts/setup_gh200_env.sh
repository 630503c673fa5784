#!/usr/bin/env bash
# Environment defaults for training on an NVIDIA GH200 / GB10 (unified memory).
#
#   source scripts/setup_gh200_env.sh
#
# Every variable keeps the value you already exported; the script only fills in what is unset
# and prints which it set and which it kept. Nothing here is required: a config's
# gh200_optimizations.enable_uvm_hints overrides SIMPLETUNER_GH200_UVM_HINTS.

# Executed instead of sourced: the exports would vanish with this child shell.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    echo "setup_gh200_env.sh must be sourced, not executed: source ${0}" >&2
    exit 1
fi

_st_gh200_default() {
    # _st_gh200_default NAME VALUE: export NAME=VALUE unless NAME is already set (even to "").
    if [ -n "${!1+x}" ]; then
        echo "kept  $1=${!1}"
    else
        export "$1=$2"
        echo "set   $1=$2"
    fi
}

# Place latents in CPU RAM and embeddings in GPU memory with managed-memory hints (simpletuner.gh200.uvm).
_st_gh200_default SIMPLETUNER_GH200_UVM_HINTS 1
# Grow allocator segments instead of splitting fixed ones: less fragmentation with changing shapes
# (aspect buckets). Only keys stock PyTorch accepts; there is no `use_uvm` key.
_st_gh200_default PYTORCH_CUDA_ALLOC_CONF "expandable_segments:True"
# CPU threads for data loading and CPU-side ops: the cores this shell may use, at most 72 (one Grace CPU).
# (nproc itself honours OMP_NUM_THREADS, so it is asked without it.)
_st_gh200_cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
[ "$_st_gh200_cpus" -gt 72 ] 2>/dev/null && _st_gh200_cpus=72
_st_gh200_default OMP_NUM_THREADS "$_st_gh200_cpus"
_st_gh200_default MKL_NUM_THREADS "$_st_gh200_cpus"
# Hugging Face tokenizers warn, and can deadlock, when DataLoader workers fork after they ran in parallel.
_st_gh200_default TOKENIZERS_PARALLELISM false

unset -v _st_gh200_cpus
unset -f _st_gh200_default
return 0
