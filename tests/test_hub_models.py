"""A model named by its Hub id trains from the Hub cache (real huggingface_hub client, offline, a cache laid out as
the client lays it out); every way it cannot be had is one line naming the repo and the fix, before anything is
written to output_dir."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
from hub_fixtures import copy_folder_to_hub_cache, folder_files, lay_out_hub_cache

from simpletuner.cli.train import main as train_main
from simpletuner.hub import HubError, resolve_model

REPO_ID = "tiny-org/tiny-sd"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hub cache as this process's (HF_HUB_CACHE, read at each resolution), offline."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _config(make_config, tmp_path, **overrides) -> Path:
    raw = make_config(max_train_steps=1, pretrained_model_name_or_path=REPO_ID, **overrides)
    raw.pop("model_family", None)  # taken from the snapshot's model_index.json
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    return path


def test_a_hub_id_trains_from_the_hub_cache_offline(tiny_sd, hub_cache, make_config, tmp_path):
    commit = copy_folder_to_hub_cache(hub_cache, REPO_ID, tiny_sd)
    config = _config(make_config, tmp_path)
    assert train_main(["--config", str(config)]) == 0
    out = tmp_path / "output"
    log = (out / "training.log").read_text()
    snapshot = hub_cache / "models--tiny-org--tiny-sd" / "snapshots" / commit
    assert f"pretrained_model_name_or_path '{REPO_ID}' (revision main): the Hub snapshot" in log
    assert str(snapshot) in log and commit[:12] in log
    assert json.loads((out / "config.json").read_text())["pretrained_model_name_or_path"] == REPO_ID  # as written
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["identity"]["hub_model"] == f"{REPO_ID}@{commit}"
    first = orjson.loads((out / "metrics.jsonl").read_bytes().splitlines()[0])
    assert list(first["startup_s"])[:4] == ["interpreter", "config", "download", "imports"]


def test_only_the_files_the_family_loads_are_taken(tiny_sd, hub_cache):
    files = folder_files(tiny_sd)
    extra = {
        "safety_checker/model.safetensors": b"x" * 64,  # a component the sd family does not load
        "unet/diffusion_pytorch_model.fp16.safetensors": b"x" * 64,  # a precision variant
        "unet/diffusion_pytorch_model.bin": b"x" * 64,  # a pickle
        "v1-5-pruned.safetensors": b"x" * 64,  # a single-file checkpoint at the root
    }
    index = json.loads(
        files["model_index.json"]
        if isinstance(files["model_index.json"], bytes)
        else Path(files["model_index.json"]).read_bytes()
    )
    index["safety_checker"] = ["stable_diffusion", "StableDiffusionSafetyChecker"]
    lay_out_hub_cache(hub_cache, REPO_ID, {**files, **extra, "model_index.json": json.dumps(index).encode()})
    configs = resolve_model(REPO_ID)
    assert (configs.folder / "model_index.json").is_file()
    snapshot = resolve_model(REPO_ID, components=("unet", "vae", "text_encoder", "tokenizer", "scheduler"))
    assert snapshot.folder == configs.folder and snapshot.commit == configs.commit
    # offline the client returns the snapshot folder; the patterns decide what a download would fetch, so
    # check them on what they match
    from huggingface_hub.utils import filter_repo_objects

    from simpletuner.hub import CONFIG_PATTERNS, IGNORED_WEIGHTS

    wanted = [f"{c}/*" for c in ("unet", "vae", "text_encoder", "tokenizer", "scheduler")]
    taken = set(filter_repo_objects(list(files) + list(extra), allow_patterns=wanted, ignore_patterns=IGNORED_WEIGHTS))
    assert "unet/diffusion_pytorch_model.safetensors" in taken and "vae/diffusion_pytorch_model.safetensors" in taken
    assert not taken & set(extra)
    config_only = set(filter_repo_objects(list(files), allow_patterns=list(CONFIG_PATTERNS)))
    assert "model_index.json" in config_only and "unet/config.json" in config_only
    assert not any(name.endswith(".safetensors") for name in config_only)


def test_offline_with_nothing_cached_is_one_line_and_writes_nothing(hub_cache, make_config, tmp_path, capsys):
    config = _config(make_config, tmp_path)
    assert train_main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if "pretrained_model_name_or_path: " in ln)
    assert "is not in the Hub cache" in line and "HF_HUB_OFFLINE" in line and "hf download" in line
    assert not (tmp_path / "output").exists()


def test_offline_with_only_the_configs_cached_names_the_missing_weights(tiny_sd, hub_cache, make_config, tmp_path):
    configs_only = {k: v for k, v in folder_files(tiny_sd).items() if not k.endswith(".safetensors")}
    lay_out_hub_cache(hub_cache, REPO_ID, configs_only)
    with pytest.raises(HubError, match=r"no \.safetensors weights for unet, vae, text_encoder .*offline"):
        resolve_model(REPO_ID, components=("unet", "vae", "text_encoder", "tokenizer", "scheduler"))
    config = _config(make_config, tmp_path)
    assert train_main(["--config", str(config)]) == 2
    assert not (tmp_path / "output").exists()


def test_a_repo_without_model_index_is_not_a_pipeline(hub_cache):
    lay_out_hub_cache(hub_cache, "org/single-file", {"model.safetensors": b"x" * 16, "config.json": b"{}"})
    with pytest.raises(HubError, match="no model_index.json .* not a diffusers pipeline repo"):
        resolve_model("org/single-file")


def test_a_revision_not_in_the_cache_offline_names_it(tiny_sd, hub_cache):
    copy_folder_to_hub_cache(hub_cache, REPO_ID, tiny_sd)
    with pytest.raises(HubError, match=r"tiny-org/tiny-sd@v2 is not in the Hub cache"):
        resolve_model(REPO_ID, revision="v2")


def test_estimate_of_a_hub_model_reads_its_configs_only(tiny_sd, hub_cache, make_config, tmp_path, capsys):
    """The estimator needs the pipeline's configs: a cache holding nothing else is enough."""
    from simpletuner.cli import main

    configs_only = {k: v for k, v in folder_files(tiny_sd).items() if not k.endswith(".safetensors")}
    lay_out_hub_cache(hub_cache, REPO_ID, configs_only)
    config = _config(make_config, tmp_path)
    assert main(["estimate", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "total" in out.lower()


# --- online: the real client against a local Hub (tests/hub_server.py) ---------------------------------------
def test_online_only_the_family_files_are_downloaded_and_a_second_resolve_needs_no_request(tiny_sd, hub_server):
    extra = {
        "safety_checker/model.safetensors": b"x" * 64,
        "unet/diffusion_pytorch_model.fp16.safetensors": b"x" * 64,
        "unet/diffusion_pytorch_model.bin": b"x" * 64,
        "v1-5-pruned.safetensors": b"x" * 64,
    }
    commit = hub_server.add_repo(REPO_ID, {**folder_files(tiny_sd), **extra})
    components = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
    snapshot = resolve_model(REPO_ID, components=components)
    assert snapshot.commit == commit
    fetched = {p.relative_to(snapshot.folder).as_posix() for p in snapshot.folder.rglob("*") if p.is_file()}
    assert "unet/diffusion_pytorch_model.safetensors" in fetched and "model_index.json" in fetched
    assert not fetched & set(extra)
    downloads = [path for _, path in hub_server.requests if "/resolve/" in path]
    assert any("unet/diffusion_pytorch_model.safetensors" in path for path in downloads)
    assert not any(name in path for path in downloads for name in extra)
    before = len(hub_server.requests)
    import os

    offline = {**os.environ, "HF_HUB_OFFLINE": "1"}
    assert resolve_model(REPO_ID, components=components, environ=offline).folder == snapshot.folder
    assert len(hub_server.requests) == before  # served from the cache


@pytest.mark.parametrize(
    "setup, revision, words",
    [
        ({"gated": True}, None, "is gated on the Hub at"),
        (None, None, "no such model repo on the Hub at"),
        ({}, "v9", "revision 'v9' does not exist"),
    ],
)
def test_online_failures_are_one_line_naming_the_repo(tiny_sd, hub_server, setup, revision, words):
    if setup is not None:
        hub_server.add_repo(REPO_ID, folder_files(tiny_sd), **setup)
    with pytest.raises(HubError) as err:
        resolve_model(REPO_ID, revision=revision)
    text = str(err.value)
    assert REPO_ID in text and words in text and "\n" not in text
    assert hub_server.url in text


def test_online_a_hub_id_trains_and_its_config_is_checked_on_the_snapshot(tiny_sd, hub_server, make_config, tmp_path):
    commit = hub_server.add_repo(REPO_ID, folder_files(tiny_sd))
    config = _config(make_config, tmp_path)
    assert train_main(["--config", str(config)]) == 0
    state = json.loads((tmp_path / "output" / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["identity"]["hub_model"] == f"{REPO_ID}@{commit}"
    assert hub_server.unhandled == []


def test_resuming_against_another_commit_of_the_repo_is_refused_naming_both(
    tiny_sd, hub_cache, make_config, tmp_path, capsys
):
    first = copy_folder_to_hub_cache(hub_cache, REPO_ID, tiny_sd)
    config = _config(make_config, tmp_path, resume_from_checkpoint="latest")
    assert train_main(["--config", str(config)]) == 0
    files = folder_files(tiny_sd)
    files["README.md"] = b"a new commit on main"
    second = lay_out_hub_cache(hub_cache, REPO_ID, files)  # main moves on
    assert second != first
    assert train_main(["--config", str(config), "--set", "max_train_steps=2"]) == 2
    err = capsys.readouterr().err
    assert f"hub_model: checkpoint has '{REPO_ID}@{first}', config has '{REPO_ID}@{second}'" in err
    assert f"set `revision` to {first}" in err
    # which it does: the cache still holds the first snapshot
    assert train_main(["--config", str(config), "--set", "max_train_steps=2", "--set", f"revision={first}"]) == 0
