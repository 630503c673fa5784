#!/usr/bin/env bash
# Environment defaults for training on an NVIDIA GH200 / GB10 (unified memory).
#
#   source scripts/setup_gh200_env.sh
#
# Every variable keeps the value you already exported; the script only fills in what is unset
# and prints which it set and which it kept. Nothing here is required: a config's
# gh200_optimizations.enable_uvm_hints overrides SIMPLETUNER_GH200_UVM_HINTS (and its alias
# SIMPLETUNER_GH200_ENABLE_UVM_HINTS, the ai-toolkit GH200 fork's name, which is kept if you set it).
#
# A PYTORCH_CUDA_ALLOC_CONF you set is kept too, but checked: keys of the fork's patched PyTorch
# (use_uvm, uvm_oversubscription_ratio, uvm_access_pattern) make a stock PyTorch refuse to start
# CUDA. For each the script prints what to use instead and the fixed export line, and returns 1.
# (The same messages as simpletuner.configuration.alloc_conf; a test keeps them identical.)

# Executed instead of sourced: the exports would vanish with this child shell.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    echo "setup_gh200_env.sh must be sourced, not executed: source ${0}" >&2
    exit 1
fi

unset -v _st_gh200_status  # set to 1 below when something will stop a run

_st_gh200_default() {
    # _st_gh200_default NAME VALUE: export NAME=VALUE unless NAME is already set (even to "").
    if [ -n "${!1+x}" ]; then
        echo "kept  $1=${!1}"
    else
        export "$1=$2"
        echo "set   $1=$2"
    fi
}

_st_gh200_bool() {
    # _st_gh200_bool VALUE: prints 1, 0 or "?" the way simpletuner reads a hint variable.
    local v="${1,,}"
    v="${v#"${v%%[![:space:]]*}"}"; v="${v%"${v##*[![:space:]]}"}"
    case "$v" in
        1|true|yes|on) echo 1 ;;
        0|false|no|off|"") echo 0 ;;
        *) echo "?" ;;
    esac
}

_st_gh200_check_alloc_conf() {
    # Prints, on stderr, what a stock PyTorch would refuse in PYTORCH_CUDA_ALLOC_CONF; returns 1 if anything.
    local var=PYTORCH_CUDA_ALLOC_CONF value="${PYTORCH_CUDA_ALLOC_CONF-}" item key kept="" unknown="" fix advice
    local -a fork=() items=()
    local accepted=" backend expandable_segments garbage_collection_threshold large_segment_size_mb max_non_split_rounding_mb max_split_size_mb pinned_max_cached_size_mb pinned_max_round_threshold_mb pinned_num_register_threads pinned_reserve_segment_size_mb pinned_use_background_threads pinned_use_cuda_host_register release_lock_on_cudamalloc roundup_power2_divisions "
    IFS=, read -r -a items <<< "$value"
    for item in "${items[@]}"; do
        item="${item#"${item%%[![:space:]]*}"}"; item="${item%"${item##*[![:space:]]}"}"
        [ -n "$item" ] || continue
        key="${item%%:*}"
        key="${key#"${key%%[![:space:]]*}"}"; key="${key%"${key##*[![:space:]]}"}"
        case "$key" in
            use_uvm|uvm_oversubscription_ratio|uvm_access_pattern) fork+=("$key") ;;
            *)
                kept="${kept:+$kept,}$item"
                [[ "$accepted" == *" $key "* ]] || unknown="${unknown:+$unknown, }\`$key\`" ;;
        esac
    done
    if [ -n "$unknown" ]; then
        echo "WARNING $var sets $unknown, not among the keys stock PyTorch is known to accept ($(echo $accepted | sed 's/ /, /g')); if your PyTorch does not know it either, CUDA will refuse to start" >&2
    fi
    [ "${#fork[@]}" -gt 0 ] || return 0
    if [ -n "$kept" ]; then fix="export $var=\"$kept\""; else fix="unset $var"; fi
    echo "ERROR $var=$value: stock PyTorch refuses to start CUDA with this value. It is kept as you set it, so every CUDA run from this shell fails until you fix it:" >&2
    for key in "${fork[@]}"; do
        case "$key" in
            use_uvm) advice="unified memory on stock PyTorch comes from simpletuner's managed-memory pool: gh200_optimizations.managed_memory \"all\" routes every training allocation to it (\"frozen_weights\": only the frozen weights; \"caches\", the default: only \`unified_memory\` caches; needs the gh200 extra)" ;;
            uvm_oversubscription_ratio) advice="set gh200_optimizations.oversubscription_ratio (with managed_memory \"all\") in the config instead; \`python gh200_diagnostic.py --oversubscription-scale 1.5\` measures what this machine's managed memory can take" ;;
            uvm_access_pattern) advice="placement is decided per tensor by simpletuner's hints (gh200_optimizations.enable_uvm_hints): latents prefer CPU memory, text embeddings GPU memory; managed_memory \"frozen_weights\" keeps frozen weights in CPU memory and prefetches them ahead of use" ;;
        esac
        echo "  $var sets \`$key\`, a key of a patched PyTorch build (the ai-toolkit GH200 fork) that stock PyTorch rejects when CUDA starts; $advice. Fix: $fix" >&2
    done
    echo "  Run: $fix" >&2
    return 1
}

# Place latents in CPU RAM and embeddings in GPU memory with managed-memory hints (simpletuner.gh200.uvm).
# The fork's name for the same switch is honoured: set alone, it is kept and the canonical name is not added.
if [ -n "${SIMPLETUNER_GH200_ENABLE_UVM_HINTS+x}" ] && [ -z "${SIMPLETUNER_GH200_UVM_HINTS+x}" ]; then
    echo "kept  SIMPLETUNER_GH200_ENABLE_UVM_HINTS=$SIMPLETUNER_GH200_ENABLE_UVM_HINTS (the ai-toolkit fork's name; simpletuner reads it as SIMPLETUNER_GH200_UVM_HINTS)"
else
    _st_gh200_default SIMPLETUNER_GH200_UVM_HINTS 1
    if [ -n "${SIMPLETUNER_GH200_ENABLE_UVM_HINTS+x}" ] && \
        [ "$(_st_gh200_bool "$SIMPLETUNER_GH200_ENABLE_UVM_HINTS")" != "$(_st_gh200_bool "$SIMPLETUNER_GH200_UVM_HINTS")" ]; then
        echo "ERROR SIMPLETUNER_GH200_UVM_HINTS=$SIMPLETUNER_GH200_UVM_HINTS and SIMPLETUNER_GH200_ENABLE_UVM_HINTS=$SIMPLETUNER_GH200_ENABLE_UVM_HINTS disagree (the second is the fork's name for the first); simpletuner stops until one is unset or both match. Run: unset SIMPLETUNER_GH200_ENABLE_UVM_HINTS" >&2
        _st_gh200_status=1
    fi
fi
# Grow allocator segments instead of splitting fixed ones: less fragmentation with changing shapes
# (aspect buckets). Only keys stock PyTorch accepts; there is no `use_uvm` key.
_st_gh200_default PYTORCH_CUDA_ALLOC_CONF "expandable_segments:True"
_st_gh200_check_alloc_conf || _st_gh200_status=1
# CPU threads for data loading and CPU-side ops: the cores this shell may use, at most 72 (one Grace CPU).
# (nproc itself honours OMP_NUM_THREADS, so it is asked without it.)
_st_gh200_cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
[ "$_st_gh200_cpus" -gt 72 ] 2>/dev/null && _st_gh200_cpus=72
_st_gh200_default OMP_NUM_THREADS "$_st_gh200_cpus"
_st_gh200_default MKL_NUM_THREADS "$_st_gh200_cpus"
# Hugging Face tokenizers warn, and can deadlock, when DataLoader workers fork after they ran in parallel.
_st_gh200_default TOKENIZERS_PARALLELISM false

unset -v _st_gh200_cpus
unset -f _st_gh200_default _st_gh200_bool _st_gh200_check_alloc_conf
if [ -n "${_st_gh200_status+x}" ]; then
    unset -v _st_gh200_status
    return 1
fi
return 0
