"""The GPU table: datasheet memory and dense peak FLOPS of known GPUs, name lookup, MFU arithmetic.

:data:`GPU_SPECS` lists known GPUs with datasheet memory and *dense* (no-sparsity) BF16/FP16/TF32
tensor and FP32 peaks, each with its source. :func:`lookup_gpu` matches the names torch reports and
the spellings users type for ``--gpu``, and returns None for a name it does not know (the caller
reports "unknown", never a guess). :func:`mfu` and :func:`achieved_tflops` turn FLOPs per step and
step time into utilisation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from simpletuner.diskspace import GIB


@dataclass(frozen=True)
class GpuSpec:
    """One known GPU: datasheet memory and dense peaks per precision.

    ``memory_gb`` lists the variants sold (the first, smallest, is the default; hypothetical
    machines read the figure as GiB, which is within ~1% of what torch reports on discrete cards).
    Peaks are dense TFLOPS (datasheets often print 2:4-sparsity figures, twice as high), None
    where the format is unsupported: ``bf16_tflops`` / ``fp16_tflops`` are the tensor-core peaks
    with FP32 accumulate, ``tf32_tflops`` the TF32 tensor-core peak (Ampere and newer), and
    ``fp32_tflops`` the plain (non-tensor) FP32 peak. ``patterns`` are token sets a name must contain.
    """

    name: str
    patterns: tuple[tuple[str, ...], ...]
    memory_gb: tuple[float, ...]
    bf16_tflops: float | None
    fp16_tflops: float | None
    tf32_tflops: float | None
    fp32_tflops: float
    compute_capability: tuple[int, int]
    source: str
    unified: bool = False
    integrated: bool = False
    #: Superchips: the host side of the machine (GH200: LPDDR5X beside the HBM; GB10: the one shared memory).
    host_memory_gb: float | None = None
    host_cpu_cores: int | None = None
    #: Total that torch reports where it is well below the datasheet figure (GB10: ~119 GiB of 128 GB).
    reported_gib: float | None = None


def _spec(name, patterns, memory_gb, peaks, cc, source, **extra) -> GpuSpec:
    """``peaks``: dense (bf16, fp16, tf32, fp32) TFLOPS."""
    bf16, fp16, tf32, fp32 = peaks
    return GpuSpec(
        name, tuple(tuple(p) for p in patterns), tuple(memory_gb), bf16, fp16, tf32, fp32, cc, source, **extra
    )


#: Known GPUs. Sources are NVIDIA datasheets/whitepapers; "with sparsity" figures are halved to
#: dense. Peaks are (bf16, fp16, tf32, fp32) dense TFLOPS.
GPU_SPECS: tuple[GpuSpec, ...] = (
    # H100 datasheet (nvidia.com/en-us/data-center/h100), with sparsity: BF16/FP16 1,979 (SXM) /
    # 1,513 (PCIe) / 1,671 (NVL); TF32 989 / 756 / 835. FP32 67 / 51 / 60 (dense, non-tensor).
    # Dense halves as in the Hopper whitepaper (SXM: 989.4 BF16, 494.7 TF32).
    _spec(
        "H100 SXM",
        [("h100",)],
        [80],
        (989.4, 989.4, 494.7, 67.0),
        (9, 0),
        "NVIDIA H100 datasheet (SXM5): BF16 1,979 / TF32 989 sparse / 2; FP32 67",
    ),
    _spec(
        "H100 PCIe",
        [("h100", "pcie")],
        [80],
        (756.5, 756.5, 378.0, 51.0),
        (9, 0),
        "NVIDIA H100 datasheet (PCIe): BF16 1,513 / TF32 756 sparse / 2; FP32 51",
    ),
    _spec(
        "H100 NVL",
        [("h100", "nvl")],
        [94],
        (835.5, 835.5, 417.5, 60.0),
        (9, 0),
        "NVIDIA H100 datasheet (NVL): BF16 1,671 / TF32 835 sparse / 2; FP32 60",
    ),
    # H200 datasheet (nvidia.com/en-us/data-center/h200): same GH100 compute as H100, 141 GB HBM3e.
    _spec(
        "H200",
        [("h200",)],
        [141],
        (989.4, 989.4, 494.7, 67.0),
        (9, 0),
        "NVIDIA H200 datasheet (SXM): BF16 1,979 / TF32 989 sparse / 2; FP32 67",
    ),
    _spec(
        "H200 NVL",
        [("h200", "nvl")],
        [141],
        (835.5, 835.5, 417.5, 60.0),
        (9, 0),
        "NVIDIA H200 datasheet (NVL): BF16 1,671 / TF32 835 sparse / 2; FP32 60",
    ),
    # GH200 datasheet (nvidia.com/en-us/data-center/grace-hopper-superchip): 96 GB HBM3 or 144 GB
    # HBM3e, plus up to 480 GB LPDDR5X on the 72-core Grace CPU, coherent over NVLink-C2C.
    _spec(
        "GH200",
        [("gh200",)],
        [96, 144],
        (989.4, 989.4, 494.7, 67.0),
        (9, 0),
        "NVIDIA GH200 Grace Hopper Superchip datasheet: FP16/BF16 1,979 / TF32 989 sparse / 2; FP32 67",
        unified=True,
        host_memory_gb=480,
        host_cpu_cores=72,
    ),
    # A100 datasheet (nvidia.com/en-us/data-center/a100): BF16/FP16 312 dense (624 sparse), TF32
    # 156 dense (312 sparse), FP32 19.5. A bare "a100" is the 40 GB card (the conservative
    # memory); say "a100-80gb" for the other.
    _spec(
        "A100 40GB",
        [("a100",), ("a100", "40gb")],
        [40],
        (312.0, 312.0, 156.0, 19.5),
        (8, 0),
        "NVIDIA A100 datasheet: BF16 312 / TF32 156 dense; FP32 19.5",
    ),
    _spec(
        "A100 80GB",
        [("a100",), ("a100", "80gb")],
        [80],
        (312.0, 312.0, 156.0, 19.5),
        (8, 0),
        "NVIDIA A100 datasheet: BF16 312 / TF32 156 dense; FP32 19.5",
    ),
    _spec(
        "A30",
        [("a30",)],
        [24],
        (165.0, 165.0, 82.0, 10.3),
        (8, 0),
        "NVIDIA A30 datasheet: BF16 330 / TF32 165 sparse / 2 (datasheet dense TF32: 82); FP32 10.3",
    ),
    _spec(
        "A10",
        [("a10",)],
        [24],
        (125.0, 125.0, 62.5, 31.2),
        (8, 6),
        "NVIDIA A10 datasheet: BF16 250 / TF32 125 sparse / 2; FP32 31.2",
    ),
    # A40 datasheet: FP32 37.4; TF32 tensor 74.8 | 149.6 sparse; BF16 (FP32 accumulate) and FP16
    # 149.7 | 299.4 sparse. A data-centre card: FP32 accumulate runs at the full rate.
    _spec(
        "A40",
        [("a40",)],
        [48],
        (149.7, 149.7, 74.8, 37.4),
        (8, 6),
        "NVIDIA A40 datasheet: BF16 299.4 / TF32 149.6 sparse / 2; FP32 37.4",
    ),
    # A10G (AWS G5) has no NVIDIA datasheet; AWS/Baseten's A10-vs-A10G comparison gives 70 TFLOPS
    # BF16/FP16 tensor and 35 TF32 tensor (vs the A10's 125 / 62.5). Conservative, third-party figures.
    _spec(
        "A10G",
        [("a10g",)],
        [24],
        (70.0, 70.0, 35.0, 31.2),
        (8, 6),
        "AWS G5 / Baseten A10 vs A10G: BF16 70, TF32 35, FP32 31.2 (no NVIDIA datasheet)",
    ),
    # L40S datasheet: FP32 91.6; TF32 tensor 183 | 366 sparse; BF16/FP16 362.05 | 733 sparse.
    _spec(
        "L40S",
        [("l40s",)],
        [48],
        (362.05, 362.05, 183.0, 91.6),
        (8, 9),
        "NVIDIA L40S datasheet: BF16 733 / TF32 366 sparse / 2; FP32 91.6",
    ),
    # RTX 6000 Ada datasheet: FP32 91.1, tensor 1,457 TFLOPS (FP8 with sparsity) -> FP16/BF16
    # 364.2 dense (a pro card: FP32 accumulate at the full rate); TF32 182.1 dense (Ada whitepaper).
    _spec(
        "RTX 6000 Ada",
        [("rtx", "6000", "ada"), ("6000", "ada")],
        [48],
        (364.2, 364.2, 182.1, 91.1),
        (8, 9),
        "NVIDIA RTX 6000 Ada datasheet / Ada whitepaper: BF16 728.5 / TF32 364.2 sparse / 2; FP32 91.1",
    ),
    # V100 datasheet (nvidia.com/en-us/data-center/v100): tensor 125 (SXM2) / 112 (PCIe) TFLOPS
    # FP16 with FP32 accumulate, FP32 15.7 / 14; Volta has no BF16 and no TF32. 16 or 32 GB HBM2.
    _spec(
        "V100 SXM2",
        [("v100",), ("v100", "sxm2")],
        [16, 32],
        (None, 125.0, None, 15.7),
        (7, 0),
        "NVIDIA V100 datasheet (SXM2): FP16 tensor 125; FP32 15.7",
    ),
    _spec(
        "V100 PCIe",
        [("v100", "pcie")],
        [16, 32],
        (None, 112.0, None, 14.0),
        (7, 0),
        "NVIDIA V100 datasheet (PCIe): FP16 tensor 112; FP32 14",
    ),
    # Quadro RTX 6000 datasheet (and Turing whitepaper, appendix): 24 GB GDDR6, FP32 16.3, tensor 130.5 TFLOPS
    # FP16 with FP32 accumulate (a Quadro: full rate); no BF16 or TF32. The card of seed 003's guide.
    _spec(
        "Quadro RTX 6000",
        [("quadro", "rtx", "6000"), ("rtx", "6000")],
        [24],
        (None, 130.5, None, 16.3),
        (7, 5),
        "NVIDIA Quadro RTX 6000 datasheet / Turing whitepaper: FP16 tensor 130.5 (FP32 accumulate); FP32 16.3",
    ),
    # T4 datasheet: 65 TFLOPS mixed precision (FP16/FP32), FP32 8.1; Turing has no BF16 or TF32.
    _spec("T4", [("t4",)], [16], (None, 65.0, None, 8.1), (7, 5), "NVIDIA T4 datasheet: 65 mixed precision; FP32 8.1"),
    # GeForce cards run FP16 with FP32 accumulate (what training uses, and always for BF16) at half
    # the FP16-accumulate rate; these are the FP32-accumulate figures (the conservative ones). Their
    # TF32 tensor peak equals the plain FP32 peak.
    _spec(
        "RTX 3090",
        [("rtx", "3090"), ("3090",)],
        [24],
        (71.0, 71.0, 35.6, 35.6),
        (8, 6),
        "NVIDIA Ampere GA102 whitepaper: BF16 71 with FP32 accumulate (142 with FP16 accumulate); TF32 35.6; FP32 35.6",
    ),
    _spec(
        "RTX 4080",
        [("rtx", "4080"), ("4080",)],
        [16],
        (97.5, 97.5, 48.7, 48.7),
        (8, 9),
        "NVIDIA Ada Lovelace whitepaper: BF16 97.5 with FP32 accumulate (194.9 with FP16 accumulate); "
        "TF32 48.7 (97.5 sparse); FP32 48.7",
    ),
    _spec(
        "RTX 4090",
        [("rtx", "4090"), ("4090",)],
        [24],
        (165.2, 165.2, 82.6, 82.6),
        (8, 9),
        "NVIDIA Ada Lovelace whitepaper: BF16 165.2 with FP32 accumulate (330.3 with FP16 accumulate); "
        "TF32 82.6 (165.2 sparse); FP32 82.6",
    ),
    # RTX 5090: 838 TFLOPS FP16 sparse with FP16 accumulate is widely published (419 dense); the
    # FP32-accumulate rate is half of that, as on the GeForce generations before it.
    _spec(
        "RTX 5090",
        [("rtx", "5090"), ("5090",)],
        [32],
        (209.5, 209.5, 104.8, 104.8),
        (12, 0),
        "NVIDIA RTX Blackwell whitepaper: BF16 209.5 with FP32 accumulate (419 with FP16 accumulate); "
        "TF32 104.8 (209.5 sparse); FP32 104.8",
    ),
    # HGX B200 (nvidia.com/en-us/data-center/hgx), per GPU with sparsity: FP16/BF16 4.5 PFLOPS,
    # TF32 2.2 PFLOPS; FP32 75 TFLOPS. 180 GB HBM3e per GPU as listed for HGX/DGX B200 (192 GB physical).
    _spec(
        "B200",
        [("b200",)],
        [180, 192],
        (2250.0, 2250.0, 1100.0, 75.0),
        (10, 0),
        "NVIDIA HGX B200 spec, per GPU: BF16 4.5 PF / TF32 2.2 PF sparse / 2; FP32 75",
    ),
    # GB10 / DGX Spark (nvidia.com/en-us/products/workstations/dgx-spark): NVIDIA documents only
    # "1 PFLOP FP4 with sparsity". 1000 / 2 (dense) / 4 (FP4 -> 16-bit) = 125 at FP16 accumulate;
    # sm_121 has the RTX-Blackwell tensor cores (48 SMs, like the RTX 5070), where FP32 accumulate
    # runs at half rate -> 62.5, and TF32 at half of that -> 31.25 (as on the RTX 5090: 104.8 vs
    # 209.5). FP32: 48 SMs x 128 lanes x 2 FLOPs x ~2.5 GHz ~ 31. Derived, conservative; a measured
    # BF16 GEMM above 62.5 means 125 (pass --peak-tflops to train against a measured figure).
    _spec(
        "GB10",
        [("gb10",), ("dgx", "spark")],
        [128],
        (62.5, 62.5, 31.25, 31.0),
        (12, 1),
        "NVIDIA DGX Spark spec (1 PFLOP FP4 sparse), derived: BF16 1000 / 2 / 4 / 2 (FP32 accumulate); "
        "TF32 half of that; FP32 from 48 SMs",
        unified=True,
        integrated=True,
        host_memory_gb=128,
        host_cpu_cores=20,
        reported_gib=119.0,
    ),
)

_NOISE_TOKENS = frozenset({"nvidia", "tesla", "geforce", "graphics", "gpu"})
#: Tokens a name may carry beyond its pattern without making it a different card.
_DETAIL_TOKENS = frozenset(
    {
        "sxm",
        "sxm2",
        "sxm4",
        "sxm5",
        "pcie",
        "hbm2",
        "hbm2e",
        "hbm3",
        "hbm3e",
        "gddr6",
        "gddr6x",
        "gddr7",
        "lpddr5x",
        "generation",
    }
)
_MEMORY_TOKEN = re.compile(r"^(\d+)gb?$")


def _tokens(name: str) -> tuple[str, ...]:
    """Lower-case tokens of a GPU name without vendor words; "rtx4090" -> rtx 4090, "144g" -> 144gb."""
    text = re.sub(r"rtx(?=\d)", "rtx ", name.lower())
    tokens = []
    for token in re.split(r"[^a-z0-9]+", text):
        memory = _MEMORY_TOKEN.match(token)
        if memory:
            token = f"{memory.group(1)}gb"
        if token and token not in _NOISE_TOKENS:
            tokens.append(token)
    return tuple(tokens)


def _match_score(pattern: tuple[str, ...], tokens: tuple[str, ...]) -> int | None:
    """len(pattern) when every pattern token is present and the rest are details; else None."""
    if not set(pattern) <= set(tokens):
        return None
    rest = [t for t in tokens if t not in pattern]
    if any(t not in _DETAIL_TOKENS and not _MEMORY_TOKEN.match(t) for t in rest):
        return None
    return len(pattern)


def lookup_gpu(name: str | None, memory_bytes: int | None = None) -> GpuSpec | None:
    """The table entry for a device name ("NVIDIA H100 80GB HBM3") or a user spelling ("h100-pcie").

    The most specific matching pattern wins; ties (a bare "a100") go to the entry whose memory is
    closest to ``memory_bytes`` when given, else to the first in the table. None when nothing
    matches: an unknown card is reported as unknown, not guessed.
    """
    tokens = _tokens(name or "")
    if not tokens:
        return None
    ranked = []
    for index, spec in enumerate(GPU_SPECS):
        scores = [s for s in (_match_score(p, tokens) for p in spec.patterns) if s is not None]
        if scores:
            distance = 0.0 if memory_bytes is None else min(abs(gb * GIB - memory_bytes) for gb in spec.memory_gb)
            ranked.append((-max(scores), distance, index, spec))
    return min(ranked, key=lambda item: item[:3])[3] if ranked else None


def known_gpu_names() -> list[str]:
    """The names of every table entry, in table order."""
    return [spec.name for spec in GPU_SPECS]


def resolve_gpu_name(name: str) -> GpuSpec:
    """The table entry for a ``--gpu NAME`` value; ValueError listing the known names otherwise."""
    spec = lookup_gpu(name)
    if spec is None:
        raise ValueError(
            f"unknown GPU {name!r}: known GPUs are {', '.join(known_gpu_names())} "
            "(spellings like 'h100', 'H100-PCIe', 'a100-80gb', 'rtx4090', 'gb10' work too); "
            "for another card pass --gpu-memory GB instead"
        )
    return spec


def default_memory_gb(spec: GpuSpec, name: str = "") -> float:
    """The variant a name spells out ("v100-32gb" -> 32), else what the default card reports."""
    for token in _tokens(name):
        memory = _MEMORY_TOKEN.match(token)
        if memory and float(memory.group(1)) in spec.memory_gb:
            return float(memory.group(1))
    return spec.reported_gib or spec.memory_gb[0]


def achieved_tflops(flops_per_step: float, step_seconds: float) -> float | None:
    """TFLOPS a step achieved: FLOPs / seconds / 1e12; None when the step time is not positive."""
    if flops_per_step < 0:
        raise ValueError(f"flops_per_step must be >= 0, got {flops_per_step}")
    if step_seconds <= 0:
        return None
    return flops_per_step / step_seconds / 1e12


def mfu(flops_per_step: float, step_seconds: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved TFLOPS / peak; None when the peak is unknown or the time is 0."""
    achieved = achieved_tflops(flops_per_step, step_seconds)
    if achieved is None or peak_tflops is None or peak_tflops <= 0:
        return None
    return achieved / peak_tflops
