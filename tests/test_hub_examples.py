"""SimpleTuner's published example configs, byte for byte, train here from a Hub cache that holds their models and
dataset (tiny stand-ins under the same Hub ids), offline, through the real huggingface_hub client.

The examples are read from a checkout of SimpleTuner at ``SIMPLETUNER_COMMIT`` (``SIMPLETUNER_SOURCE``, default
/work/st; its ``simpletuner/examples/``), which this project does not ship: without one these tests are skipped.
Each is copied unchanged into a working directory laid out as SimpleTuner's configs name their files
(``config/examples/<example>/`` beside the ``config/examples/multidatabackend-*.json`` dataloaders; paths resolve
from the working directory) and run with the real command, ``simpletuner train --config <its config.json>``.
Only what CPU time forces is changed, with ``--set`` on the command line (:data:`CPU_OVERRIDES`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hub_fixtures import copy_folder_to_hub_cache, lay_out_hub_cache, repo_folder, use_hub_cache

from simpletuner.cli import main

#: A checkout of SimpleTuner at SIMPLETUNER_COMMIT (as tests/test_dialect_same_rows.py reads it).
SIMPLETUNER_SOURCE = Path(os.environ.get("SIMPLETUNER_SOURCE", "/work/st"))
EXAMPLES = SIMPLETUNER_SOURCE / "simpletuner" / "examples"

#: For the examples this project reconstructs (:func:`_reconstruction`): the others need the checkout.
needs_checkout = pytest.mark.skipif(
    not EXAMPLES.is_dir(), reason=f"no SimpleTuner checkout at {SIMPLETUNER_SOURCE} (set SIMPLETUNER_SOURCE)"
)

#: The Hub dataset every dreambooth example trains on (multidatabackend-small-dreambooth-{512,1024}px.json).
DATASET = "RareConcepts/Domokun"
#: The Hub dataset of the ControlNet dataloaders (multidatabackend-controlnet-{128,512,1024}px.json), which the
#: Kontext example trains on too.
CONTROLNET_DATASET = "keras-dreambooth/minercraft"
#: The Hub models the examples below name: by `pretrained_model_name_or_path`, or by their family's default
#: flavour where they name none (flux: `krea`; sdxl: `base-1.0`) -> the tiny zoo model standing in for it.
MODELS = {
    "Lykon/dreamshaper-8": "sd",
    "black-forest-labs/flux.1-krea-dev": "flux",
    "black-forest-labs/flux.1-kontext-dev": "flux_kontext",
    "stabilityai/stable-diffusion-xl-base-1.0": "sdxl",
}

#: The VAE SimpleTuner's sdxl configs load when they name none (its field registry's default).
SDXL_VAE = "madebyollin/sdxl-vae-fp16-fix"

#: What CPU time forces, as `--set` overrides on the command line (our key names: `--set` applies to the config
#: as translated from SimpleTuner's dialect). Everything else is the example's own.
CPU_OVERRIDES = {
    # the examples train 100 steps; one step shows the run loads, trains, checkpoints and saves its adapter
    "max_train_steps": 1,
    # validation still runs (at the start and the end, at the example's resolution), one denoising step instead
    # of the example's 20 (sd1x) or 16 (flux)
    "validation_num_inference_steps": 1,
}

_HF_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
#: The dataset card `push_to_hub` writes for a one-shard image dataset.
_DATASET_CARD = b"""---
dataset_info:
  features:
  - name: image
    dtype: image
  splits:
  - name: train
    num_examples: 3
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
---
"""


def _image_shard(images: Path) -> bytes:
    """A Parquet shard as `push_to_hub` writes an image dataset: one `image` column of `{bytes, path}`."""
    rows = [{"bytes": p.read_bytes(), "path": p.name} for p in sorted(images.glob("*.png"))]
    out = io.BytesIO()
    pq.write_table(pa.table({"image": pa.array(rows, type=_HF_IMAGE)}), out)
    return out.getvalue()


def _four_block_flux(tiny: Path, out: Path) -> Path:
    """The tiny flux with two double-stream and two single-stream blocks (random weights, seed 0): the TREAD
    example's route, blocks 2 to the one before last, is then one block (the first single-stream one)."""
    from diffusers import FluxTransformer2DModel

    shutil.copytree(tiny, out)
    config = dict(FluxTransformer2DModel.load_config(out, subfolder="transformer"))
    config.update(num_layers=2, num_single_layers=2)
    shutil.rmtree(out / "transformer")
    torch.manual_seed(0)
    FluxTransformer2DModel.from_config(config).save_pretrained(out / "transformer", safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def hub_repos(tmp_path_factory, zoo) -> tuple[Path, dict[str, str]]:
    """A Hub cache holding every repo the examples below name, and ``{repo id: commit}`` (the tests read it only).

    The dataset's three images (a square, a landscape and a portrait one, 768 px and more) are big enough for both
    dreambooth dataloaders: 512 px square crops with a 128 px minimum, 1024 px pixel_area crops with 256."""
    from simpletuner.testing.demo_data import write_shapes_dataset

    root = tmp_path_factory.mktemp("hub-examples")
    cache = root / "hub"
    folders = {name: zoo(name) for name in MODELS.values()}
    folders["flux"] = _four_block_flux(folders["flux"], root / "flux")
    commits = {repo: copy_folder_to_hub_cache(cache, repo, folders[name]) for repo, name in MODELS.items()}
    # SimpleTuner's default VAE (sdxl configs that leave pretrained_vae_model_name_or_path out train with it): a
    # component repo, config.json and weights at its root
    commits[SDXL_VAE] = copy_folder_to_hub_cache(cache, SDXL_VAE, zoo("sdxl") / "vae")
    images = write_shapes_dataset(root / "images", num_images=3, sizes=((768, 768), (1024, 768), (768, 1024)))
    files: dict[str, bytes | Path] = {
        "README.md": _DATASET_CARD,
        ".gitattributes": b"*.parquet filter=lfs diff=lfs merge=lfs -text\n",
        "data/train-00000-of-00001.parquet": _image_shard(images),
    }
    commits[DATASET] = lay_out_hub_cache(cache, DATASET, files, repo_type="dataset")
    blocks = write_shapes_dataset(root / "blocks", num_images=2, seed=3, sizes=((640, 512), (512, 512)))
    files = {**files, "data/train-00000-of-00001.parquet": _image_shard(blocks)}
    commits[CONTROLNET_DATASET] = lay_out_hub_cache(cache, CONTROLNET_DATASET, files, repo_type="dataset")
    return cache, commits


@pytest.fixture
def hub_cache(hub_repos, monkeypatch) -> Path:
    """The module's Hub cache as this test's default (HF_HUB_CACHE), offline (HF_HUB_OFFLINE=1)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return use_hub_cache(monkeypatch, hub_repos[0])


def _project(tmp_path: Path, example: str, monkeypatch) -> Path:
    """A SimpleTuner working directory (the current one from here on) holding the example's folder and every
    dataloader JSON under ``config/examples/``, copied byte for byte from the checkout (without one: this project's
    reconstruction, :func:`_reconstruction`); the example's config.json, relative."""
    root = tmp_path / "simpletuner"
    examples = root / "config" / "examples"
    if EXAMPLES.is_dir():
        shutil.copytree(EXAMPLES / example, examples / example)
        for path in EXAMPLES.glob("multidatabackend-*.json"):
            shutil.copyfile(path, examples / path.name)
    else:
        config, dataloader = _reconstruction(example)
        (examples / example).mkdir(parents=True)
        (examples / example / "config.json").write_text(json.dumps(config, indent=2))
        (examples / "multidatabackend-small-dreambooth-512px.json").write_text(json.dumps(dataloader, indent=2))
    monkeypatch.chdir(root)
    return Path("config", "examples", example, "config.json")


def _reconstruction(example: str) -> tuple[dict, list]:
    """This project's own reconstruction of sd1x-dreamshaper.peft-lora (config.json and the small-dreambooth 512 px
    dataloader it names) at SimpleTuner bc8e6ab, for machines without a checkout: tests/test_dialect_examples.py's
    reconstruction with the Hub ids and the Hub dataset the published files name."""
    from test_dialect_examples import _dreambooth, _sd1x

    assert example == "sd1x-dreamshaper.peft-lora", f"no reconstruction of {example}: it needs the checkout"
    config, _ = _sd1x("Lykon/dreamshaper-8")
    config["data_backend_config"] = "config/examples/multidatabackend-small-dreambooth-512px.json"
    dataloader = _dreambooth(512, "pixel", 128)
    dataloader[0].pop("instance_data_dir")
    dataloader[0].update(type="huggingface", dataset_name=DATASET, metadata_backend="huggingface")
    return config, dataloader


def _train(config: Path, caplog) -> Path:
    """``simpletuner train --config <config> --set ...`` (CPU_OVERRIDES) succeeds; the output folder it names."""
    overrides = [arg for key, value in CPU_OVERRIDES.items() for arg in ("--set", f"{key}={json.dumps(value)}")]
    with caplog.at_level(logging.INFO, logger="simpletuner"):
        assert main(["train", "--config", str(config), *overrides]) == 0
    return Path(json.loads(config.read_text())["output_dir"]).resolve()


def _check_the_run_names_its_hub_snapshots(out: Path, cache: Path, commits: dict[str, str], model: str) -> None:
    """The run's log names the model's and the dataset's snapshots (their commits); the run's config keeps the Hub
    ids, not the snapshot folders, and its identity the model's commit."""
    log = (out / "training.log").read_text()
    snapshot = repo_folder(cache, model) / "snapshots" / commits[model]
    assert f"pretrained_model_name_or_path '{model}' (revision main): the Hub snapshot" in log
    assert f"{model}@main (commit {commits[model][:12]}) in {snapshot}" in log
    snapshot = repo_folder(cache, DATASET, "dataset") / "snapshots" / commits[DATASET]
    assert f"Hub dataset {DATASET}@main (commit {commits[DATASET][:12]}), split train: 1 Parquet file(s)" in log
    assert str(snapshot) in log
    assert "dataset 'dreambooth-512': 3 samples (0 skipped files), buckets {'512x512': 3}" in log
    run_config = json.loads((out / "config.json").read_text())
    assert run_config["pretrained_model_name_or_path"] == model
    assert {key: run_config[key] for key in CPU_OVERRIDES} == CPU_OVERRIDES  # the `--set` values, nothing else
    assert [d.get("dataset_name") for d in run_config["datasets"]] == [DATASET]
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["global_step"] == 1 and state["identity"]["hub_model"] == f"{model}@{commits[model]}"


def _check_the_validation_images(out: Path, size: tuple[int, int]) -> None:
    """Validation ran before the first step and after the last, at the example's `validation_resolution`."""
    from PIL import Image

    for step in (0, 1):
        with Image.open(out / "validation" / f"step_{step:06d}_0.png") as image:
            assert image.size == size


def _check_the_adapter_loads(pipeline_cls, model: str, cache: Path, out: Path, denoiser: str, rank: int) -> None:
    """The saved LoRA loads with diffusers' ``load_lora_weights`` onto the pipeline the Hub id names (from the Hub
    cache, offline): every tensor of the file lands in the denoiser, at the example's rank."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(out / "pytorch_lora_weights.safetensors")
    assert weights and all(key.startswith(f"{denoiser}.") for key in weights)
    pipe = pipeline_cls.from_pretrained(model, cache_dir=cache, use_safetensors=True)
    pipe.load_lora_weights(str(out), adapter_name="example")
    loaded = get_peft_model_state_dict(getattr(pipe, denoiser), adapter_name="example")
    assert len(loaded) == len(weights)
    assert {t.shape[0] for key, t in loaded.items() if "lora_A" in key} == {rank}


@pytest.mark.slow
def test_sd1x_dreamshaper_example_trains_from_the_hub_cache(tmp_path, hub_repos, hub_cache, monkeypatch, caplog):
    """sd1x-dreamshaper.peft-lora: `Lykon/dreamshaper-8` (and `model_flavour: dreamshaper`, the same repo), the
    512 px dreambooth dataloader over `RareConcepts/Domokun`."""
    from diffusers import StableDiffusionPipeline

    _, commits = hub_repos
    config = _project(tmp_path, "sd1x-dreamshaper.peft-lora", monkeypatch)
    out = _train(config, caplog)
    assert out == tmp_path / "simpletuner" / "output" / "examples" / "sd1x-dreamshaper.peft-lora"
    _check_the_run_names_its_hub_snapshots(out, hub_cache, commits, "Lykon/dreamshaper-8")
    _check_the_validation_images(out, (512, 512))
    _check_the_adapter_loads(StableDiffusionPipeline, "Lykon/dreamshaper-8", hub_cache, out, "unet", rank=16)


@needs_checkout
@pytest.mark.slow
def test_flux_example_trains_its_familys_default_model_from_the_hub_cache(
    tmp_path, hub_repos, hub_cache, monkeypatch, caplog
):
    """flux.peft-lora names no model: SimpleTuner's default flux flavour, `krea`, is
    `black-forest-labs/flux.1-krea-dev`; int8 weights (`int8-quanto`), the 512 px dreambooth dataloader."""
    from diffusers import FluxPipeline

    _, commits = hub_repos
    config = _project(tmp_path, "flux.peft-lora", monkeypatch)
    assert "pretrained_model_name_or_path" not in json.loads(config.read_text())
    out = _train(config, caplog)
    model = "black-forest-labs/flux.1-krea-dev"
    _check_the_run_names_its_hub_snapshots(out, hub_cache, commits, model)
    _check_the_validation_images(out, (1024, 1024))
    assert "base_model_precision qint8: quantised" in caplog.text
    _check_the_adapter_loads(FluxPipeline, model, hub_cache, out, "transformer", rank=16)


@needs_checkout
@pytest.mark.slow
def test_flux_tread_example_trains_with_its_routes(tmp_path, hub_repos, hub_cache, monkeypatch, caplog):
    """flux.peft-lora+TREAD: flux.peft-lora with `tread_config` (half of the image tokens skip blocks 2 to the one
    before last), trained with its routes in place; the adapter covers every block, routed ones included."""
    from diffusers import FluxPipeline

    config = _project(tmp_path, "flux.peft-lora+TREAD", monkeypatch)
    routes = json.loads(config.read_text())["tread_config"]["routes"]
    assert routes == [{"end_layer_idx": -2, "selection_ratio": 0.5, "start_layer_idx": 2}]
    out = _train(config, caplog)
    assert json.loads((out / "config.json").read_text())["tread_config"] == {"routes": routes}
    log = (out / "training.log").read_text()
    assert "TREAD token routing in the FluxTransformer2DModel (4 blocks) while training: 50% of each sample's " in log
    assert "image tokens skip blocks 2-2" in log
    model = "black-forest-labs/flux.1-krea-dev"
    _check_the_adapter_loads(FluxPipeline, model, hub_cache, out, "transformer", rank=16)
    from safetensors.torch import load_file

    weights = load_file(out / "pytorch_lora_weights.safetensors")
    assert any(key.startswith("transformer.single_transformer_blocks.0.") for key in weights)  # the routed block


@needs_checkout
@pytest.mark.slow
def test_kontext_example_trains_on_references_generated_from_a_hub_dataset(
    tmp_path, hub_repos, hub_cache, monkeypatch, caplog
):
    """kontext.peft-lora: `model_flavour: kontext` (`black-forest-labs/flux.1-kontext-dev`), int8 weights,
    optimi-lion, and the 512 px ControlNet dataloader over `keras-dreambooth/minercraft`, whose references are the
    images' canny edge maps, generated at start (`conditioning: {type: canny}`) from the Hub dataset's rows."""
    from diffusers import FluxKontextPipeline

    config = _project(tmp_path, "kontext.peft-lora", monkeypatch)
    out = _train(config, caplog)
    made = Path("cache/conditioning_data/controlnet-512_conditioning_canny").resolve()
    shard = made / "data" / "train-00000-of-00001.parquet"
    assert sorted(p.name for p in shard.iterdir()) == ["000.png", "001.png"]  # the rows' own names, as PNGs
    assert "generated 2 canny conditioning image(s)" in caplog.text
    assert "base_model_precision qint8: quantised" in caplog.text
    _check_the_adapter_loads(
        FluxKontextPipeline, "black-forest-labs/flux.1-kontext-dev", hub_cache, out, "transformer", 16
    )


@needs_checkout
@pytest.mark.slow
def test_flux_controlnet_example_trains_on_canny_maps_of_a_hub_dataset(
    tmp_path, hub_repos, hub_cache, monkeypatch, caplog
):
    """flux.peft-controlnet-lora: `controlnet: true` with a LoRA on the ControlNet (`flux_lora_target:
    controlnet`), int8 base weights, the 128 px ControlNet dataloader whose conditioning images are the canny maps
    generated from `keras-dreambooth/minercraft`; the merged ControlNet folder loads in FluxControlNetModel."""
    from diffusers import FluxControlNetModel
    from safetensors.torch import load_file

    config = _project(tmp_path, "flux.peft-controlnet-lora", monkeypatch)
    out = _train(config, caplog)
    assert "generated 2 canny conditioning image(s)" in caplog.text
    weights = load_file(out / "pytorch_lora_weights.safetensors")
    assert weights and all(key.startswith("controlnet.") for key in weights)
    assert {t.shape[0] for key, t in weights.items() if "lora_A" in key} == {64}  # the example's lora_rank
    controlnet = FluxControlNetModel.from_pretrained(out / "controlnet")
    assert controlnet.config.num_layers >= 1 and _check_the_validation_images(out, (256, 256)) is None


@needs_checkout
def test_sdxl_controlnet_example_loads_with_canny_maps_of_a_hub_dataset(tmp_path, hub_repos, hub_cache, monkeypatch):
    """sdxl.peft-controlnet-lora (1024 px: checked as `simpletuner train` checks it and its dataset scanned with the
    generated conditioning, not trained: an SDXL step at 1024 px takes minutes on this CPU)."""
    from simpletuner.cli.train import prepare_config
    from simpletuner.data_backend import build_datasets

    config = _project(tmp_path, "sdxl.peft-controlnet-lora", monkeypatch)
    loaded, _, _ = prepare_config(str(config), launch_command=None)
    assert loaded.config.controlnet and loaded.config.training_type == "lora"
    assert loaded.config.datasets[0].conditioning is not None
    (dataset,) = build_datasets(loaded.config)
    made = Path("cache/conditioning_data/controlnet-1024_conditioning_canny").resolve()
    assert {s.source for s in dataset.samples} == {str(p) for p in made.rglob("*.png")}


@needs_checkout
def test_sdxl_lokr_example_reads_its_model_and_dataset_from_the_hub_cache(tmp_path, hub_repos, hub_cache, monkeypatch):
    """sdxl.lycoris-lokr (its family's default, `stabilityai/stable-diffusion-xl-base-1.0`, LoKr from the example's
    lycoris_config.json, the 1024 px dataloader) is checked as `simpletuner train` checks it before training, and
    its dataset read at 1024 px. It is not trained here: one step at 1024 px in bf16 took ~90 s on this CPU."""
    from simpletuner.cli.train import prepare_config
    from simpletuner.data_backend import build_datasets

    _, commits = hub_repos
    model = "stabilityai/stable-diffusion-xl-base-1.0"
    config = _project(tmp_path, "sdxl.lycoris-lokr", monkeypatch)
    loaded, _, _ = prepare_config(str(config), launch_command=None)
    assert loaded.hub is not None and (loaded.hub.repo_id, loaded.hub.commit) == (model, commits[model])
    assert loaded.raw["pretrained_model_name_or_path"] == model
    assert loaded.config.pretrained_model_name_or_path == str(
        repo_folder(hub_cache, model) / "snapshots" / commits[model]
    )
    lycoris = loaded.config.lycoris
    assert (loaded.config.model_family, lycoris.algo, lycoris.factor, lycoris.bypass_mode) == ("sdxl", "lokr", 12, True)
    assert loaded.raw["pretrained_vae_model_name_or_path"] == SDXL_VAE  # SimpleTuner's default, as there
    assert loaded.config.pretrained_vae_model_name_or_path == str(
        repo_folder(hub_cache, SDXL_VAE) / "snapshots" / commits[SDXL_VAE]
    )
    (dataset,) = build_datasets(loaded.config)
    assert dataset.config.dataset_name == DATASET
    assert len(dataset.samples) == 3 and {s.bucket for s in dataset.samples} == {(1024, 1024)}
    assert {s.caption for s in dataset.samples} == {"🟫"}


def test_an_override_in_simpletuners_key_names_is_refused_naming_ours(tmp_path, hub_cache, monkeypatch, capsys):
    """`--set` applies to the config as translated, so it takes our key names; SimpleTuner's are refused, naming
    ours, before anything is written."""
    config = _project(tmp_path, "sd1x-dreamshaper.peft-lora", monkeypatch)
    assert main(["train", "--config", str(config), "--set", "checkpoint_step_interval=1"]) == 2
    err = capsys.readouterr().err
    assert "`checkpoint_step_interval` is the SimpleTuner name of `checkpointing_steps`" in err
    assert not Path("output").exists()
