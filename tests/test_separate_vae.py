"""A separate VAE (``pretrained_vae_model_name_or_path``): a local folder or a hub id, its ``vae/`` subfolder before its
root; the latent cache is keyed by it; a VAE that does not fit the family is one line before anything is written; a hub
id resolves through the real huggingface_hub client (offline from a Hub cache laid out as the client lays it out, and
online against the local Hub of tests/hub_server.py) and its commit is in the run identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hub_fixtures import copy_folder_to_hub_cache, folder_files, lay_out_hub_cache, use_hub_cache
from training_helpers import train

from simpletuner.caching import ShardedTensorStore
from simpletuner.cli.train import main as train_main
from simpletuner.configuration import validate_config
from simpletuner.hub import HubError, resolve_vae, snapshot_of
from simpletuner.memory.components import vae_bytes, validation_model_bytes
from simpletuner.models import get_model_spec

VAE_REPO = "tiny-org/tiny-vae"
KEY = "pretrained_vae_model_name_or_path"
#: Files of a component repo a run never takes: a single-file checkpoint, a pickle, a precision variant.
EXTRAS = {
    "sdxl_vae.safetensors": b"x" * 64,
    "diffusion_pytorch_model.bin": b"x" * 64,
    "diffusion_pytorch_model.fp16.safetensors": b"x" * 64,
    "README.md": b"a tiny VAE",
}


@pytest.fixture(scope="module")
def write_vae(tiny_sd):
    """``write_vae(folder, seed, **config)``: an AutoencoderKL of the tiny SD's VAE config (``**config`` changed)
    with seeded random weights, saved at ``folder`` (config.json + diffusion_pytorch_model.safetensors) as a
    component repo such as madebyollin/sdxl-vae-fp16-fix holds one."""
    from diffusers import AutoencoderKL

    config = AutoencoderKL.load_config(tiny_sd, subfolder="vae")

    def write(folder: Path, seed: int, **overrides) -> Path:
        torch.manual_seed(seed)
        AutoencoderKL.from_config({**config, **overrides}).save_pretrained(folder, safe_serialization=True)
        return folder

    return write


@pytest.fixture(scope="module")
def vaes(write_vae, tmp_path_factory) -> dict[str, Path]:
    """Two VAEs of the tiny SD's shapes (``one``, ``two``: other weights) and others."""
    root = tmp_path_factory.mktemp("vaes")
    return {
        "one": write_vae(root / "one", seed=1),
        "two": write_vae(root / "two", seed=2),
        "eight_channels": write_vae(root / "eight", seed=3, latent_channels=8),
        "wider": write_vae(root / "wider", seed=4, block_out_channels=[8, 16, 16, 32]),
    }


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache as this process's, offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return use_hub_cache(monkeypatch, tmp_path / "hub")


def _config_file(make_config, tmp_path, **overrides) -> Path:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(make_config(max_train_steps=1, train_batch_size=1, **overrides)))
    return path


def _first_weight(module: torch.nn.Module) -> torch.Tensor:
    return next(iter(module.state_dict().values())).detach().clone()


def test_a_pipeline_folder_gives_its_vae_subfolder_before_its_root(make_config, write_vae, vaes, tmp_path):
    """SimpleTuner's order (common.py:2690-2703): ``subfolder="vae"`` first, then the root."""
    from diffusers import AutoencoderKL

    both = tmp_path / "both"
    write_vae(both, seed=1)  # a VAE at the root ...
    write_vae(both / "vae", seed=2)  # ... and one in vae/: this one loads
    spec = get_model_spec(validate_config(make_config(**{KEY: str(both)})))
    assert spec.vae_location().subfolder == "vae" and spec.vae_location().is_separate
    loaded = spec.load_vae(torch.device("cpu"), torch.float32)
    assert torch.equal(_first_weight(loaded), _first_weight(AutoencoderKL.from_pretrained(vaes["two"])))
    root_only = get_model_spec(validate_config(make_config(**{KEY: str(vaes["one"])})))
    assert root_only.vae_location().subfolder is None
    loaded = root_only.load_vae(torch.device("cpu"), torch.float32)
    assert torch.equal(_first_weight(loaded), _first_weight(AutoencoderKL.from_pretrained(vaes["one"])))
    # unset: the model folder's own vae/, and the identity it always had (caches made before the key stay valid)
    own = get_model_spec(validate_config(make_config()))
    assert own.vae_location().subfolder == "vae" and not own.vae_location().is_separate
    assert own.image_encoder_identity() == own._identity("vae")


def test_a_relative_vae_path_is_taken_from_the_config_files_folder(make_config, vaes, tmp_path):
    import shutil

    shutil.copytree(vaes["one"], tmp_path / "my-vae")
    config = _config_file(make_config, tmp_path, **{KEY: "my-vae"})
    from simpletuner.configuration import load_config

    assert load_config(config).config.pretrained_vae_model_name_or_path == str(tmp_path / "my-vae")


def test_the_latent_cache_is_keyed_by_the_vae(make_config, vaes, tmp_path):
    """Same model, two VAEs: other keys, the second run encodes again; the first VAE again: every latent a hit."""
    cache = tmp_path / "cache"
    runs = {}
    for name, vae in (("one", vaes["one"]), ("two", vaes["two"]), ("one again", vaes["one"])):
        raw = make_config(
            max_train_steps=1,
            train_batch_size=1,
            output_dir=str(tmp_path / name.replace(" ", "_")),
            cache_config={"cache_dir": str(cache)},
            **{KEY: str(vae)},
        )
        trainer, _ = train(raw)
        runs[name] = set(trainer.data.latent_keys.values())
        stored = set(ShardedTensorStore(cache / "sd" / "vae").keys())
        if name == "one":
            assert stored == runs["one"] and len(stored) == 12
        elif name == "two":
            assert not runs["two"] & runs["one"] and stored == runs["one"] | runs["two"]  # encoded again
        else:
            assert runs["one again"] == runs["one"] and len(stored) == 24  # every latent was there: nothing added


@pytest.mark.parametrize(
    "case, words",
    [
        ("missing", "does not exist"),
        ("no config", "holds no VAE config (neither vae/config.json nor config.json)"),
        ("a file", "is a file; it must be a folder holding a diffusers VAE"),
        ("wrong class", "names 'AutoencoderKLWan'; model family 'sd' loads its VAE as diffusers.AutoencoderKL"),
        ("eight channels", "makes 8-channel latents, but the sd denoiser of"),
    ],
)
def test_a_vae_that_does_not_fit_is_one_line_before_anything_is_written(
    case, words, make_config, vaes, tmp_path, capsys
):
    folder = tmp_path / "vae"
    if case == "no config":
        folder.mkdir()
        (folder / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    elif case == "a file":
        folder.write_bytes(b"a single-file checkpoint")
    elif case == "wrong class":
        import shutil

        shutil.copytree(vaes["one"], folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "_class_name": "AutoencoderKLWan"}))
    elif case == "eight channels":
        folder = vaes["eight_channels"]
    config = _config_file(make_config, tmp_path, **{KEY: str(folder)})
    assert train_main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if KEY in line]
    assert len(lines) == 1, err
    assert words in lines[0] and str(folder) in lines[0]
    assert "or remove the key to use the model's own VAE" in lines[0] or case == "a file"
    assert not (tmp_path / "output").exists()


def test_the_estimate_sizes_the_separate_vae(make_config, vaes):
    from diffusers import AutoencoderKL

    spec = get_model_spec(validate_config(make_config(**{KEY: str(vaes["wider"])})))
    weights = sum(p.numel() for p in AutoencoderKL.from_pretrained(vaes["wider"]).state_dict().values())
    assert vae_bytes(spec.vae_location(), torch.float32) == weights * 4
    own = get_model_spec(validate_config(make_config()))
    own_bytes = vae_bytes(own.vae_location(), torch.float32)
    assert own_bytes is not None and own_bytes != weights * 4
    # the validation models the trainer keeps on the GPU: the separate VAE, not the model's own
    prompt = {"validation_prompt": "a red square"}
    with_own = validation_model_bytes(validate_config(make_config(**prompt)))
    with_wider = validation_model_bytes(validate_config(make_config(**prompt, **{KEY: str(vaes["wider"])})))
    assert with_own is not None and with_wider == with_own - own_bytes + weights * 4


# --- hub ids, offline: a Hub cache laid out as huggingface_hub lays it out ---------------------------------------
def test_a_hub_vae_trains_from_the_hub_cache_and_a_resume_against_another_commit_is_refused(
    vaes, hub_cache, make_config, tmp_path, capsys
):
    first = lay_out_hub_cache(hub_cache, VAE_REPO, {**folder_files(vaes["one"]), **EXTRAS})
    config = _config_file(make_config, tmp_path, resume_from_checkpoint="latest", **{KEY: VAE_REPO})
    assert train_main(["--config", str(config)]) == 0
    out = tmp_path / "output"
    snapshot = hub_cache / "models--tiny-org--tiny-vae" / "snapshots" / first
    log = (out / "training.log").read_text()
    assert f"{KEY} '{VAE_REPO}' (revision main): the Hub snapshot" in log and str(snapshot) in log
    assert json.loads((out / "config.json").read_text())[KEY] == VAE_REPO  # the raw config keeps the id
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["identity"]["hub_vae"] == f"{VAE_REPO}@{first}"
    assert snapshot_of(snapshot) == (VAE_REPO, first)

    second = lay_out_hub_cache(hub_cache, VAE_REPO, {**folder_files(vaes["one"]), "README.md": b"main moved on"})
    assert train_main(["--config", str(config), "--set", "max_train_steps=2"]) == 2
    err = capsys.readouterr().err
    assert f"hub_vae: checkpoint has '{VAE_REPO}@{first}', config has '{VAE_REPO}@{second}'" in err
    assert f"set `{KEY}` to {snapshot}" in err
    # which loads it: the cache still holds the first snapshot
    assert train_main(["--config", str(config), "--set", "max_train_steps=2", "--set", f"{KEY}={snapshot}"]) == 0


def test_offline_with_nothing_cached_is_one_line_and_writes_nothing(hub_cache, make_config, tmp_path, capsys):
    config = _config_file(make_config, tmp_path, **{KEY: VAE_REPO})
    assert train_main(["--config", str(config)]) == 2
    line = next(ln for ln in capsys.readouterr().err.splitlines() if f"{KEY}: " in ln)
    assert f"{VAE_REPO} is not in the Hub cache" in line and f"point {KEY} at a local folder" in line
    assert not (tmp_path / "output").exists()


def test_a_repo_without_a_vae_config_and_one_without_weights_are_refused(vaes, hub_cache):
    lay_out_hub_cache(hub_cache, "org/single-file", {"sdxl_vae.safetensors": b"x" * 16})
    with pytest.raises(HubError, match=r"org/single-file has no config.json or vae/config.json .* not a diffusers VAE"):
        resolve_vae("org/single-file")
    configs_only = {k: v for k, v in folder_files(vaes["one"]).items() if not k.endswith(".safetensors")}
    lay_out_hub_cache(hub_cache, VAE_REPO, configs_only)
    assert resolve_vae(VAE_REPO).folder.is_dir()  # the config phase needs no weights
    with pytest.raises(HubError, match=r"no diffusion_pytorch_model.safetensors in its root \(offline"):
        resolve_vae(VAE_REPO, weights=True)


def test_estimate_with_a_hub_vae_reads_its_config_only(vaes, hub_cache, make_config, tmp_path, capsys):
    from simpletuner.cli import main

    configs_only = {k: v for k, v in folder_files(vaes["eight_channels"]).items() if k.endswith(".json")}
    lay_out_hub_cache(hub_cache, VAE_REPO, configs_only)
    config = _config_file(make_config, tmp_path, **{KEY: VAE_REPO})
    assert main(["estimate", "--config", str(config)]) == 2  # an 8-channel VAE for a 4-channel UNet: refused
    assert "makes 8-channel latents" in capsys.readouterr().err
    copy_folder_to_hub_cache(hub_cache, VAE_REPO, vaes["two"])  # main moves to a VAE that fits
    assert main(["estimate", "--config", str(config)]) == 0


# --- hub ids, online: the real client against the local Hub (tests/hub_server.py) -------------------------------
def test_online_only_the_vae_files_are_downloaded(vaes, hub_server, tmp_path):
    commit = hub_server.add_repo(VAE_REPO, {**folder_files(vaes["one"]), **EXTRAS})
    configs = resolve_vae(VAE_REPO)
    assert configs.commit == commit and (configs.folder / "config.json").is_file()
    assert not (configs.folder / "diffusion_pytorch_model.safetensors").exists()  # configs first
    snapshot = resolve_vae(VAE_REPO, configs.commit, weights=True)
    fetched = {p.relative_to(snapshot.folder).as_posix() for p in snapshot.folder.rglob("*") if p.is_file()}
    assert fetched == {"config.json", "diffusion_pytorch_model.safetensors"}
    assert hub_server.unhandled == []
    # a pipeline repo as the VAE: only its vae/ folder
    pipeline = {f"vae/{k}": v for k, v in folder_files(vaes["two"]).items()}
    hub_server.add_repo("org/pipeline", {**pipeline, "model_index.json": b"{}", "unet/x.safetensors": b"x" * 64})
    snapshot = resolve_vae("org/pipeline", weights=True)
    fetched = {p.relative_to(snapshot.folder).as_posix() for p in snapshot.folder.rglob("*") if p.is_file()}
    assert fetched == {"vae/config.json", "vae/diffusion_pytorch_model.safetensors"}


def test_online_a_missing_repo_is_one_line_naming_it(hub_server):
    with pytest.raises(HubError) as err:
        resolve_vae("org/no-such-vae")
    text = str(err.value)
    assert "org/no-such-vae" in text and "no such model repo on the Hub at" in text and "\n" not in text
