"""PYTORCH_CUDA_ALLOC_CONF: which keys stock PyTorch accepts, and what to say about the rest.

A CUDA build of PyTorch parses the variable when CUDA starts and refuses to run on a key it
does not know. The GH200 fork of ai-toolkit (seed 001) exports keys of a patched PyTorch
(``use_uvm``, ``uvm_oversubscription_ratio``, ``uvm_access_pattern``) that no released build
has; a run would die at its first CUDA allocation, after minutes of start-up. The trainer,
``simpletuner estimate``, ``gh200_diagnostic.py`` and ``scripts/setup_gh200_env.sh`` all check
with the functions here, so each says the same thing before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

ALLOC_CONF_VAR = "PYTORCH_CUDA_ALLOC_CONF"

#: Keys a stock PyTorch CUDA build (2.4 ... 2.13) accepts in PYTORCH_CUDA_ALLOC_CONF.
CUDA_ALLOC_CONF_KEYS: tuple[str, ...] = (
    "backend",
    "expandable_segments",
    "garbage_collection_threshold",
    "large_segment_size_mb",
    "max_non_split_rounding_mb",
    "max_split_size_mb",
    "pinned_max_cached_size_mb",
    "pinned_max_round_threshold_mb",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_use_background_threads",
    "pinned_use_cuda_host_register",
    "release_lock_on_cudamalloc",
    "roundup_power2_divisions",
)

#: Keys of the patched PyTorch behind seed 001, and what this project offers instead.
FORK_ONLY_KEYS: dict[str, str] = {
    "use_uvm": (
        "unified memory on stock PyTorch comes from simpletuner's managed-memory pool: "
        'gh200_optimizations.managed_memory "all" routes every training allocation to it ("frozen_weights": only '
        'the frozen weights; "caches", the default: only `unified_memory` caches; needs the gh200 extra)'
    ),
    "uvm_oversubscription_ratio": (
        'set gh200_optimizations.oversubscription_ratio (with managed_memory "all") in the config instead; '
        "`python gh200_diagnostic.py --oversubscription-scale 1.5` measures what this machine's managed memory "
        "can take"
    ),
    "uvm_access_pattern": (
        "placement is decided per tensor by simpletuner's hints (gh200_optimizations.enable_uvm_hints): latents "
        'prefer CPU memory, text embeddings GPU memory; managed_memory "frozen_weights" keeps frozen weights '
        "in CPU memory and prefetches them ahead of use"
    ),
}


@dataclass(frozen=True)
class AllocConfCheck:
    """What is wrong with one PYTORCH_CUDA_ALLOC_CONF value."""

    value: str
    fork_keys: tuple[str, ...]  # keys only the patched PyTorch of seed 001 knows: CUDA would refuse them
    unknown_keys: tuple[str, ...]  # other keys this project does not know PyTorch to accept

    @property
    def is_ok(self) -> bool:
        return not self.fork_keys and not self.unknown_keys

    def errors(self) -> list[str]:
        """One line per fork-only key: PyTorch would refuse to start CUDA with it."""
        kept = [item for item in _items(self.value) if _key(item) not in FORK_ONLY_KEYS]
        fix = f'export {ALLOC_CONF_VAR}="{",".join(kept)}"' if kept else f"unset {ALLOC_CONF_VAR}"
        return [
            f"{ALLOC_CONF_VAR} sets `{key}`, a key of a patched PyTorch build (the ai-toolkit GH200 fork) that stock "
            f"PyTorch rejects when CUDA starts; {FORK_ONLY_KEYS[key]}. Fix: {fix}"
            for key in self.fork_keys
        ]

    def warnings(self) -> list[str]:
        if not self.unknown_keys:
            return []
        return [
            f"{ALLOC_CONF_VAR} sets {', '.join(f'`{k}`' for k in self.unknown_keys)}, not among the keys stock PyTorch "
            f"is known to accept ({', '.join(CUDA_ALLOC_CONF_KEYS)}); if your PyTorch does not know it either, CUDA "
            "will refuse to start"
        ]


def format_alloc_conf(settings) -> str:
    """``settings`` (key -> bool / int / float / str) as PYTORCH_CUDA_ALLOC_CONF spells them: ``key:value``
    joined by commas, booleans as True / False."""
    return ",".join(f"{key}:{format_alloc_value(value)}" for key, value in settings.items())


def format_alloc_value(value) -> str:
    return ("True" if value else "False") if isinstance(value, bool) else str(value)


def _items(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _key(item: str) -> str:
    return item.partition(":")[0].strip()


def check_alloc_conf(value: str | None) -> AllocConfCheck:
    """Sort the keys of a PYTORCH_CUDA_ALLOC_CONF value into fork-only and unknown ones."""
    keys = [_key(item) for item in _items(value or "")]
    fork = tuple(k for k in keys if k in FORK_ONLY_KEYS)
    unknown = tuple(k for k in keys if k not in FORK_ONLY_KEYS and k not in CUDA_ALLOC_CONF_KEYS)
    return AllocConfCheck(value or "", fork, unknown)


# --- the `cuda_allocator` table of a training config -----------------------------------------
# What each key's value must be, as PyTorch's parser (c10 AllocatorConfig / CUDAAllocatorConfig)
# reads it from the variable. Booleans are written there as True/False, everything else as is.
_BOOL_KEYS = frozenset(
    {
        "expandable_segments",
        "pinned_use_background_threads",
        "pinned_use_cuda_host_register",
        "release_lock_on_cudamalloc",
    }
)
_MB_KEYS = {  # key -> smallest value PyTorch accepts
    "large_segment_size_mb": 1,
    "max_non_split_rounding_mb": 20,
    "max_split_size_mb": 20,
    "pinned_max_cached_size_mb": 1,
    "pinned_max_round_threshold_mb": 1,
    "pinned_reserve_segment_size_mb": 1,
}
_BACKENDS = ("native", "cudaMallocAsync")
_MAX_REGISTER_THREADS = 128


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_power_of_2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _value_problem(key: str, value: object) -> str | None:
    """Why PyTorch would refuse ``key: value``, or None when it accepts it."""
    if key in _BOOL_KEYS:
        return None if isinstance(value, bool) else f"takes true or false (a JSON boolean), got {value!r}"
    if key in _MB_KEYS:
        low = _MB_KEYS[key]
        if _is_int(value) and value >= low:
            return None
        return f"takes a whole number of MB >= {low}, got {value!r}"
    if key == "backend":
        return None if value in _BACKENDS else f'takes "native" or "cudaMallocAsync", got {value!r}'
    if key == "garbage_collection_threshold":
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1:
            return None
        return f"takes a number between 0 and 1 (exclusive), got {value!r}"
    if key == "pinned_num_register_threads":
        if _is_int(value) and _is_power_of_2(value) and value <= _MAX_REGISTER_THREADS:
            return None
        return f"takes a power of 2 up to {_MAX_REGISTER_THREADS}, got {value!r}"
    if key == "roundup_power2_divisions":
        if _is_int(value) and _is_power_of_2(value):
            return None
        if isinstance(value, str) and _is_division_list(value):
            return None
        return f'takes a power of 2 or a list such as "[256:1,512:2,>:4]", got {value!r}'
    return None


def _is_division_list(value: str) -> bool:
    """``[256:1,512:2,>:4]``: size in MB (a power of 2, or ``>`` for the rest) : divisions (0 or a power of 2)."""
    if not (value.startswith("[") and value.endswith("]")) or len(value) < 3:
        return False
    for item in value[1:-1].split(","):
        size, sep, divisions = item.strip().partition(":")
        if not sep or not divisions.strip().isdigit():
            return False
        count = int(divisions)
        if count and not _is_power_of_2(count):
            return False
        if size.strip() != ">" and not (size.strip().isdigit() and _is_power_of_2(int(size))):
            return False
    return True


def allocator_settings_problems(settings: dict) -> list[str]:
    """One line per key of the config's ``cuda_allocator`` table that PyTorch would refuse.

    Fork-only keys (``use_uvm``, ``uvm_*``) get the replacement advice; other unknown keys the
    list of accepted ones; known keys a wrong value, whatever its type.
    """
    problems = []
    accepted = ", ".join(CUDA_ALLOC_CONF_KEYS)
    for key, value in settings.items():
        if key in FORK_ONLY_KEYS or key.startswith("uvm_"):
            advice = FORK_ONLY_KEYS.get(key, FORK_ONLY_KEYS["use_uvm"])
            problems.append(
                f"{key} not accepted by PyTorch's CUDA allocator: it is a key of a patched PyTorch build (the "
                f"ai-toolkit GH200 fork) and stock PyTorch refuses to start CUDA with it; {advice}. Remove it "
                f"(accepted keys: {accepted})"
            )
        elif key not in CUDA_ALLOC_CONF_KEYS:
            problems.append(
                f"{key} not accepted by PyTorch's CUDA allocator (CUDA would refuse to start): remove it or use one "
                f"of the accepted keys: {accepted}"
            )
        else:
            problem = _value_problem(key, value)
            if problem:
                problems.append(f"{key} {problem}")
    return problems
