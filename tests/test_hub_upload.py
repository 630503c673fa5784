"""Uploads to the Hub (push_to_hub, push_checkpoints_to_hub, `simpletuner push`) against a local Hub server that the
real huggingface_hub client commits to: what reaches the repo, the card, retries, a failing Hub that never fails
the run, the pre-flight refusals (before anything is written), and a stop signal while the upload runs."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from hub_fixtures import folder_files

from simpletuner.cli import main as simpletuner_main
from simpletuner.cli.train import main as train_main
from simpletuner.training import publish

BASE = "tiny-org/tiny-sd"
REPO = "test-user/shapes-lora"
WEIGHTS = "pytorch_lora_weights.safetensors"


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setattr(publish, "RETRY_DELAYS", (0.01, 0.01))


def _config(make_config, tmp_path: Path, **overrides) -> Path:
    raw = make_config(**{"max_train_steps": 4, "hub_model_id": REPO, "push_to_hub": True, **overrides})
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    return path


def _commits(hub_server, repo=REPO):
    return [c for c in hub_server.commits if c.repo_id == repo]


def test_a_finished_lora_run_reaches_the_hub_with_its_card_and_checkpoints(
    hub_server, make_config, tiny_sd, tmp_path, monkeypatch
):
    from diffusers import StableDiffusionPipeline
    from huggingface_hub import ModelCard

    monkeypatch.setenv("HF_TOKEN", hub_server.token)
    hub_server.add_repo(BASE, folder_files(tiny_sd))
    config = _config(
        make_config,
        tmp_path,
        pretrained_model_name_or_path=BASE,
        push_checkpoints_to_hub=True,
        checkpointing_steps=2,
        validation_prompt="a red circle",
        validation_steps=2,
        validation_num_inference_steps=1,
        model_card_note="made in a test",
    )
    assert train_main(["--config", str(config)]) == 0
    out = tmp_path / "output"
    assert hub_server.repo(REPO).private  # model_card_private: true by default
    messages = [c.message for c in _commits(hub_server)]
    assert messages == [
        "checkpoint-2: LoRA after 2 steps, trained with simpletuner",
        "checkpoint-4: LoRA after 4 steps, trained with simpletuner",
        "LoRA after 4 steps, trained with simpletuner",
    ]
    files = hub_server.repo_files(REPO)
    assert files[WEIGHTS] == (out / WEIGHTS).read_bytes()
    assert files[f"checkpoint-2/{WEIGHTS}"] == (out / "checkpoint-2" / WEIGHTS).read_bytes()
    assert files["simpletuner_config.json"] == (out / "config.json").read_bytes()
    assert files["assets/step_000004_0.png"] == (out / "validation" / "step_000004_0.png").read_bytes()
    assert files["checkpoint-2/assets/step_000002_grid.png"] == (out / "validation/step_000002_grid.png").read_bytes()
    assert not any(name.startswith("checkpoint-2/optimizer") for name in files)  # a LoRA: the adapter, not the state
    card = ModelCard(files["README.md"].decode())
    assert card.data.base_model == BASE and "simpletuner" in card.data.tags
    assert "made in a test" in card.text and REPO in card.text
    assert (out / "README.md").read_bytes() == files["README.md"]
    assert not (out / publish.STAGING).exists()
    assert hub_server.unhandled == []
    log = (out / "training.log").read_text()
    assert f"uploaded the final weights to {hub_server.url}/{REPO}" in log

    # the adapter loads from the repo through diffusers, as the card says (the real client, from the server)
    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd)
    before = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    pipe.load_lora_weights(REPO, weight_name=WEIGHTS)
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # the fused weights stay, under the base names again
    changed = [k for k, v in pipe.unet.state_dict().items() if k in before and not (v == before[k]).all()]
    assert changed, "the uploaded adapter changed no weight"


def test_a_failed_commit_is_retried(hub_server, make_config, tmp_path, monkeypatch, fast_retries):
    monkeypatch.setenv("HF_TOKEN", hub_server.token)
    hub_server.fail("POST", "/commit/", 503, times=1)
    assert train_main(["--config", str(_config(make_config, tmp_path))]) == 0
    out = tmp_path / "output"
    assert [c.message for c in _commits(hub_server)] == ["LoRA after 4 steps, trained with simpletuner"]
    assert hub_server.repo_files(REPO)[WEIGHTS] == (out / WEIGHTS).read_bytes()
    log = (out / "training.log").read_text()
    assert "Hub upload of the final weights failed (attempt 1 of 3" in log


def test_a_hub_that_keeps_failing_never_fails_the_run_and_push_uploads_it_later(
    hub_server, make_config, tmp_path, monkeypatch, fast_retries, capsys
):
    monkeypatch.setenv("HF_TOKEN", hub_server.token)
    hub_server.fail("POST", "/commit/", 503, times=3)
    config = _config(make_config, tmp_path, checkpointing_steps=2, push_checkpoints_to_hub=True)
    assert train_main(["--config", str(config)]) == 0  # checkpoint-2's upload failed 3 times; the rest went up
    out = tmp_path / "output"
    assert (out / WEIGHTS).is_file()
    log = (out / "training.log").read_text()
    manual = f"simpletuner push {out} --repo {REPO} --checkpoint 2"
    assert "Hub upload of checkpoint-2 to" in log and "3 attempts failed" in log and manual in log
    assert [c.message.split(":")[0] for c in _commits(hub_server)] == [
        "checkpoint-4",
        "LoRA after 4 steps, trained with simpletuner",
    ]
    capsys.readouterr()
    assert simpletuner_main(["push", str(out), "--checkpoint", "2"]) == 0
    assert hub_server.repo_files(REPO)[f"checkpoint-2/{WEIGHTS}"] == (out / "checkpoint-2" / WEIGHTS).read_bytes()
    assert f"uploaded checkpoint-2 of {out} to {hub_server.url}/{REPO}" in capsys.readouterr().out
    # a finished run to another repo, public
    assert simpletuner_main(["push", str(out), "--repo", "test-user/again", "--public"]) == 0
    assert not hub_server.repo("test-user/again").private
    assert hub_server.repo_files("test-user/again")[WEIGHTS] == (out / WEIGHTS).read_bytes()
    # and a failing Hub: exit 6, the failure said (a repo that has the files already would get no commit at all)
    hub_server.fail("POST", "/commit/", 503, times=3)
    assert simpletuner_main(["push", str(out), "--repo", "test-user/third"]) == 6
    assert "3 attempts failed" in capsys.readouterr().err


@pytest.mark.parametrize(
    "case, words",
    [
        ("no_token", "no Hugging Face token on this machine: log in with `hf auth login`"),
        ("read_token", "the token on this machine is read-only"),
        ("bad_token", "does not accept the token on this machine"),
        ("other_namespace", "may not create or write that repo"),
        ("offline", "HF_HUB_OFFLINE is set, so nothing can be uploaded"),
        ("unreachable", "cannot be reached"),
    ],
)
def test_an_upload_that_cannot_work_stops_before_anything_is_written(
    hub_server, make_config, tmp_path, monkeypatch, capsys, case, words
):
    repo = "someone-else/lora" if case == "other_namespace" else REPO
    token = {"no_token": None, "read_token": "hf_read", "bad_token": "hf_wrong"}.get(case, hub_server.token)
    hub_server.read_tokens.add("hf_read")
    hub_server.writable_namespaces = set()
    if token is not None:
        monkeypatch.setenv("HF_TOKEN", token)
    if case == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if case == "unreachable":
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    config = _config(make_config, tmp_path, hub_model_id=repo)
    assert train_main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert words in err and repo in err, err
    assert not (tmp_path / "output").exists()
    assert not _commits(hub_server, repo)


def test_push_checkpoints_to_hub_needs_push_to_hub(make_config):
    from simpletuner.configuration import ConfigError, validate_config

    with pytest.raises(ConfigError, match="push_checkpoints_to_hub needs push_to_hub: true"):
        validate_config(make_config(push_checkpoints_to_hub=True))
    config = validate_config(make_config(push_to_hub=True, hub_model_id="https://huggingface.co/me/lora/tree/main"))
    assert config.hub_repo_id == "me/lora"
    assert validate_config(make_config(tracker_project_name="shapes")).hub_repo_id == "shapes"
    with pytest.raises(ConfigError, match="'a/b/c' is not a repo id"):
        validate_config(make_config(hub_model_id="a/b/c"))


def test_uploads_run_beside_training_unless_asked_to_wait(hub_server, tmp_path):
    from huggingface_hub import HfApi, create_repo

    from simpletuner.hub import UploadTarget

    create_repo("test-user/held", token=hub_server.token)
    target = UploadTarget("test-user/held", hub_server.token, hub_server.url)
    out = tmp_path / "run"
    out.mkdir()
    (out / "a.bin").write_bytes(b"abc")
    job = publish.UploadJob("a file", ((out / "a.bin", "a.bin"), (b"card", "README.md")), "one", "by hand")
    release = hub_server.hold("POST", "/commit/")
    api = HfApi(endpoint=hub_server.url, token=hub_server.token)
    background = publish.Publisher(target, out / publish.STAGING, api=api)
    background.submit(job)  # returns while the commit is held
    (out / "a.bin").unlink()  # retention removing the file meanwhile changes nothing: the job's copy is staged
    assert not background.uploaded
    release.set()
    assert background.finish() and hub_server.repo_files("test-user/held")["a.bin"] == b"abc"
    assert not (out / publish.STAGING).exists()

    (out / "b.bin").write_bytes(b"b")
    release = hub_server.hold("POST", "/commit/")
    waiting = publish.Publisher(target, out / publish.STAGING, background=False, api=api)
    done = threading.Event()
    job = publish.UploadJob("b", ((out / "b.bin", "b.bin"),), "two", "by hand")
    thread = threading.Thread(target=lambda: (waiting.submit(job), done.set()))
    thread.start()
    assert not done.wait(0.5)  # push_to_hub_background false: the caller waits for the commit
    release.set()
    thread.join(30)
    assert done.is_set() and waiting.uploaded and waiting.finish()


def test_a_stop_signal_during_the_upload_keeps_the_weights_and_says_how_to_upload(
    hub_server, make_config, tmp_path, monkeypatch, capsys
):
    from simpletuner.faults import reset_fault_counts

    monkeypatch.setenv("HF_TOKEN", hub_server.token)
    monkeypatch.setenv("SIMPLETUNER_FAULT", "phase:upload:SIGINT")
    reset_fault_counts()
    assert train_main(["--config", str(_config(make_config, tmp_path))]) == 130
    err = capsys.readouterr().err
    assert (
        "stopped by SIGINT during the Hub upload: the final weights are saved; upload them with `simpletuner push`"
        in err
    )
    assert (tmp_path / "output" / WEIGHTS).is_file() and not _commits(hub_server)


def test_a_full_fine_tune_pushed_later_loads_from_the_repo(hub_server, make_config, tmp_path, monkeypatch):
    from diffusers import UNet2DConditionModel
    from huggingface_hub import ModelCard

    raw = make_config(max_train_steps=2, training_type="full", learning_rate=1e-4, tracker_project_name="shapes-full")
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(raw))
    assert train_main(["--config", str(config)]) == 0  # no push_to_hub: nothing is checked or sent
    assert not hub_server.commits
    monkeypatch.setenv("HF_TOKEN", hub_server.token)
    out = tmp_path / "output"
    assert simpletuner_main(["push", str(out)]) == 0  # the repo: tracker_project_name under the token's account
    repo = "test-user/shapes-full"
    files = hub_server.repo_files(repo)
    local = sorted(p.relative_to(out).as_posix() for p in (out / "unet").rglob("*") if p.is_file())
    assert local and all(files[name] == (out / name).read_bytes() for name in local)
    assert not any(name.startswith("checkpoint-") for name in files)
    card = ModelCard(files["README.md"].decode())
    assert card.data.base_model is None and "full" in " ".join(card.data.tags)  # a local base: no base_model
    unet = UNet2DConditionModel.from_pretrained(repo, subfolder="unet")  # from the server, as the card says
    mine = UNet2DConditionModel.from_pretrained(out / "unet")
    assert all((a == b).all() for a, b in zip(unet.state_dict().values(), mine.state_dict().values()))


def test_only_rank_0_checks_the_upload(make_config, tmp_path, monkeypatch):
    """Another rank (another node of a launch) needs no token and no network: only rank 0 uploads."""
    from simpletuner.cli.train import _check_hub_upload
    from simpletuner.configuration import ConfigError
    from simpletuner.configuration.loader import load_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # uploads cannot work here
    loaded = load_config(_config(make_config, tmp_path))
    monkeypatch.setenv("RANK", "1")
    assert _check_hub_upload(loaded) is None
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        _check_hub_upload(loaded)
