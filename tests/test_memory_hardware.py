"""Hardware detection against the fake runtime, the GPU table, name lookup, MFU arithmetic."""

from __future__ import annotations

import pytest
from fake_cuda import FakeRuntime, discrete_info, gb10_info, gh200_info

from simpletuner.diskspace import GIB
from simpletuner.hardware.gpus import GPU_SPECS, achieved_tflops, known_gpu_names, lookup_gpu, mfu, resolve_gpu_name
from simpletuner.hardware.machine import HardwareInfo, detect_hardware, hardware_for_gpu
from simpletuner.hardware.runtime import DeviceMemoryInfo, NoCudaRuntime

KIB = 1024


@pytest.fixture
def meminfo(tmp_path):
    """A /proc/meminfo with 128 GiB total and 100 GiB available."""
    path = tmp_path / "meminfo"
    path.write_text(
        f"MemTotal:       {128 * GIB // KIB} kB\nMemFree:        {90 * GIB // KIB} kB\n"
        f"MemAvailable:   {100 * GIB // KIB} kB\nBuffers:           1024 kB\n",
        encoding="ascii",
    )
    return str(path)


# --- detection ---


def test_discrete_h100_is_not_unified_and_uses_the_card(meminfo):
    hw = detect_hardware(FakeRuntime(info=discrete_info(), free_bytes=70 * GIB), meminfo_path=meminfo, cpu_count=16)
    assert hw.device_name == "NVIDIA H100 80GB HBM3"
    assert hw.unified_memory is False
    assert hw.memory_kind.startswith("discrete")
    assert hw.gpu_memory_bytes == 80 * GIB
    assert hw.gpu_free_bytes == 70 * GIB
    assert hw.usable_memory_bytes == 80 * GIB
    assert hw.compute_capability == (9, 0)
    assert hw.bf16_supported is True
    assert hw.gpu_spec == "H100 SXM"
    assert hw.peak_tflops_bf16 == pytest.approx(989.4)
    assert hw.peak_tflops_fp16 == pytest.approx(989.4)
    assert hw.peak_tflops("bf16") == pytest.approx(989.4)
    assert hw.peak_tflops("no") == pytest.approx(494.7)  # fp32 weights, TF32 tensor cores (enable_tf32)
    assert hw.peak_tflops("no", tf32=False) == pytest.approx(67.0)  # plain FP32
    assert hw.cpu_cores == 16
    assert hw.host_ram_bytes == 128 * GIB
    assert hw.host_ram_available_bytes == 100 * GIB
    assert hw.hypothetical is False


def test_gh200_is_coherent_and_usable_memory_is_the_hbm(meminfo):
    hw = detect_hardware(FakeRuntime(info=gh200_info()), meminfo_path=meminfo, cpu_count=72)
    assert hw.unified_memory is True
    assert hw.memory_kind.startswith("coherent")
    assert hw.usable_memory_bytes == 96 * GIB  # the HBM; host RAM is extra
    assert hw.host_ram_bytes == 128 * GIB
    assert hw.gpu_spec == "GH200"
    assert hw.peak_tflops_bf16 == pytest.approx(989.4)


def test_gb10_is_integrated_and_usable_memory_is_host_ram_total(meminfo):
    hw = detect_hardware(FakeRuntime(info=gb10_info()), meminfo_path=meminfo, cpu_count=20)
    assert hw.unified_memory is True
    assert hw.memory_kind.startswith("integrated")
    assert hw.gpu_memory_bytes == 119 * GIB
    assert hw.usable_memory_bytes == 128 * GIB  # the shared memory, as the host sees it
    assert hw.gpu_spec == "GB10"
    assert hw.compute_capability == (12, 1)
    assert hw.bf16_supported is True


def test_gb10_without_meminfo_falls_back_to_the_device_total(tmp_path):
    hw = detect_hardware(FakeRuntime(info=gb10_info()), meminfo_path=str(tmp_path / "absent"), cpu_count=20)
    assert hw.host_ram_bytes is None
    assert hw.usable_memory_bytes == 119 * GIB


def test_unified_memory_comes_from_attributes_not_the_name(meminfo):
    # A card named like a discrete H100 but reporting integrated memory is treated as integrated.
    info = DeviceMemoryInfo(0, "NVIDIA H100 80GB HBM3", (9, 0), 80 * GIB, True, True, True, True, True)
    hw = detect_hardware(FakeRuntime(info=info), meminfo_path=meminfo)
    assert hw.unified_memory is True
    assert hw.usable_memory_bytes == 128 * GIB


def test_no_cuda_leaves_device_fields_empty_and_fills_the_host(meminfo):
    hw = detect_hardware(NoCudaRuntime(), meminfo_path=meminfo, cpu_count=8)
    assert hw.device_name is None
    assert hw.has_gpu is False
    assert hw.gpu_memory_bytes is None and hw.gpu_free_bytes is None and hw.usable_memory_bytes is None
    assert hw.compute_capability is None
    assert hw.bf16_supported is None
    assert hw.peak_tflops_bf16 is None and hw.peak_tflops_fp16 is None
    assert hw.peak_tflops_tf32 is None and hw.peak_tflops_fp32 is None
    assert hw.peak_tflops("no") is None
    assert hw.gpu_spec is None
    assert hw.unified_memory is False and hw.memory_kind == "none"
    assert hw.cpu_cores == 8
    assert hw.host_ram_bytes == 128 * GIB
    assert hw.host_ram_available_bytes == 100 * GIB
    assert hw.describe()[0].startswith("GPU: none")


def test_runtime_without_cuda_reports_no_gpu(meminfo):
    hw = detect_hardware(FakeRuntime(info=discrete_info(), cuda=False), meminfo_path=meminfo)
    assert hw.device_name is None and hw.host_ram_bytes == 128 * GIB


def test_missing_meminfo_gives_unknown_host_ram(tmp_path):
    hw = detect_hardware(NoCudaRuntime(), meminfo_path=str(tmp_path / "absent"))
    assert hw.host_ram_bytes is None and hw.host_ram_available_bytes is None
    assert hw.cpu_cores >= 1  # from the process's CPU affinity
    assert any("RAM unknown" in line for line in hw.describe())


def test_meminfo_without_memavailable(tmp_path):
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       1048576 kB\n", encoding="ascii")
    hw = detect_hardware(NoCudaRuntime(), meminfo_path=str(path))
    assert hw.host_ram_bytes == GIB
    assert hw.host_ram_available_bytes is None


def test_unknown_device_has_no_spec_and_no_peak(meminfo):
    info = DeviceMemoryInfo(0, "NVIDIA Mystery 9000", (9, 0), 48 * GIB, True, True, False, False, False)
    hw = detect_hardware(FakeRuntime(info=info), meminfo_path=meminfo)
    assert hw.gpu_spec is None
    assert hw.peak_tflops_bf16 is None and hw.peak_tflops_fp16 is None
    assert all(hw.peak_tflops(p, tf32=t) is None for p in ("bf16", "fp16", "no") for t in (True, False))
    assert hw.usable_memory_bytes == 48 * GIB
    assert any("not in the GPU table" in line for line in hw.describe())


def test_describe_names_gpu_memory_peak_and_host(meminfo):
    lines = detect_hardware(FakeRuntime(info=discrete_info()), meminfo_path=meminfo, cpu_count=16).describe()
    text = "\n".join(lines)
    assert "NVIDIA H100 80GB HBM3" in text and "H100 SXM" in text
    assert "80.0 GiB" in text and "989.4" in text and "16 CPU cores" in text
    assert "tf32 494.7" in text and "fp32 67" in text


def test_detect_uses_the_installed_runtime(meminfo):
    from simpletuner.hardware.runtime import use_runtime

    with use_runtime(FakeRuntime(info=gb10_info())):
        assert detect_hardware(meminfo_path=meminfo).gpu_spec == "GB10"


def test_hardware_info_is_frozen(meminfo):
    hw = detect_hardware(NoCudaRuntime(), meminfo_path=meminfo)
    assert isinstance(hw, HardwareInfo)
    with pytest.raises(AttributeError):
        hw.cpu_cores = 3  # type: ignore[misc]
    assert hw.as_dict()["host_ram_bytes"] == 128 * GIB


# --- lookup ---


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA GH200 144G HBM3e", "GH200"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("NVIDIA A100 80GB PCIe", "A100 80GB"),
        ("NVIDIA A30", "A30"),
        ("Tesla V100-SXM2-32GB", "V100 SXM2"),
        ("Tesla V100-PCIE-16GB", "V100 PCIe"),
        ("NVIDIA GeForce RTX 3090", "RTX 3090"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 5090", "RTX 5090"),
        ("NVIDIA GB10", "GB10"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA L40S", "L40S"),
        ("Tesla T4", "T4"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA A40", "A40"),
        ("NVIDIA GeForce RTX 4080", "RTX 4080"),
        ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada"),
        ("NVIDIA H200 NVL", "H200 NVL"),
    ],
)
def test_lookup_device_names(name, expected):
    assert lookup_gpu(name).name == expected


@pytest.mark.parametrize(
    "name, expected",
    [
        ("h100", "H100 SXM"),
        ("H100-PCIe", "H100 PCIe"),
        ("h100_sxm", "H100 SXM"),
        ("a100-80gb", "A100 80GB"),
        ("A100 40GB", "A100 40GB"),
        ("a100", "A100 40GB"),  # bare: the smaller (conservative) variant
        ("rtx4090", "RTX 4090"),
        ("RTX-3090", "RTX 3090"),
        ("5090", "RTX 5090"),
        ("gb10", "GB10"),
        ("DGX Spark", "GB10"),
        ("gh200", "GH200"),
        ("v100", "V100 SXM2"),
        ("l40s", "L40S"),
        ("a40", "A40"),
        ("rtx4080", "RTX 4080"),
        ("rtx-6000-ada", "RTX 6000 Ada"),
    ],
)
def test_lookup_cli_spellings(name, expected):
    assert lookup_gpu(name).name == expected
    assert resolve_gpu_name(name).name == expected


def test_bare_a100_follows_the_reported_memory():
    assert lookup_gpu("NVIDIA A100", memory_bytes=79 * GIB).name == "A100 80GB"
    assert lookup_gpu("NVIDIA A100", memory_bytes=39 * GIB).name == "A100 40GB"


@pytest.mark.parametrize(
    "name",
    [
        "",
        None,
        "NVIDIA Mystery 9000",
        "NVIDIA GeForce RTX 4090 D",  # a cut-down 4090: different peak, not a guess
        "NVIDIA GeForce RTX 3090 Ti",
        "NVIDIA RTX 4090 Laptop GPU",
        "NVIDIA GB200",  # not GB10, not B200
        "NVIDIA L40",  # not L40S
        "Tesla V100S-PCIE-32GB",
        "NVIDIA RTX A6000",  # Ampere workstation card
        "NVIDIA GeForce RTX 4080 SUPER",
    ],
)
def test_unknown_names_are_not_guessed(name):
    assert lookup_gpu(name) is None


def test_resolve_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        resolve_gpu_name("rtx9999")
    message = str(err.value)
    assert "'rtx9999'" in message
    for known in ("H100 SXM", "H100 PCIe", "GH200", "A100 80GB", "RTX 4090", "GB10", "B200"):
        assert known in message


def test_every_entry_matches_its_own_name():
    for spec in GPU_SPECS:
        assert lookup_gpu(spec.name) is spec
    assert known_gpu_names() == [spec.name for spec in GPU_SPECS]


# --- the table ---

REQUIRED = [
    "H100 SXM", "H100 PCIe", "H200", "GH200", "A100 40GB", "A100 80GB", "A30", "A10G", "A40", "L40S",
    "V100 SXM2", "T4", "RTX 3090", "RTX 4080", "RTX 4090", "RTX 5090", "RTX 6000 Ada", "B200", "GB10",
]  # fmt: skip


def test_required_entries_are_present():
    assert set(REQUIRED) <= set(known_gpu_names())
    assert len(set(known_gpu_names())) == len(GPU_SPECS)


@pytest.mark.parametrize("spec", GPU_SPECS, ids=lambda s: s.name)
def test_entry_is_well_formed(spec):
    assert spec.memory_gb and all(gb > 0 for gb in spec.memory_gb)
    assert list(spec.memory_gb) == sorted(spec.memory_gb)  # default variant first (smallest)
    assert spec.source
    assert spec.patterns and all(spec.patterns)
    for peak in (spec.bf16_tflops, spec.fp16_tflops):
        assert peak is None or peak > 0
    assert spec.fp16_tflops is not None  # every card in the table has FP16 tensor cores
    # BF16 and TF32 need Ampere (sm_80) or newer.
    assert (spec.bf16_tflops is not None) == (spec.compute_capability >= (8, 0))
    assert (spec.tf32_tflops is not None) == (spec.compute_capability >= (8, 0))
    # Every card has a plain FP32 peak; TF32 tensor cores run at half the 16-bit rate (or less;
    # datasheets round, e.g. L40S 183 vs 362.05 / 2) and never below plain FP32.
    assert spec.fp32_tflops > 0
    if spec.tf32_tflops is not None:
        assert spec.fp32_tflops <= spec.tf32_tflops <= spec.bf16_tflops / 2 * 1.02
    assert spec.integrated <= spec.unified


@pytest.mark.parametrize("name", ["V100 SXM2", "V100 PCIe", "T4"])
def test_pre_ampere_cards_have_no_bf16(name):
    spec = resolve_gpu_name(name)
    assert spec.bf16_tflops is None
    hw = hardware_for_gpu(spec)
    assert hw.bf16_supported is False and hw.peak_tflops_bf16 is None and hw.peak_tflops_fp16 > 0


def test_table_memory_variants():
    assert resolve_gpu_name("gh200").memory_gb == (96, 144)
    assert resolve_gpu_name("v100").memory_gb == (16, 32)
    assert resolve_gpu_name("a100-40gb").memory_gb == (40,)
    assert resolve_gpu_name("a100-80gb").memory_gb == (80,)


@pytest.mark.parametrize("name", ["V100 SXM2", "T4"])
def test_fp32_runs_before_ampere_use_the_fp32_peak_even_with_tf32_allowed(name):
    hw = hardware_for_gpu(name)
    assert hw.peak_tflops_tf32 is None
    assert hw.peak_tflops("no", tf32=True) == hw.peak_tflops("no", tf32=False) == resolve_gpu_name(name).fp32_tflops


@pytest.mark.parametrize(
    "name, bf16, tf32, fp32",
    [  # NVIDIA datasheet "with sparsity" figures halved (or the dense figure where one is printed)
        ("h100", 1979 / 2, 989 / 2, 67.0),
        ("h100-pcie", 1513 / 2, 756 / 2, 51.0),
        ("h200", 1979 / 2, 989 / 2, 67.0),
        ("gh200", 1979 / 2, 989 / 2, 67.0),
        ("a100-40gb", 312.0, 156.0, 19.5),
        ("a100-80gb", 312.0, 156.0, 19.5),
        ("a40", 299.4 / 2, 149.6 / 2, 37.4),
        ("l40s", 362.05, 366 / 2, 91.6),  # the datasheet prints 362.05 dense beside 733 sparse
        ("rtx4080", 97.5, 97.5 / 2, 48.7),
        ("rtx4090", 165.2, 165.2 / 2, 82.6),
        ("rtx5090", 209.5, 209.5 / 2, 104.8),
        ("rtx-6000-ada", 1457 / 4, 1457 / 8, 91.1),  # 1,457 = FP8 with sparsity
        ("b200", 4500 / 2, 2200 / 2, 75.0),
        ("gb10", 62.5, 62.5 / 2, 31.0),  # derived (NVIDIA publishes FP4 only); see the table's comment
    ],
)
def test_dense_peaks_per_precision(name, bf16, tf32, fp32):
    hw = hardware_for_gpu(name)
    assert hw.peak_tflops("bf16") == pytest.approx(bf16, rel=2e-3)
    assert hw.peak_tflops("no") == pytest.approx(tf32, rel=2e-3)  # enable_tf32 (the default)
    assert hw.peak_tflops("no", tf32=False) == pytest.approx(fp32, rel=2e-3)


def test_peaks_are_dense_not_sparse():
    # Datasheets print 2:4-sparsity figures (H100 SXM 1,979; A100 624); the table holds half.
    assert resolve_gpu_name("h100").bf16_tflops == pytest.approx(1979 / 2, rel=1e-3)
    assert resolve_gpu_name("a100").bf16_tflops == pytest.approx(624 / 2)
    assert resolve_gpu_name("h100").bf16_tflops > resolve_gpu_name("h100-pcie").bf16_tflops


# --- hypothetical machines ---


def test_hardware_for_gpu_uses_the_table():
    hw = hardware_for_gpu("h100")
    assert hw.hypothetical is True
    assert hw.device_name == "H100 SXM" and hw.gpu_spec == "H100 SXM"
    assert hw.gpu_memory_bytes == hw.usable_memory_bytes == hw.gpu_free_bytes == 80 * GIB
    assert hw.unified_memory is False and hw.memory_kind.startswith("discrete")
    assert hw.peak_tflops_bf16 == pytest.approx(989.4)
    assert hw.cpu_cores is None and hw.host_ram_bytes is None
    assert hw.describe()[0].startswith("GPU: hypothetical H100 SXM")


def test_hardware_for_gpu_memory_override():
    hw = hardware_for_gpu("rtx4090", gpu_memory_gb=20, cpu_cores=12, host_ram_bytes=64 * GIB)
    assert hw.gpu_memory_bytes == hw.usable_memory_bytes == 20 * GIB
    assert hw.cpu_cores == 12 and hw.host_ram_bytes == 64 * GIB
    assert hw.peak_tflops_bf16 == pytest.approx(165.2)
    with pytest.raises(ValueError, match="positive"):
        hardware_for_gpu("h100", gpu_memory_gb=0)


def test_hardware_for_gpu_memory_variant_from_the_name():
    assert hardware_for_gpu("v100-32gb").gpu_memory_bytes == 32 * GIB
    assert hardware_for_gpu("v100").gpu_memory_bytes == 16 * GIB
    assert hardware_for_gpu("gh200-144gb").gpu_memory_bytes == 144 * GIB


def test_hardware_for_superchips():
    gh200 = hardware_for_gpu("gh200")
    assert gh200.unified_memory is True and gh200.memory_kind.startswith("coherent")
    assert gh200.usable_memory_bytes == 96 * GIB  # the HBM
    assert gh200.host_ram_bytes == 480 * GIB and gh200.cpu_cores == 72
    gb10 = hardware_for_gpu("gb10")
    assert gb10.memory_kind.startswith("integrated")
    assert gb10.usable_memory_bytes == gb10.host_ram_bytes == gb10.gpu_memory_bytes == 119 * GIB
    gb10_override = hardware_for_gpu("gb10", gpu_memory_gb=100)
    assert gb10_override.usable_memory_bytes == gb10_override.host_ram_bytes == 100 * GIB


def test_hardware_for_unknown_gpu_raises():
    with pytest.raises(ValueError, match="unknown GPU 'mystery'"):
        hardware_for_gpu("mystery")


# --- MFU ---


def test_mfu_hand_checked():
    # 1e15 FLOPs in 2 s = 500 TFLOPS achieved; on a 1000 TFLOPS peak that is 0.5.
    assert achieved_tflops(1e15, 2.0) == pytest.approx(500.0)
    assert mfu(1e15, 2.0, 1000.0) == pytest.approx(0.5)
    # 6 * 1e9 params * 4096 tokens = 2.4576e13 FLOPs in 0.1 s on an H100 SXM (989.4).
    assert mfu(6 * 1e9 * 4096, 0.1, 989.4) == pytest.approx(245.76 / 989.4)
    assert mfu(0.0, 1.0, 100.0) == 0.0


@pytest.mark.parametrize(
    "flops, seconds, peak",
    [(1e15, 2.0, None), (1e15, 0.0, 1000.0), (1e15, -1.0, 1000.0), (1e15, 2.0, 0.0)],
)
def test_mfu_none_cases(flops, seconds, peak):
    assert mfu(flops, seconds, peak) is None


def test_achieved_tflops_edge_cases():
    assert achieved_tflops(1e15, 0.0) is None
    with pytest.raises(ValueError):
        achieved_tflops(-1.0, 1.0)


def test_mfu_with_detected_peak(meminfo):
    hw = detect_hardware(FakeRuntime(info=discrete_info()), meminfo_path=meminfo)
    assert mfu(989.4e12, 1.0, hw.peak_tflops("bf16")) == pytest.approx(1.0)
    unknown = detect_hardware(NoCudaRuntime(), meminfo_path=meminfo)
    assert mfu(1e15, 1.0, unknown.peak_tflops("bf16")) is None
