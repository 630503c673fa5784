"""CPU threads: the count a CPU run chooses from its cores, processes and the load; who wins over it; the
start-up line a CPU run logs."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from training_helpers import train

from simpletuner.configuration import ConfigError, validate_config
from simpletuner.training.cpu_threads import (
    cgroup_cpu_limit,
    choose_num_threads,
    decide_cpu_threads,
    local_processes,
    usable_cores,
    user_thread_request,
)


@pytest.mark.parametrize(
    ("usable", "processes", "load", "cores", "expected"),
    [
        (2, 1, 0.2, 2, 2),  # an idle 2-core box: both cores
        (2, 1, 0.6, 2, 1),  # 1.4 idle rounds to 1
        (2, 1, 1.3, 2, 1),  # one busy loop beside the run
        (2, 1, 12.0, 2, 1),  # the audit's busy box: never fewer than 1
        (16, 2, 0.5, 16, 8),  # two ranks share the idle cores evenly
        (16, 2, 8.0, 16, 4),  # half the machine busy: 8 idle cores, 4 per rank
        (16, 4, 0.0, 16, 4),
        (2, 4, 0.0, 2, 1),  # more processes than cores
        (4, 1, 0.0, 64, 4),  # an affinity of 4 cores on an idle 64-core machine
        (4, 1, 32.0, 64, 2),  # the machine's load taken as spread evenly: half of our 4 cores busy
        (2, 1, 60.0, 64, 1),
    ],
)
def test_thread_count_from_cores_processes_and_load(usable, processes, load, cores, expected):
    threads, why = choose_num_threads(usable, processes, load, cores)
    assert threads == expected
    assert f"load average {load:.2f}" in why and f"{usable} core(s) usable" in why


def test_usable_cores_follow_affinity_and_the_cgroup_quota(tmp_path):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("250000 100000\n")
    assert cgroup_cpu_limit(str(cpu_max)) == 2.5
    cpu_max.write_text("max 100000\n")
    assert cgroup_cpu_limit(str(cpu_max)) is None
    assert cgroup_cpu_limit(str(tmp_path / "absent")) is None
    assert usable_cores(affinity=8, quota=2.5) == 2  # whole cores of the quota
    assert usable_cores(affinity=2, quota=16.0) == 2
    assert usable_cores(affinity=8, quota=0.5) == 1
    assert local_processes({"LOCAL_WORLD_SIZE": "4"}) == 4 and local_processes({}) == 1


def test_an_omp_num_threads_the_user_set_counts_and_accelerates_own_does_not():
    env = {"OMP_NUM_THREADS": "3"}
    assert user_thread_request({}, launcher=None) is None
    assert user_thread_request(env, launcher=None) == ("3", "OMP_NUM_THREADS=3 in the environment")
    launcher = (4242, ["--num_processes", "1", "train.py"])
    # accelerate launch writes OMP_NUM_THREADS for every child: without it in its own environment, not a request
    assert user_thread_request(env, launcher, read_environ={4242: {"PATH": "/bin"}}.get) is None
    assert user_thread_request(env, launcher, read_environ={4242: {"OMP_NUM_THREADS": "3"}}.get)[0] == "3"
    assert user_thread_request(env, launcher, read_environ={}.get)[0] == "3"  # its environment unreadable
    flagged = (4242, ["--num_cpu_threads_per_process", "3", "train.py"])
    assert "--num_cpu_threads_per_process 3" in user_thread_request(env, flagged, read_environ={}.get)[1]


def _decide(setting=None, request=None, is_cuda=False, load=12.0):
    return decide_cpu_threads(
        setting, is_cuda=is_cuda, environ={}, request=request, load_average=load, num_usable_cores=2, num_cores=2
    )


def test_the_config_key_wins_then_the_users_variable_then_the_choice():
    auto = _decide()
    assert auto.num_threads == 1 and auto.level == logging.INFO
    assert "chosen for this CPU run" in auto.line and "load average 12.00" in auto.line
    env = _decide(request=("2", "OMP_NUM_THREADS=2 in the environment"))
    assert env.num_threads == 2 and "from OMP_NUM_THREADS=2 in the environment" in env.line
    assert "at this load the run would choose 1" in env.line  # the user's value stays, with the hint
    key = _decide(setting=3, request=("2", "OMP_NUM_THREADS=2 in the environment"))
    assert key.num_threads == 3 and "num_cpu_threads in the config; it overrides OMP_NUM_THREADS=2" in key.line
    odd = _decide(request=("4,2", "OMP_NUM_THREADS=4,2 in the environment"))
    assert odd.num_threads is None and "left to torch" in odd.line  # OpenMP's nested syntax: torch reads it
    cuda = _decide(is_cuda=True)
    assert cuda.num_threads is None and cuda.level == logging.DEBUG  # a GPU run keeps torch's default
    assert _decide(setting=4, is_cuda=True).num_threads == 4


def test_the_config_key_is_checked(make_config):
    assert validate_config(make_config(num_cpu_threads=2)).num_cpu_threads == 2
    assert validate_config(make_config()).num_cpu_threads is None
    with pytest.raises(ConfigError, match="num_cpu_threads"):
        validate_config(make_config(num_cpu_threads=0))


@pytest.fixture
def torch_threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_cpu_run_logs_and_uses_its_thread_count(make_config, tmp_path, monkeypatch, caplog, torch_threads_restored):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with caplog.at_level(logging.INFO, logger="simpletuner"):
        train(make_config(max_train_steps=1, output_dir=str(tmp_path / "auto")))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("CPU threads")]
    assert len(lines) == 1  # once, at start
    count = int(re.match(r"CPU threads: (\d+), chosen for this CPU run", lines[0])[1])
    assert "load average" in lines[0] and "num_cpu_threads" in lines[0]
    assert torch.get_num_threads() == count
    caplog.clear()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with caplog.at_level(logging.INFO, logger="simpletuner"):
        train(make_config(max_train_steps=1, num_cpu_threads=2, output_dir=str(tmp_path / "key")))
    assert "CPU threads: 2, from num_cpu_threads in the config; it overrides OMP_NUM_THREADS=1" in caplog.text
    assert torch.get_num_threads() == 2
