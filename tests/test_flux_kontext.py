"""Flux.1 Kontext (the flux variant of a FluxKontextPipeline folder) on its tiny zoo model, against diffusers'
FluxKontextPipeline: latents equal to its ``_encode_vae_image`` for target and reference, the reference tokens after
the noisy target's in the transformer input with the pipeline's ids (first id 1), the loss by hand over the target's
tokens only, a LoRA run on edit pairs whose text cache holds one embedding per caption, validation rendering from
the reference, the adapter loading through FluxKontextPipeline.load_lora_weights, the memory estimate's doubled
sequence, and SimpleTuner's `model_flavour: kontext` configs read by the dialect."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from PIL import Image
from training_helpers import train

from simpletuner.caching.keys import PairedCaption
from simpletuner.configuration import load_config, validate_config
from simpletuner.configuration.simpletuner import translate as dialect
from simpletuner.models import FluxKontextSpec, FluxSpec, get_model_spec
from simpletuner.models.flux import T5_MAX_LENGTH
from simpletuner.models.flux_kontext import reference_size
from simpletuner.testing.zoo import TINY_FLUX_CLIP_HIDDEN, TINY_FLUX_LATENT_CHANNELS, TINY_FLUX_T5_WIDTH

CPU = torch.device("cpu")
C = TINY_FLUX_LATENT_CHANNELS


@pytest.fixture(scope="module")
def kontext(zoo):
    return zoo("flux_kontext")


@pytest.fixture
def kontext_config(zoo_config):
    return lambda **overrides: zoo_config("flux_kontext", "flux", **overrides)


@pytest.fixture(scope="module")
def pipe(kontext):
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(str(kontext), use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from simpletuner.testing.demo_data import write_edit_pairs

    return write_edit_pairs(tmp_path_factory.mktemp("kontext_pairs"), num_pairs=4, sizes=((64, 64),))


def _image(width, height, seed):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8).numpy(), "RGB")


def _pack(x):
    from diffusers import FluxKontextPipeline

    b, c, h, w = x.shape
    return FluxKontextPipeline._pack_latents(x, b, c, h, w)


def test_the_kontext_folder_picks_the_kontext_spec_and_its_own_latent_key(kontext_config, zoo):
    cfg = validate_config(kontext_config())
    spec = get_model_spec(cfg)
    assert type(spec) is FluxKontextSpec and spec.family == "flux"
    assert spec.conditions_on_image and not spec.prompt_sees_source and spec.takes_validation_image
    plain = FluxSpec(cfg)  # the same VAE and text encoders read as text-to-image
    assert spec.image_encoder_identity() != plain.image_encoder_identity()  # latents hold the reference too
    assert spec.text_encoder_identity() == plain.text_encoder_identity()  # Flux's prompt, shareable
    flux = validate_config(kontext_config(pretrained_model_name_or_path=str(zoo("flux"))))
    assert type(get_model_spec(flux)) is FluxSpec


def test_latents_are_the_pipelines_for_target_and_reference(kontext_config, pipe):
    spec = get_model_spec(validate_config(kontext_config()))
    vae = spec.load_vae(CPU, torch.float32)
    pixels = torch.rand(2, 6, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    got = spec.encode_images(vae, pixels)
    assert got.shape == (2, 2 * C, 4, 6)
    with torch.no_grad():
        for half, part in enumerate((pixels[:, :3], pixels[:, 3:])):
            want = pipe._encode_vae_image(part, generator=None)
            assert torch.allclose(got[:, half * C : (half + 1) * C], want, atol=1e-5)
    with pytest.raises(ValueError, match="the dataset has no reference images"):
        spec.encode_images(vae, pixels[:, :3])


def _dynamic_sigmas(u, seq_len):
    """Flux dev's scheduler: mu linear in the token count from 0.5 at 256 to 1.15 at 4096, exponential."""
    mu = 0.5 + (1.15 - 0.5) / (4096 - 256) * (seq_len - 256)
    return math.exp(mu) / (math.exp(mu) + (1 / u - 1))


@pytest.mark.parametrize("flow_shift", [None, 3.0])
def test_reference_tokens_follow_the_targets_with_their_ids_and_the_loss_is_the_targets(
    kontext_config, pipe, flow_shift
):
    cfg = validate_config(kontext_config(timestep_sampling="uniform", flow_shift=flow_shift))
    spec = get_model_spec(cfg)
    model = spec.load_denoiser().eval()
    gen = torch.Generator().manual_seed(7)
    target = torch.randn(2, C, 8, 12, generator=gen)
    reference = torch.randn(2, C, 8, 12, generator=gen)
    cond = {
        "prompt_embeds": torch.randn(2, 5, TINY_FLUX_T5_WIDTH, generator=gen),
        "pooled_prompt_embeds": torch.randn(2, TINY_FLUX_CLIP_HIDDEN, generator=gen),
    }
    seen = {}

    def record(module, args, kwargs):
        seen.update(kwargs)

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            got = spec.training_loss(model, torch.cat([target, reference], 1), cond, torch.Generator().manual_seed(3))
    finally:
        handle.remove()
    # The transformer input: 24 noisy target tokens, then the 24 clean reference tokens; ids (0, y, x) then (1, y, x).
    assert seen["hidden_states"].shape == (2, 48, 4 * C)
    assert torch.equal(seen["hidden_states"][:, 24:], _pack(reference))
    ids = seen["img_ids"]
    assert ids.shape == (48, 3) and not ids[:24, 0].any() and bool((ids[24:, 0] == 1).all())
    assert torch.equal(ids[:24, 1:], ids[24:, 1:])  # the reference on the target's grid

    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        noise = torch.randn(target.shape, generator=g)  # the target's shape: the reference draws no noise
        u = torch.rand(2, generator=g)
        # mu from the target's packed length alone (4 x 6 = 24 tokens), as the pipeline's image_seq_len.
        sigmas = _dynamic_sigmas(u, 24) if flow_shift is None else flow_shift * u / (1 + (flow_shift - 1) * u)
        s = sigmas.view(-1, 1, 1, 1)
        noisy = _pack((1 - s) * target + s * noise)
        # The pipeline's own packing and ids for a reference given as latents (prepare_latents, 64 x 96 px).
        _, image_latents, latent_ids, image_ids = pipe.prepare_latents(
            reference, 2, C, 64, 96, torch.float32, CPU, None, latents=noisy
        )

        def by_hand(reference_tokens):
            pred = model(
                hidden_states=torch.cat([noisy, reference_tokens], dim=1),
                timestep=sigmas,
                guidance=torch.ones(2),  # flux_guidance_value's default
                pooled_projections=cond["pooled_prompt_embeds"],
                encoder_hidden_states=cond["prompt_embeds"],
                txt_ids=torch.zeros(5, 3),
                img_ids=torch.cat([latent_ids, image_ids]),
                return_dict=False,
            )[0][:, :24]
            return ((pred - _pack(noise - target)) ** 2).mean(dim=(1, 2))

        want = by_hand(image_latents)
        noised = by_hand(_pack((1 - s) * reference + s * noise))
        other = spec.training_loss(
            model, torch.cat([target, reference.flip(-1)], 1), cond, torch.Generator().manual_seed(3)
        )
    assert torch.equal(seen["img_ids"], torch.cat([latent_ids, image_ids]))
    assert got.shape == (2,) and torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(got, noised, atol=1e-5)  # the reference is never noised
    assert not torch.allclose(got, other, atol=1e-5)  # and the prediction depends on it
    with pytest.raises(ValueError, match="clear cache_dir_vae"):
        spec.training_loss(model, target, cond, torch.Generator().manual_seed(3))


def _kontext_call(model, reference_tokens):
    """One denoiser call as FluxKontextPipeline makes it: 16 target tokens, then 16 reference tokens."""
    from diffusers import FluxPipeline

    gen = torch.Generator().manual_seed(1)
    ids = FluxPipeline._prepare_latent_image_ids(1, 4, 4, "cpu", torch.float32)
    reference_ids = ids.clone()
    reference_ids[:, 0] = 1
    return model(
        hidden_states=torch.cat([torch.randn(2, 16, 4 * C, generator=gen), reference_tokens], dim=1),
        timestep=torch.tensor([0.2, 0.7]),
        guidance=torch.ones(2),
        pooled_projections=torch.randn(2, TINY_FLUX_CLIP_HIDDEN, generator=gen),
        encoder_hidden_states=torch.randn(2, 6, TINY_FLUX_T5_WIDTH, generator=gen),
        txt_ids=torch.zeros(6, 3),
        img_ids=torch.cat([ids, reference_ids]),
        return_dict=False,
    )[0][:, :16]


def test_a_lora_run_on_pairs_validates_from_the_reference_and_loads_in_the_kontext_pipeline(
    kontext_config, kontext, pairs, tmp_path
):
    from diffusers import FluxKontextPipeline

    images, sources = pairs
    raw = kontext_config(
        datasets=[
            {"id": "edits", "type": "local", "instance_data_dir": str(images), "conditioning_data_dir": str(sources)}
        ],
        max_train_steps=2,
        lora_rank=4,
        lora_alpha=4,
        learning_rate=1e-2,
        validation_prompt="make the circle blue",
        validation_num_inference_steps=1,
        output_dir=str(tmp_path / "out"),
    )
    trainer, result = train(raw)
    assert result.global_step == 2 and all(math.isfinite(x) for x in result.losses)
    # Flux's prompt does not see the reference: one text embedding per caption, none per pair.
    captions = {s.caption for s in trainer.state.datasets[0].samples}
    assert set(trainer.data.text_keys) == captions and not any(
        isinstance(k, PairedCaption) for k in trainer.data.text_keys
    )
    # Validation rendered at the start and the end, from the first pair's reference (no validation_image).
    assert sorted(p.name for p in result.validation_images) == ["step_000000_0.png", "step_000002_0.png"]
    assert Image.open(result.validation_images[-1]).size == (64, 64)

    # The adapter, loaded through FluxKontextPipeline, reproduces the trained transformer on a Kontext input.
    loaded = FluxKontextPipeline.from_pretrained(str(kontext), use_safetensors=True)
    loaded.load_lora_weights(str(result.output_path.parent))
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    base = FluxKontextPipeline.from_pretrained(str(kontext), use_safetensors=True).transformer
    reference = torch.randn(2, 16, 4 * C, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = _kontext_call(trained, reference)
        assert torch.allclose(_kontext_call(loaded.transformer, reference), want, atol=1e-5)
        assert not torch.allclose(_kontext_call(base, reference), want, atol=1e-4), "the adapter must change it"


def test_the_validation_sampler_renders_from_the_reference_at_the_asked_size(kontext_config, pipe):
    spec = get_model_spec(validate_config(kontext_config()))
    sampler = spec.build_pipeline(pipe.transformer, pipe.vae, spec.load_text_encoders(CPU, torch.float32))
    sampler.set_progress_bar_config(disable=True)
    args = dict(num_inference_steps=2, guidance_scale=2.5, output_type="pt")

    def render(p, image, **extra):
        return p(prompt="make it red", image=image, generator=torch.Generator().manual_seed(0), **args, **extra).images

    reference = _image(72, 48, 4)  # scaled to the 48 x 32 output's area, its aspect kept: 48 x 32 (multiples of 16)
    assert reference_size(72, 48, 48 * 32) == (48, 32)
    got = sampler(  # called as validation calls it: the prompt first
        "make it red", image=reference, height=32, width=48, generator=torch.Generator().manual_seed(0), **args
    ).images
    assert got.shape == (1, 3, 32, 48)
    # FluxKontextPipeline itself, given that reference, the size as its area and no snapping to its preferred
    # ~1 MP sizes: the same image.
    resized = reference.resize((48, 32), Image.Resampling.LANCZOS)
    want = render(pipe, resized, height=32, width=48, max_area=48 * 32, _auto_resize=False)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, render(sampler, _image(72, 48, 5), height=32, width=48), atol=1e-4)
    with pytest.raises(ValueError, match="set `validation_image`"):
        sampler("make it red", height=32, width=48, **args)


def test_memory_estimate_sees_the_reference_tokens(kontext_config, zoo):
    from simpletuner.memory.estimator import batch_shapes, estimate_memory

    cfg = validate_config(kontext_config(mixed_precision="no"))
    latents, cond = batch_shapes(cfg, 2)
    assert latents.shape == (2, 2 * C, 8, 8)  # target and reference latents, cached together
    assert {k: s.shape for k, s in cond.items()} == {
        "prompt_embeds": (2, T5_MAX_LENGTH, TINY_FLUX_T5_WIDTH),
        "pooled_prompt_embeds": (2, TINY_FLUX_CLIP_HIDDEN),
    }
    est = estimate_memory(cfg, device_kind="cpu")
    flux = estimate_memory(
        validate_config(kontext_config(mixed_precision="no", pretrained_model_name_or_path=str(zoo("flux")))),
        device_kind="cpu",
    )
    assert est.latent_shape == (2 * C, 8, 8) and est.weights == flux.weights
    assert est.activations > flux.activations  # the fake step runs the doubled image sequence


# --- SimpleTuner's configs ---------------------------------------------------------------------------------------


def _quickstart_datasets(kind: str = "reference_strict") -> list[dict]:
    """The paired dataloader of SimpleTuner's documentation/quickstart/FLUX_KONTEXT.md (commit bc8e6ab), its paths
    relative to the working directory."""
    return [
        {
            "id": "my-edited-images",
            "type": "local",
            "cache_dir_vae": "cache/vae/flux/kontext/edited-images",
            "instance_data_dir": "datasets/edited-images",
            "conditioning_data": ["my-reference-images"],
            "resolution": 64,
            "caption_strategy": "textfile",
        },
        {
            "id": "my-reference-images",
            "type": "local",
            "cache_dir_vae": "cache/vae/flux/kontext/ref-images",
            "instance_data_dir": "datasets/reference-images",
            "conditioning_type": kind,
            "resolution": 64,
            "caption_strategy": None,
        },
    ]


def _published_example(model: str) -> dict:
    """SimpleTuner's simpletuner/examples/kontext.peft-lora/config.json (commit bc8e6ab), the keys that decide what
    is trained, with the model path set."""
    return {
        "aspect_bucket_rounding": 2,
        "base_model_precision": "no_change",
        "caption_dropout_probability": 0.1,
        "conditioning_multidataset_sampling": "random",
        "data_backend_config": "config/multidatabackend.json",
        "fuse_qkv_projections": False,
        "gradient_checkpointing": True,
        "learning_rate": 1e-8,
        "lora_rank": 16,
        "lora_type": "standard",
        "lr_scheduler": "constant",
        "max_train_steps": 100,
        "mixed_precision": "bf16",
        "model_family": "flux",
        "model_flavour": "kontext",
        "model_type": "lora",
        "num_train_epochs": 0,
        "optimizer": "optimi-lion",
        "pretrained_model_name_or_path": model,
        "resolution": 64,
        "resolution_type": "pixel_area",
        "seed": 42,
        "train_batch_size": 1,
        "validation_guidance": 2.5,
        "validation_num_inference_steps": 25,
        "validation_prompt": "make the circle blue",
        "validation_resolution": "64x64",
        "report_to": "none",
    }


def _project(tmp_path: Path, pairs, datasets: list[dict], **top) -> tuple[Path, dict]:
    root = tmp_path / "project"
    (root / "config").mkdir(parents=True)
    images, sources = pairs
    (root / "datasets").mkdir()
    os.symlink(images, root / "datasets" / "edited-images")
    os.symlink(sources, root / "datasets" / "reference-images")
    (root / "config" / "multidatabackend.json").write_text(json.dumps(datasets))
    raw = {**_published_example(top.pop("model")), **top}
    (root / "config" / "config.json").write_text(json.dumps(raw))
    return root, raw


def test_simpletuners_kontext_flavour_loads_paired_and_says_what_differs(tmp_path, kontext, pairs, monkeypatch):
    root, raw = _project(tmp_path, pairs, _quickstart_datasets(), model=str(kontext))
    native, report = dialect.translate(raw, root / "config" / "config.json", root)
    (dataset,) = native["datasets"]  # the reference entry is the dataset's conditioning_data_dir
    assert dataset["conditioning_data_dir"] == os.path.join(root, "datasets", "reference-images")
    (note,) = [line for line in report.approximated if line.startswith("`model_flavour`")]
    assert "'kontext'" in note and "timestep 0" in note and "FluxKontextPipeline" in note
    monkeypatch.chdir(root)
    config = load_config(root / "config" / "config.json").config
    assert type(get_model_spec(config)) is FluxKontextSpec and config.validation_guidance_scale == 2.5

    del raw["pretrained_model_name_or_path"]  # the flavour's hub model, as SimpleTuner loads it
    native, _ = dialect.translate(raw, root / "config" / "config.json", root)
    assert native["pretrained_model_name_or_path"] == "black-forest-labs/flux.1-kontext-dev"


def test_the_published_kontext_example_trains_on_its_generated_canny_references(tmp_path, kontext, pairs, monkeypatch):
    """The example's dataloader (examples/multidatabackend-controlnet-512px.json) makes each image's reference from
    the image itself, with `conditioning: {type: canny}`: generated at start, then paired as reference images are."""
    from simpletuner.cli.train import main as train_main
    from simpletuner.data_backend.canny import canny_image

    generated = {
        "id": "controlnet-512",
        "type": "local",
        "instance_data_dir": "datasets/edited-images",
        "resolution": 64,
        "caption_strategy": "instanceprompt",
        "instance_prompt": "minecraft",
        "conditioning": {"type": "canny", "conditioning_type": "controlnet", "captions": ["minecraft"]},
    }
    root, raw = _project(tmp_path, pairs, [generated], model=str(kontext))
    native, report = dialect.translate(raw, root / "config" / "config.json", root)
    assert native["datasets"][0]["conditioning"] == {"type": "canny"}
    assert any("conditioning.captions" in line and "collate.py" in line for line in report.ignored)
    raw.update(max_train_steps=1, validation_prompt=None, output_dir="output")
    (root / "config" / "config.json").write_text(json.dumps(raw))
    monkeypatch.chdir(root)
    assert train_main(["--config", "config/config.json"]) == 0
    made = root / "cache" / "conditioning_data" / "controlnet-512_conditioning_canny"
    images = sorted((root / "datasets" / "edited-images").glob("*.png"))
    assert sorted(p.name for p in made.glob("*.png")) == [p.name for p in images]
    with Image.open(images[0]) as image, Image.open(made / images[0].name) as reference:
        assert reference.convert("RGB").tobytes() == canny_image(image).tobytes()
    assert (root / "output" / "pytorch_lora_weights.safetensors").is_file()


def test_a_plain_flux_folder_refuses_reference_images(kontext_config, zoo, pairs):
    from simpletuner.data_backend.pairs import check_model_inputs

    images, sources = pairs
    entry = {"id": "edits", "type": "local", "instance_data_dir": str(images), "conditioning_data_dir": str(sources)}
    cfg = validate_config(kontext_config(pretrained_model_name_or_path=str(zoo("flux")), datasets=[entry]))
    with pytest.raises(ValueError, match="FluxKontextPipeline"):
        check_model_inputs(get_model_spec(cfg), cfg)
    plain = validate_config(kontext_config())  # the Kontext folder on the unpaired shapes dataset
    with pytest.raises(ValueError, match="dataset\\(s\\) 'shapes' name no sources"):
        check_model_inputs(get_model_spec(plain), plain)


def test_reference_size_keeps_the_aspect_within_the_area():
    assert reference_size(1024, 1024, 512 * 512) == (512, 512)
    assert reference_size(1920, 1080, 1024 * 1024) == (1360, 768)
    assert reference_size(10, 1000, 64 * 64) == (16, 640)
