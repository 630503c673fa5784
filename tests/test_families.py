"""What every single-denoiser family must do on its tiny zoo model, as one table: LoRA training
through the real Trainer lowers the loss on a fixed batch, the saved adapter loads into the
family's diffusers pipeline and reproduces the trained denoiser, and the memory estimate counts
the adapted denoiser and the batch exactly (sd's: test_memory_estimator.py). Family-specific
behaviour is in test_model_<family>.py (Wan 2.2's two experts in test_model_wan22.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import diffusers
import pytest
import torch
from training_helpers import fixed_loss, train, untrained_loss

from simpletuner.configuration import validate_config
from simpletuner.memory.estimator import batch_shapes, estimate_memory
from simpletuner.models import get_model_spec
from simpletuner.models.adapters import prepare_for_training
from simpletuner.models.flux import T5_MAX_LENGTH as FLUX_T5_LENGTH
from simpletuner.models.qwen_image import QWEN_MAX_LENGTH
from simpletuner.models.sd3 import T5_MAX_LENGTH as SD3_T5_LENGTH
from simpletuner.models.wan import WAN_MAX_LENGTH
from simpletuner.testing.zoo import (
    TINY_FLUX_CLIP_HIDDEN,
    TINY_FLUX_T5_WIDTH,
    TINY_QWEN_LATENT_CHANNELS,
    TINY_QWEN_TEXT_HIDDEN,
    TINY_SD3_CLIP_PROJECTION,
    TINY_SD3_T5_WIDTH,
    TINY_SDXL_HIDDEN,
    TINY_SDXL_PROJECTION,
    TINY_WAN_LATENT_CHANNELS,
    TINY_WAN_T5_WIDTH,
)

SD_CONTEXT = 32  # the tiny SD text encoder's width
SD3_SEQ, SD3_POOLED = 77 + SD3_T5_LENGTH, sum(TINY_SD3_CLIP_PROJECTION)


# --- one denoiser call per family, as its pipeline makes it, on seeded random inputs ------------------
def _sd_call(model, gen, trainer):
    x, ctx = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 77, SD_CONTEXT, generator=gen)
    return model(x, torch.tensor([10, 500]), ctx).sample


def _sdxl_call(model, gen, trainer):
    x = torch.randn(2, 4, 8, 8, generator=gen)
    ctx = torch.randn(2, 77, sum(TINY_SDXL_HIDDEN), generator=gen)
    added = {"text_embeds": torch.randn(2, TINY_SDXL_PROJECTION, generator=gen), "time_ids": trainer.spec.time_ids(x)}
    return model(x, torch.tensor([10, 500]), ctx, added_cond_kwargs=added).sample


def _sd3_call(model, gen, trainer):
    return model(
        hidden_states=torch.randn(2, 16, 8, 8, generator=gen),
        timestep=torch.tensor([10.0, 500.0]),
        encoder_hidden_states=torch.randn(2, SD3_SEQ, TINY_SD3_T5_WIDTH, generator=gen),
        pooled_projections=torch.randn(2, SD3_POOLED, generator=gen),
        return_dict=False,
    )[0]


def _flux_call(model, gen, trainer):
    """Packed 8x8 latents; the timestep already / 1000, as FluxPipeline passes it."""
    packed = torch.randn(2, 16, 64, generator=gen)
    prompt = torch.randn(2, FLUX_T5_LENGTH, TINY_FLUX_T5_WIDTH, generator=gen)
    pooled = torch.randn(2, TINY_FLUX_CLIP_HIDDEN, generator=gen)
    return model(
        hidden_states=packed,
        timestep=torch.tensor([0.01, 0.5]),
        guidance=torch.full((2,), 1.0),  # flux_guidance_value's default
        pooled_projections=pooled,
        encoder_hidden_states=prompt,
        txt_ids=torch.zeros(FLUX_T5_LENGTH, 3),
        img_ids=diffusers.FluxPipeline._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32),
        return_dict=False,
    )[0]


def _wan_call(model, gen, trainer):
    return model(
        hidden_states=torch.randn(2, TINY_WAN_LATENT_CHANNELS, 1, 8, 8, generator=gen),
        timestep=torch.tensor([10.0, 500.0]),
        encoder_hidden_states=torch.randn(2, WAN_MAX_LENGTH, TINY_WAN_T5_WIDTH, generator=gen),
        return_dict=False,
    )[0]


def _wan_ti2v_call(model, gen, trainer):
    """4x4 latents (the TI2V VAE's /16), per-token timesteps as WanPipeline's expand_timesteps passes them."""
    return model(
        hidden_states=torch.randn(2, TINY_WAN_LATENT_CHANNELS, 1, 4, 4, generator=gen),
        timestep=torch.tensor([[10.0] * 4, [500.0] * 4]),
        encoder_hidden_states=torch.randn(2, WAN_MAX_LENGTH, TINY_WAN_T5_WIDTH, generator=gen),
        return_dict=False,
    )[0]


def _qwen_image_call(model, gen, trainer):
    """Packed 8x8 latents, a 6-token caption (unpadded, as QwenImagePipeline passes one prompt); timestep = sigma."""
    return model(
        hidden_states=torch.randn(2, 16, 4 * TINY_QWEN_LATENT_CHANNELS, generator=gen),
        encoder_hidden_states=torch.randn(2, 6, TINY_QWEN_TEXT_HIDDEN, generator=gen),
        timestep=torch.tensor([0.01, 0.5]),
        img_shapes=[[(1, 4, 4)]] * 2,
        return_dict=False,
    )[0]


def _qwen_image_edit_call(model, gen, trainer):
    """Packed 8x8 target latents then the 8x8 source's (the edit pipeline's sequence), a 6-token prompt."""
    return model(
        hidden_states=torch.randn(2, 32, 4 * TINY_QWEN_LATENT_CHANNELS, generator=gen),
        encoder_hidden_states=torch.randn(2, 6, TINY_QWEN_TEXT_HIDDEN, generator=gen),
        timestep=torch.tensor([0.01, 0.5]),
        img_shapes=[[(1, 4, 4), (1, 4, 4)]] * 2,
        return_dict=False,
    )[0][:, :16]


def _edit_processor(folder) -> dict:
    """QwenImageEditPipeline.from_pretrained cannot build its processor without torchvision: pass ours."""
    from simpletuner.models.qwen_image_edit import load_edit_processor

    return {"processor": load_edit_processor(str(folder))}


@dataclass(frozen=True)
class FamilyCase:
    """One family's row: its zoo model, the diffusers pipeline that loads it, and its shapes."""

    name: str  #: model_family and zoo model
    pipeline: str  #: the diffusers pipeline class that loads the folder and the adapter
    denoiser: str  #: that pipeline's denoiser attribute
    call: Callable  #: (model, generator, trainer) -> output: one denoiser call on random inputs
    steps: int  #: training steps for the overfit check
    latents: tuple  #: batch_shapes' latent shape at batch 2, 64 px
    conditioning: dict  #: batch_shapes' conditioning shapes at batch 2
    pipeline_kwargs: dict = field(default_factory=dict)
    lora_parameter: str | None = None  #: a name the adapted denoiser must have a LoRA parameter under
    model_family: str | None = None  #: the config's model_family when it is not ``name`` (a variant's zoo model)
    config: dict = field(default_factory=dict)  #: config keys the row needs
    edit_pairs: bool = False  #: trains on edit pairs (the shapes, recoloured) instead of the shapes dataset
    pipeline_parts: Callable | None = None  #: folder -> components to pass to the pipeline's from_pretrained

    def __str__(self) -> str:
        return self.name


CASES = [
    FamilyCase(
        "sd",
        "StableDiffusionPipeline",
        "unet",
        _sd_call,
        80,
        (2, 4, 8, 8),
        {"prompt_embeds": (2, 77, SD_CONTEXT)},
        pipeline_kwargs={"safety_checker": None},
    ),
    FamilyCase(
        "sdxl",
        "StableDiffusionXLPipeline",
        "unet",
        _sdxl_call,
        60,
        (2, 4, 8, 8),
        {"prompt_embeds": (2, 77, sum(TINY_SDXL_HIDDEN)), "pooled_prompt_embeds": (2, TINY_SDXL_PROJECTION)},
        pipeline_kwargs={"add_watermarker": False},
    ),
    FamilyCase(
        "sd3",
        "StableDiffusion3Pipeline",
        "transformer",
        _sd3_call,
        40,
        (2, 16, 8, 8),
        {"prompt_embeds": (2, SD3_SEQ, TINY_SD3_T5_WIDTH), "pooled_prompt_embeds": (2, SD3_POOLED)},
    ),
    FamilyCase(
        "flux",
        "FluxPipeline",
        "transformer",
        _flux_call,
        40,
        (2, 16, 8, 8),
        {"prompt_embeds": (2, FLUX_T5_LENGTH, TINY_FLUX_T5_WIDTH), "pooled_prompt_embeds": (2, TINY_FLUX_CLIP_HIDDEN)},
        lora_parameter="single_transformer_blocks.0.proj_mlp.lora_A",
    ),
    FamilyCase(
        "wan",
        "WanPipeline",
        "transformer",
        _wan_call,
        30,
        (2, TINY_WAN_LATENT_CHANNELS, 1, 8, 8),
        {"prompt_embeds": (2, WAN_MAX_LENGTH, TINY_WAN_T5_WIDTH)},
    ),
    FamilyCase(  # Wan 2.2 TI2V-5B (its VAE /16: 4x4 latents at 64 px); I2V A14B: test_model_wan22_i2v.py
        "wan22_ti2v",
        "WanPipeline",
        "transformer",
        _wan_ti2v_call,
        30,
        (2, TINY_WAN_LATENT_CHANNELS, 1, 4, 4),
        {"prompt_embeds": (2, WAN_MAX_LENGTH, TINY_WAN_T5_WIDTH)},
        model_family="wan",
        config={"aspect_bucket_alignment": 32},
    ),
    FamilyCase(
        "qwen_image",
        "QwenImagePipeline",
        "transformer",
        _qwen_image_call,
        40,
        (2, TINY_QWEN_LATENT_CHANNELS, 8, 8),
        {
            "prompt_embeds": (2, QWEN_MAX_LENGTH, TINY_QWEN_TEXT_HIDDEN),
            "prompt_embeds_mask": (2, QWEN_MAX_LENGTH),
        },
    ),
    FamilyCase(  # a 64 px source: smart_resize to 56 x 56 px, (56 / 14)^2 / 2^2 = 4 image tokens, + 7 template, + 512
        "qwen_image_edit",
        "QwenImageEditPipeline",
        "transformer",
        _qwen_image_edit_call,
        40,
        (2, 2 * TINY_QWEN_LATENT_CHANNELS, 8, 8),  # target and source latents
        {
            "prompt_embeds": (2, 4 + 7 + QWEN_MAX_LENGTH, TINY_QWEN_TEXT_HIDDEN),
            "prompt_embeds_mask": (2, 4 + 7 + QWEN_MAX_LENGTH),
        },
        model_family="qwen_image",
        edit_pairs=True,
        pipeline_parts=_edit_processor,
    ),
]


@pytest.fixture(scope="module")
def edit_pairs(tmp_path_factory):
    """Edit pairs of the shapes dataset (``demo.write_edit_pairs``): images and their sources."""
    from simpletuner.testing.demo_data import write_edit_pairs

    return write_edit_pairs(tmp_path_factory.mktemp("edit_pairs"), num_pairs=12)


def _config(make_config, zoo, case: FamilyCase, edit_pairs=None, **overrides) -> dict:
    if case.edit_pairs:
        images, sources = edit_pairs
        pairs = {
            "id": "edits",
            "type": "local",
            "instance_data_dir": str(images),
            "conditioning_data_dir": str(sources),
        }
        overrides.setdefault("datasets", [pairs])
    return make_config(
        pretrained_model_name_or_path=str(zoo(case.name)),
        model_family=case.model_family or case.name,
        **{**case.config, **overrides},
    )


def _pipeline(case: FamilyCase, folder):
    pipeline_cls = getattr(diffusers, case.pipeline)
    parts = case.pipeline_parts(folder) if case.pipeline_parts else {}
    return pipeline_cls.from_pretrained(str(folder), use_safetensors=True, **case.pipeline_kwargs, **parts)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_lora_overfits_and_reloads_in_diffusers(case, make_config, zoo, edit_pairs, tmp_path):
    raw = _config(
        make_config,
        zoo,
        case,
        edit_pairs,
        max_train_steps=case.steps,
        learning_rate=1e-2,
        lora_rank=16,
        lora_alpha=8,
        output_dir=str(tmp_path / "long"),
        logging_steps=10,
    )
    trainer, result = train(raw)
    before, after = untrained_loss(trainer), fixed_loss(trainer)
    assert result.global_step == case.steps and len(result.losses) == case.steps
    assert after < before * 0.85, (before, after)

    # The saved adapter, loaded through the family's diffusers pipeline, reproduces the trained denoiser.
    assert result.output_path.name == "pytorch_lora_weights.safetensors"
    loaded = _pipeline(case, zoo(case.name))
    loaded.load_lora_weights(str(result.output_path.parent))
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    untouched = getattr(_pipeline(case, zoo(case.name)), case.denoiser)
    with torch.no_grad():
        want = case.call(trained, torch.Generator().manual_seed(1), trainer)
        got = case.call(getattr(loaded, case.denoiser), torch.Generator().manual_seed(1), trainer)
        base = case.call(untouched, torch.Generator().manual_seed(1), trainer)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(base, want, atol=1e-3), "the adapter must change the output"


@pytest.mark.parametrize("case", [c for c in CASES if c.name != "sd"], ids=str)  # sd: test_memory_estimator.py
def test_memory_estimate_counts_the_adapted_denoiser_and_the_batch(case, make_config, zoo, edit_pairs):
    cfg = validate_config(_config(make_config, zoo, case, edit_pairs, mixed_precision="no"))
    latents, cond = batch_shapes(cfg, 2)
    assert latents.shape == case.latents
    assert {k: s.shape for k, s in cond.items()} == case.conditioning
    est = estimate_memory(cfg, device_kind="cpu")
    spec = get_model_spec(cfg)
    model = prepare_for_training(spec.load_denoiser(torch.float32), spec.lora_targets, cfg, torch.float32)
    if case.lora_parameter:
        assert any(case.lora_parameter in n for n, _ in model.named_parameters())
    params = list(model.parameters())
    assert est.weights == sum(p.nbytes for p in params) + sum(b.nbytes for b in model.buffers())
    assert est.trainable_weights == sum(p.nbytes for p in params if p.requires_grad)
    assert est.num_parameters == sum(p.numel() for p in params)
    assert est.activations > 0 and est.batch_data == latents.nbytes + sum(s.nbytes for s in cond.values())
