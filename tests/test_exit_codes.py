"""An unexpected error ends with the internal-error code, never one with a documented meaning."""

from __future__ import annotations

import simpletuner.train as train
from simpletuner import exit_codes


def test_a_bug_in_train_exits_70_with_what_to_report(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise AttributeError("'_AutocastForward' object has no attribute 'config'")

    monkeypatch.setattr(train, "run", broken)
    assert train.main(["--config", "cfg.json"]) == exit_codes.INTERNAL_ERROR == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and "AttributeError" in err
    assert "internal error in `simpletuner train`" in err and "simpletuner diagnose" in err


def test_user_errors_keep_their_code(tmp_path, capsys):
    assert train.main(["--config", str(tmp_path / "missing.json")]) == exit_codes.BAD_INPUT
    assert "does not exist" in capsys.readouterr().err


def test_codes_are_distinct():
    codes = [exit_codes.OK, exit_codes.DOES_NOT_FIT, exit_codes.BAD_INPUT, exit_codes.NON_FINITE,
             exit_codes.OUT_OF_MEMORY, exit_codes.INTERNAL_ERROR]
    assert len(set(codes)) == len(codes)
