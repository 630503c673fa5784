"""SimpleTuner's upload keys read through the real translation: a config.json that uploads loads as a native
config with SimpleTuner's meaning (its background default written and reported, checkpoint uploads without
`push_to_hub` ignored as SimpleTuner ignores them, a huggingface.co URL read as its repo id)."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path

import pytest
from test_dialect import _project  # SimpleTuner's working directory: config/config.json, a model, a dataset

from simpletuner.configuration import load_config, validate_config
from simpletuner.configuration.errors import ConfigError
from simpletuner.configuration.simpletuner import translate as dialect

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def project(tmp_path, tiny_sd, shapes_dir, monkeypatch):
    """Write a SimpleTuner project with ``config`` merged in (a new folder each call); the working directory is
    its folder."""
    made = itertools.count()

    def write(config: dict) -> Path:
        path = _project(tmp_path / str(next(made)), tiny_sd, shapes_dir, config)
        monkeypatch.chdir(path.parent.parent)
        return path

    return write


def _defaults_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().lstrip().startswith("default:")]


def test_an_uploading_config_validates_with_its_values(project, caplog):
    path = project(
        {
            "--push_to_hub": "true",
            "--push_checkpoints_to_hub": "true",
            "--push_to_hub_background": "true",
            "--hub_model_id": "me/shapes-lora",
            "--model_card_private": False,
            "--model_card_note": "Trained on coloured shapes.",
            "--model_card_safe_for_work": "true",
        }
    )
    with caplog.at_level(logging.INFO, logger="simpletuner.configuration.loader"):
        config = load_config(path).config
    assert (config.push_to_hub, config.push_checkpoints_to_hub, config.push_to_hub_background) == (True, True, True)
    assert config.hub_model_id == config.hub_repo_id == "me/shapes-lora"
    assert config.model_card_private is False and config.model_card_safe_for_work is True
    assert config.model_card_note == "Trained on coloured shapes."
    assert not any("push_to_hub_background" in line for line in _defaults_logged(caplog))


def test_uploads_keep_simpletuners_defaults_where_the_config_is_silent(project, caplog):
    with caplog.at_level(logging.INFO, logger="simpletuner.configuration.loader"):
        config = load_config(project({"--push_to_hub": True})).config
    # SimpleTuner waits for checkpoint uploads unless asked not to (publishing.py:115): so does the translation
    assert config.push_to_hub is True and config.push_to_hub_background is False
    assert any("`push_to_hub_background: False`" in line for line in _defaults_logged(caplog))
    # the rest of SimpleTuner's upload defaults are ours: a private repo, the not-for-all-audiences tag, no note
    assert config.model_card_private is True and config.model_card_safe_for_work is False
    assert config.model_card_note is None and config.push_checkpoints_to_hub is False


def test_a_config_that_does_not_upload_gets_no_upload_default(project, caplog):
    with caplog.at_level(logging.INFO, logger="simpletuner.configuration.loader"):
        config = load_config(project({"--push_to_hub": False})).config
    assert config.push_to_hub is False and config.push_to_hub_background is True  # ours: unused without uploads
    assert not any("push_to_hub_background" in line for line in _defaults_logged(caplog))
    native, _ = dialect.translate(json.loads(project({}).read_text()), None, Path.cwd())
    assert not {"push_to_hub", "push_to_hub_background"} & set(native)


def test_checkpoint_uploads_without_push_to_hub_are_ignored_not_refused(project):
    # SimpleTuner's upload returns before any request without push_to_hub (helpers/publishing/huggingface.py:236)
    for push in ({"--push_to_hub": "false"}, {"--push_to_hub": False}, {"--push_to_hub": None}):
        path = project({"--push_checkpoints_to_hub": "true", **push})
        config = load_config(path).config
        assert config.push_to_hub is False and config.push_checkpoints_to_hub is False
        _, report = dialect.translate(json.loads(path.read_text()), path, path.parent.parent)
        assert any(line.startswith("`push_checkpoints_to_hub` (without `push_to_hub`") for line in report.ignored)
    # a native config saying the same is refused: the translation is what keeps SimpleTuner's meaning
    native, _ = dialect.translate(json.loads(project({}).read_text()), None, Path.cwd())
    with pytest.raises(ConfigError, match="push_checkpoints_to_hub needs push_to_hub"):
        validate_config({**native, "push_checkpoints_to_hub": True}, check_files=False)


@pytest.mark.parametrize(
    "written",
    [
        "https://huggingface.co/me/shapes-lora",
        "huggingface.co/me/shapes-lora",
        "https://huggingface.co/me/shapes-lora?library=diffusers",
        " me/shapes-lora ",
    ],
)
def test_a_url_hub_model_id_is_read_as_its_id(project, written):
    path = project({"--push_to_hub": "true", "--hub_model_id": written})
    native, _ = dialect.translate(json.loads(path.read_text()), path, Path.cwd())
    assert native["hub_model_id"] == "me/shapes-lora"  # what `simpletuner convert` writes
    assert load_config(path).config.hub_repo_id == "me/shapes-lora"


@pytest.mark.parametrize("written", [None, "", "  ", "None", "null"])
def test_unset_hub_model_id_uploads_to_the_tracker_project(project, written):
    path = project({"--push_to_hub": True, "hub_model_id": written, "tracker_project_name": "shapes-project"})
    config = load_config(path).config
    assert config.hub_model_id is None and config.hub_repo_id == "shapes-project"
    _, report = dialect.translate(json.loads(path.read_text()), path, Path.cwd())
    said = [line for line in report.notes if line.startswith("`hub_model_id:")]
    # "None" / "null" are SimpleTuner's own text for a repo name: the note says the translation reads them as unset
    assert len(said) == (1 if isinstance(written, str) and written.strip() else 0)


def test_a_hub_model_id_that_is_not_a_repo_id_stops_naming_it(project):
    with pytest.raises(ConfigError) as raised:
        load_config(project({"--push_to_hub": True, "hub_model_id": "me/shapes/lora"}))
    assert "hub_model_id" in str(raised.value) and "org/name" in str(raised.value)


def test_no_note_of_the_dialect_says_uploads_or_downloads_are_missing():
    gone = ("does not upload", "downloads nothing", "not part of this trainer")
    for entry in dialect.DIALECT:
        assert not any(text in entry.note for text in gone), f"{entry.key}: {entry.note}"
    doc = (REPO / "documentation" / "MIGRATING_FROM_SIMPLETUNER.md").read_text()
    assert not any(text in doc for text in gone)
    assert "simpletuner push" in doc


def test_a_string_false_keeps_the_repo_private_and_says_so(project, caplog):
    """SimpleTuner's reader skips the string "false" (cli_utils.py:225), so its default (private, publishing.py:151)
    applies there; here too, and the translation says so as a forced setting."""
    path = project({"--push_to_hub": "true", "--hub_model_id": "me/lora", "--model_card_private": "false"})
    with caplog.at_level(logging.INFO, logger="simpletuner.configuration.loader"):
        config = load_config(path).config
    assert config.model_card_private is True
    forced = [r.getMessage() for r in caplog.records if "SimpleTuner setting forced" in r.getMessage()]
    assert any('`model_card_private: "false"` (a string) -> true' in line for line in forced)
