"""The GH200 diagnostic against fake runtimes, as a real script, and the environment setup script."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
from fake_cuda import FakeRuntime, discrete_info, gb10_info, gh200_info

from simpletuner.cli import diagnose
from simpletuner.cli.diagnose import main
from simpletuner.gh200 import diagnostic
from simpletuner.hardware.host import collect_host, parse_meminfo
from simpletuner.hardware.runtime import NoCudaRuntime, use_runtime

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "setup_gh200_env.sh"
MIB = 1024**2
SETUP_VARS = (
    "SIMPLETUNER_GH200_UVM_HINTS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
)
#: Read by the script but never set by it: cleared from the environment of its test shells too.
CLEARED_VARS = ("SIMPLETUNER_GH200_ENABLE_UVM_HINTS",)


def run_json(capsys, argv=("--json",)):
    code = main(list(argv))
    return code, json.loads(capsys.readouterr().out)


def small(info, total=8 * MIB):
    """A fake device of ``total`` bytes, so the oversubscription test allocates a few real bytes."""
    return FakeRuntime(info=dataclasses.replace(info, total_bytes=total))


def test_no_cuda_reports_what_is_missing_and_exits_0(capsys):
    with use_runtime(NoCudaRuntime()):
        code, summary = run_json(capsys)
        assert code == 0
        assert summary["device"] is None
        missing = " | ".join(m["what"] for m in summary["versions"]["missing"])
        assert "cuda-bindings not installed" in missing
        assert "has no CUDA" in missing or "no CUDA device" in missing
        assert summary["managed_pool"]["status"].startswith("no CUDA device")
        assert not any(v["ready"] for v in summary["verdicts"])
        assert summary["host"]["cpu_count"] >= 1

        assert main([]) == 0
        report = capsys.readouterr().out
    assert "install a CUDA build of PyTorch" in report and "no CUDA device" in report and "== verdict ==" in report


@pytest.mark.parametrize("preset", [gh200_info, gb10_info])
def test_unified_device_fills_the_device_section(capsys, preset):
    fake = FakeRuntime(info=preset(), free_bytes=5 * 1024**3)
    with use_runtime(fake):
        code, summary = run_json(capsys)
    assert code == 0
    device = summary["device"]
    assert device["name"] == preset().name and device["unified"] is True
    assert device["total_bytes"] == preset().total_bytes and device["free_bytes"] == 5 * 1024**3
    assert device["integrated"] is preset().integrated and device["kind"] == preset().kind
    assert summary["managed_pool"]["status"] == "available"
    assert summary["versions"]["missing"] == []
    assert "oversubscription" not in summary and fake.calls == []


@pytest.mark.parametrize("preset", [gh200_info, gb10_info])
def test_oversubscription_allocates_prefetches_both_ways_and_frees(capsys, preset):
    fake = small(preset())
    with use_runtime(fake):
        code, summary = run_json(capsys, ["--json", "--oversubscription-scale", "0.001"])
    assert code == 0
    over = summary["oversubscription"]
    requested = int(0.001 * 8 * MIB)
    assert over["status"] == "ok" and over["requested_bytes"] == requested
    assert sum(c.nbytes for c in fake.ops("managed_alloc")) == requested
    prefetches = fake.ops("prefetch")
    assert [c.location for c in prefetches] == [0, "cpu"]
    assert all(c.nbytes == requested for c in prefetches)
    assert fake.synchronized >= 3
    assert over["gb_per_s"]["to_gpu"] > 0 and over["gb_per_s"]["to_cpu"] > 0


def test_oversubscription_chunks_and_frees_even_on_error():
    fake = small(gh200_info(), total=10 * MIB)
    with use_runtime(fake):
        result = diagnostic.run_oversubscription(fake, 1.5, chunk_bytes=4 * MIB)
    assert result["num_chunks"] == 4
    assert [c.nbytes for c in fake.ops("managed_alloc")] == [4 * MIB, 4 * MIB, 4 * MIB, 3 * MIB]
    assert len(fake.ops("prefetch")) == 8

    @dataclasses.dataclass
    class Interrupted(FakeRuntime):
        """Remembers its tensors weakly and is interrupted (Ctrl-C) at the first prefetch."""

        alive_at_cleanup: int = -1
        refs: list = dataclasses.field(default_factory=list)

        def managed_empty(self, shape, dtype):
            tensor = super().managed_empty(shape, dtype)
            self.refs.append(weakref.ref(tensor))
            return tensor

        def prefetch(self, tensor, location, stream=None):
            del tensor  # the traceback keeps this frame: hold no chunk here
            raise KeyboardInterrupt

        def cuda_available(self):  # asked in the cleanup, after the chunks should be gone
            self.alive_at_cleanup = sum(ref() is not None for ref in self.refs)
            return False

    broken = Interrupted(info=dataclasses.replace(gh200_info(), total_bytes=MIB))
    with pytest.raises(KeyboardInterrupt):
        diagnostic.run_oversubscription(broken, 2.0, chunk_bytes=MIB // 2)
    assert len(broken.refs) == 4
    assert broken.alive_at_cleanup == 0, "managed chunks still referenced when the cache was emptied"


def test_discrete_gpu_refuses_without_force(capsys):
    fake = small(discrete_info())
    with use_runtime(fake):
        code = main(["--json", "--oversubscription-scale", "0.001"])
    out = capsys.readouterr()
    assert code == 2
    assert "discrete" in out.err and "hang" in out.err and "--force" in out.err
    assert json.loads(out.out)["oversubscription"]["status"] == "refused"
    assert fake.ops("managed_alloc") == []


def test_discrete_gpu_runs_with_force_after_a_warning(capsys):
    fake = small(discrete_info())
    with use_runtime(fake):
        code = main(["--oversubscription-scale", "0.001", "--force"])
    out = capsys.readouterr()
    assert code == 0
    assert "WARNING: --force" in out.err
    assert fake.ops("managed_alloc") and [c.location for c in fake.ops("prefetch")] == [0, "cpu"]
    assert "prefetch to GPU" in out.out and "GB/s" in out.out


def test_refuses_more_than_the_machine_can_back(capsys, monkeypatch):
    host = {"cpu_count": 72, "cpu_affinity": 72, "ram_total_bytes": 480 * 1024**3, "ram_available_bytes": 100 * 1024**3}
    monkeypatch.setattr(diagnose, "collect_host", lambda meminfo_path=None: host)
    fake = FakeRuntime(info=gh200_info())  # 96 GiB device
    with use_runtime(fake):
        code = main(["--oversubscription-scale", "100"])
    assert code == 2
    assert "lower --oversubscription-scale" in capsys.readouterr().err
    assert fake.ops("managed_alloc") == []


def test_no_gpu_skips_the_oversubscription_test(capsys):
    with use_runtime(NoCudaRuntime()):
        code, summary = run_json(capsys, ["--json", "--oversubscription-scale", "1.5"])
    assert code == 0 and summary["oversubscription"]["status"] == "skipped"


def test_alloc_conf_warning_for_keys_pytorch_rejects(capsys, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "use_uvm:True,expandable_segments:True")
    with use_runtime(FakeRuntime()):
        _, summary = run_json(capsys)
    env = summary["environment"]
    assert env["variables"]["PYTORCH_CUDA_ALLOC_CONF"] == "use_uvm:True,expandable_segments:True"
    [warning] = env["warnings"]
    assert "key(s) use_uvm that a stock PyTorch rejects" in warning and "remove them" in warning
    assert any(not v["ready"] and "rejects: use_uvm" in v["what"] for v in summary["verdicts"])
    assert diagnostic.alloc_conf_problems("expandable_segments:True,max_split_size_mb:128") == []


def test_parse_meminfo_and_missing_file(tmp_path):
    text = "MemTotal:       16384 kB\nMemFree:  1 kB\nMemAvailable:    8192 kB\nHugePages_Total:       0\n"
    assert parse_meminfo(text) == {"ram_total_bytes": 16384 * 1024, "ram_available_bytes": 8192 * 1024}
    host = collect_host(str(tmp_path / "absent"))
    assert host["ram_total_bytes"] is None and host["cpu_count"] >= 1


@pytest.mark.parametrize("scale", ["0", "-1", "abc", "inf"])
def test_invalid_scale_is_an_argparse_error(scale):
    with pytest.raises(SystemExit) as exc:
        main(["--oversubscription-scale", scale])
    assert exc.value.code == 2


def test_top_level_script_prints_json(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "gh200_diagnostic.py"), "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert {"versions", "device", "host", "environment", "managed_pool", "verdicts"} <= summary.keys()
    if summary["device"] is None:
        assert summary["versions"]["missing"]


# --- scripts/setup_gh200_env.sh ---


def bash(script: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in SETUP_VARS + CLEARED_VARS}
    return subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=60
    )


def test_setup_script_sets_defaults_and_prints_them():
    result = bash(f'source "{SETUP}" && echo "rc=$?" && env')
    assert result.returncode == 0, result.stderr
    values = dict(
        line.split("=", 1)
        for line in result.stdout.splitlines()
        if "=" in line and not line.startswith(("set ", "kept "))
    )
    assert values["SIMPLETUNER_GH200_UVM_HINTS"] == "1"
    assert values["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert diagnostic.alloc_conf_problems(values["PYTORCH_CUDA_ALLOC_CONF"]) == []
    assert 1 <= int(values["OMP_NUM_THREADS"]) <= 72 and values["MKL_NUM_THREADS"] == values["OMP_NUM_THREADS"]
    assert values["TOKENIZERS_PARALLELISM"] == "false"
    assert "rc=0" in result.stdout
    for name in SETUP_VARS:
        assert f"set   {name}=" in result.stdout


def test_setup_script_keeps_what_the_user_set():
    result = bash(f'source "{SETUP}" && echo "OMP=$OMP_NUM_THREADS"', OMP_NUM_THREADS="3", PYTORCH_CUDA_ALLOC_CONF="")
    assert result.returncode == 0, result.stderr
    assert "kept  OMP_NUM_THREADS=3" in result.stdout and "OMP=3" in result.stdout
    assert "kept  PYTORCH_CUDA_ALLOC_CONF=" in result.stdout  # set to empty counts as set
    assert "set   MKL_NUM_THREADS=" in result.stdout


def test_setup_script_executed_exits_1():
    result = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "must be sourced" in result.stderr
    assert os.access(SETUP, os.X_OK)


def test_setup_script_leaks_no_helpers():
    names = "compgen -A variable; compgen -A function"
    script = (
        f'set -u; before=$({names}); source "{SETUP}" >/dev/null; after=$({names}); '
        'diff <(echo "$before" | sort) <(echo "$after" | sort | grep -v "^before$")'
    )
    result = bash(script)
    added = {line[2:] for line in result.stdout.splitlines() if line.startswith("> ")}
    assert added == set(SETUP_VARS), result.stdout + result.stderr


@pytest.mark.gpu
def test_real_runtime_reports_the_device(capsys):
    code, summary = run_json(capsys)
    assert code == 0
    assert summary["device"] is not None and summary["device"]["total_bytes"] > 0
    assert summary["versions"]["cuda_build"] is not None


# --- allocator keys of the GH200 fork's patched PyTorch (seed 001), and the hint variable's alias ---

FORK_VALUE = "use_uvm:True,uvm_oversubscription_ratio:5.0, uvm_access_pattern:gpu_first,expandable_segments:True"


@pytest.mark.parametrize("exported", [True, False], ids=["exported", "shell-variable"])
def test_setup_script_catches_fork_allocator_keys_and_prints_the_fix(exported):
    from simpletuner.configuration.alloc_conf import FORK_ONLY_KEYS, check_alloc_conf

    assign = f'export PYTORCH_CUDA_ALLOC_CONF="{FORK_VALUE}"' if exported else f'PYTORCH_CUDA_ALLOC_CONF="{FORK_VALUE}"'
    result = bash(f'{assign}; source "{SETUP}"; echo "rc=$?"; echo "now=$PYTORCH_CUDA_ALLOC_CONF"')
    assert "rc=1" in result.stdout  # a `source ... && accelerate launch ...` chain stops here
    assert f"kept  PYTORCH_CUDA_ALLOC_CONF={FORK_VALUE}" in result.stdout and f"now={FORK_VALUE}" in result.stdout
    assert "refuses to start CUDA with this value" in result.stderr
    lines = result.stderr.splitlines()
    for error in check_alloc_conf(FORK_VALUE).errors():  # the same words as the trainer and estimate
        assert f"  {error}" in lines
    for key, advice in FORK_ONLY_KEYS.items():
        assert f"`{key}`" in result.stderr and advice in result.stderr
    assert '  Run: export PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"' in lines


def test_setup_script_fix_is_unset_when_nothing_else_remains():
    result = bash(f'source "{SETUP}"; echo "rc=$?"', PYTORCH_CUDA_ALLOC_CONF="use_uvm:True")
    assert "rc=1" in result.stdout
    assert "  Run: unset PYTORCH_CUDA_ALLOC_CONF" in result.stderr.splitlines()


@pytest.mark.parametrize(
    "value", ["expandable_segments:True", "", "max_split_size_mb:128, garbage_collection_threshold:0.8"]
)
def test_setup_script_is_quiet_about_accepted_allocator_keys(value):
    result = bash(f'source "{SETUP}"; echo "rc=$?"', PYTORCH_CUDA_ALLOC_CONF=value)
    assert "rc=0" in result.stdout and result.stderr == ""


def test_setup_script_accepts_exactly_the_keys_python_accepts():
    from simpletuner.configuration.alloc_conf import CUDA_ALLOC_CONF_KEYS, check_alloc_conf

    accepted = ",".join(f"{key}:1" for key in CUDA_ALLOC_CONF_KEYS)
    assert bash(f'source "{SETUP}"', PYTORCH_CUDA_ALLOC_CONF=accepted).stderr == ""
    unknown = "foo:1,expandable_segments:True,bar_mb:2"
    result = bash(f'source "{SETUP}"; echo "rc=$?"', PYTORCH_CUDA_ALLOC_CONF=unknown)
    assert "rc=0" in result.stdout  # unknown to us is not known to be refused: a warning
    [warning] = check_alloc_conf(unknown).warnings()
    assert result.stderr.splitlines() == [f"WARNING {warning}"]


def test_setup_script_keeps_the_forks_hint_variable_instead_of_adding_the_other_name():
    result = bash(
        f'source "{SETUP}"; echo "rc=$?"; echo "canonical=${{SIMPLETUNER_GH200_UVM_HINTS-unset}}"',
        SIMPLETUNER_GH200_ENABLE_UVM_HINTS="0",
    )
    assert "rc=0" in result.stdout and "canonical=unset" in result.stdout
    assert "kept  SIMPLETUNER_GH200_ENABLE_UVM_HINTS=0" in result.stdout


def test_setup_script_flags_disagreeing_hint_variables():
    result = bash(
        f'source "{SETUP}"; echo "rc=$?"', SIMPLETUNER_GH200_UVM_HINTS="1", SIMPLETUNER_GH200_ENABLE_UVM_HINTS="off"
    )
    assert "rc=1" in result.stdout
    assert "SIMPLETUNER_GH200_UVM_HINTS=1 and SIMPLETUNER_GH200_ENABLE_UVM_HINTS=off disagree" in result.stderr
    agreeing = bash(
        f'source "{SETUP}"; echo "rc=$?"', SIMPLETUNER_GH200_UVM_HINTS="1", SIMPLETUNER_GH200_ENABLE_UVM_HINTS="true"
    )
    assert "rc=0" in agreeing.stdout and agreeing.stderr == ""


def test_diagnostic_says_what_replaces_each_fork_key(capsys, monkeypatch):
    from simpletuner.configuration.alloc_conf import FORK_ONLY_KEYS

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", FORK_VALUE)
    with use_runtime(FakeRuntime()):
        _, summary = run_json(capsys)
    env = summary["environment"]
    assert env["unsupported_alloc_conf_keys"] == ["use_uvm", "uvm_oversubscription_ratio", "uvm_access_pattern"]
    [warning] = env["warnings"]
    assert all(f"`{key}`: {advice}" in warning for key, advice in FORK_ONLY_KEYS.items())
    assert 'export PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"' in warning
    [verdict] = [v for v in summary["verdicts"] if "PYTORCH_CUDA_ALLOC_CONF" in v["what"]]
    assert not verdict["ready"] and verdict["fix"].startswith(
        'export PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"'
    )


def test_diagnostic_reports_the_hint_alias_and_a_conflict(capsys, monkeypatch):
    monkeypatch.delenv("SIMPLETUNER_GH200_UVM_HINTS", raising=False)
    monkeypatch.setenv("SIMPLETUNER_GH200_ENABLE_UVM_HINTS", "1")
    with use_runtime(FakeRuntime()):
        _, summary = run_json(capsys)
        assert summary["environment"]["variables"]["SIMPLETUNER_GH200_ENABLE_UVM_HINTS"] == "1"
        assert summary["environment"]["uvm_hints"] == {
            "requested": True,
            "source": "SIMPLETUNER_GH200_ENABLE_UVM_HINTS=1",
            "error": None,
        }
        assert any(
            v["ready"] and v["what"].startswith("SIMPLETUNER_GH200_ENABLE_UVM_HINTS=1") for v in summary["verdicts"]
        )

        monkeypatch.setenv("SIMPLETUNER_GH200_UVM_HINTS", "0")
        code, summary = run_json(capsys)
    assert code == 3  # the report is still written; the conflict is a failed verdict
    hints = summary["environment"]["uvm_hints"]
    assert hints["requested"] is None and "disagree" in hints["error"]
    assert hints["error"] in summary["environment"]["warnings"]
    [verdict] = [v for v in summary["verdicts"] if "disagree" in v["what"]]
    assert verdict["ready"] is False and verdict["fix"] == "unset SIMPLETUNER_GH200_ENABLE_UVM_HINTS"
