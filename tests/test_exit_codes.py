"""An unexpected error ends with the internal-error code, never one with a documented meaning."""

from __future__ import annotations

import simpletuner.cli.train as train
from simpletuner import exit_codes


def test_a_bug_in_train_exits_70_with_what_to_report(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise AttributeError("'_AutocastForward' object has no attribute 'config'")

    monkeypatch.setattr(train, "run_training", broken)
    assert train.main(["--config", "cfg.json"]) == exit_codes.INTERNAL_ERROR == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and "AttributeError" in err
    assert "internal error in `simpletuner train`" in err and "simpletuner diagnose" in err


def test_user_errors_keep_their_code(tmp_path, capsys):
    assert train.main(["--config", str(tmp_path / "missing.json")]) == exit_codes.BAD_INPUT
    assert "does not exist" in capsys.readouterr().err


def test_codes_are_distinct():
    codes = [
        exit_codes.OK,
        exit_codes.DOES_NOT_FIT,
        exit_codes.BAD_INPUT,
        exit_codes.NON_FINITE,
        exit_codes.OUT_OF_MEMORY,
        exit_codes.NO_SPACE,
        exit_codes.INTERNAL_ERROR,
    ]
    assert len(set(codes)) == len(codes)


def test_piping_into_head_is_not_an_internal_error(tmp_path):
    """`simpletuner estimate --preset gh200 | head -1` ends quietly, not with a bug report."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom simpletuner.exit_codes import report_internal_error\n"
        "try:\n    [print('line', i) for i in range(200000)]\n"
        "except BaseException as exc:\n    sys.exit(report_internal_error(exc, 'estimate'))\n"
    )
    proc = subprocess.run(
        f'{sys.executable} -c "{code}" | head -1', shell=True, capture_output=True, text=True, timeout=60
    )
    assert proc.stdout == "line 0\n"
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_full_disk_rank_zero_reported_is_printed_once(monkeypatch, capsys, tmp_path):
    """Rank 0 ran out of space and every rank raised the same NoSpace: only rank 0 prints it; a rank
    that ran out of space itself prints its own. Every rank exits 5."""
    from simpletuner.diskspace import NoSpace

    def full(agreed):
        def run(*args, **kwargs):
            raise NoSpace("checkpoint-4", tmp_path, 10**9, 10**6, during_write=True, agreed=agreed)

        return run

    for rank, agreed, printed in [("0", False, True), ("1", True, False), ("1", False, True)]:
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr(train, "run_training", full(agreed))
        assert train.main(["--config", "cfg.json"]) == exit_codes.NO_SPACE == 5
        err = capsys.readouterr().err
        assert ("not enough disk space for checkpoint-4: needs ~1.0 GB" in err) is printed, (rank, agreed, err)
        assert "Traceback" not in err
