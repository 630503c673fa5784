"""The Qwen-Image-Edit variant of qwen_image on its tiny zoo model, against QwenImageEditPipeline's own
code: prompt embeddings equal to its ``encode_prompt`` with the source image (cached padded to
image tokens + 7 + 512 with a mask), latents equal to its ``_encode_vae_image`` for both halves, the
loss by hand with the source packed after the target on the sequence axis (never noised), a LoRA that
loads into QwenImageEditPipeline and changes its images, the validation sampler's true CFG and its
required image, the folders refused (Edit-Plus, no processor), and the memory estimate's prompt length
from smart_resize computed by hand."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from PIL import Image

from simpletuner.configuration import validate_config
from simpletuner.models import QwenImageEditSpec, QwenImageSpec, get_model_spec
from simpletuner.models.qwen_image import QWEN_MAX_LENGTH
from simpletuner.models.qwen_image_edit import (
    EDIT_PROMPT_TEMPLATE,
    EDIT_TEMPLATE_DROP,
    EDIT_TEMPLATE_KEPT,
    load_edit_processor,
)
from simpletuner.testing.zoo import TINY_QWEN_LATENT_CHANNELS, TINY_QWEN_TEXT_HIDDEN

CPU = torch.device("cpu")
C = TINY_QWEN_LATENT_CHANNELS


@pytest.fixture(scope="session")
def tiny_edit(zoo):
    return zoo("qwen_image_edit")


@pytest.fixture
def edit_config(zoo_config):
    return lambda **overrides: zoo_config("qwen_image_edit", "qwen_image", **overrides)


@pytest.fixture(scope="module")
def pipe(tiny_edit):
    from diffusers import QwenImageEditPipeline

    # The processor as the spec loads it (transformers 5 builds Qwen2VLProcessor only with torchvision).
    pipe = QwenImageEditPipeline.from_pretrained(
        str(tiny_edit), processor=load_edit_processor(str(tiny_edit)), use_safetensors=True
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(width, height, seed):
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(pixels, "RGB")


def _smart_resize(height, width, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280):
    """Qwen2-VL's resize rule, written out: sides rounded to ``factor``, then scaled into the pixel range."""
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def _image_tokens(height, width, **limits):
    h, w = _smart_resize(height, width, **limits)
    return (h // 14) * (w // 14) // 4


def test_the_edit_folder_picks_the_edit_spec_and_its_own_cache_keys(edit_config, tiny_edit):
    cfg = validate_config(edit_config())
    spec = get_model_spec(cfg)
    assert type(spec) is QwenImageEditSpec and spec.conditions_on_image and spec.family == "qwen_image"
    plain = QwenImageSpec(cfg)  # the same VAE and text encoder read as text-to-image
    assert spec.image_encoder_identity() != plain.image_encoder_identity()
    assert spec.text_encoder_identity() != plain.text_encoder_identity()
    encoders = spec.load_text_encoders(CPU, torch.float32)
    assert set(encoders) == {"tokenizer", "text_encoder", "processor"}
    assert type(encoders["processor"]).__mro__[1].__name__ == "Qwen2VLProcessor"


def test_prompt_embeddings_equal_the_pipelines_encode_prompt(edit_config, pipe):
    spec = get_model_spec(validate_config(edit_config()))
    encoders = spec.load_text_encoders(CPU, torch.float32)
    tokenizer = encoders["processor"].tokenizer
    # The tiny tokenizer splits the system prompt into the 64 tokens the pipeline drops, ending at the user turn.
    prefix = tokenizer(EDIT_PROMPT_TEMPLATE.split("<|vision_start|>")[0]).input_ids
    assert len(prefix) == EDIT_TEMPLATE_DROP
    assert tokenizer.convert_ids_to_tokens(prefix[-3:]) == ["<|im_start|>", "user", "\u010a"]

    long_caption = " ".join(["make it red"] * 200)  # > 512 caption tokens: cut (the pipeline does not cut)
    captions = ["make the square blue", "", "add a hat", long_caption]
    images = [_image(32, 32, 0), _image(48, 32, 1), _image(32, 32, 2), _image(48, 32, 3)]  # two sizes
    out = spec.encode_prompts(encoders, captions, images=images)
    for caption, image, cond in zip(captions, images, out):
        n_image = _image_tokens(image.height, image.width)
        n_caption = len(tokenizer(caption).input_ids)
        length = n_image + EDIT_TEMPLATE_KEPT + QWEN_MAX_LENGTH
        assert cond["prompt_embeds"].shape == (length, TINY_QWEN_TEXT_HIDDEN)
        assert cond["prompt_embeds_mask"].dtype == torch.int64
        with torch.no_grad():
            embeds, mask = pipe.encode_prompt(caption, image=image, device="cpu")
        assert mask is None and embeds.shape[1] == n_image + EDIT_TEMPLATE_KEPT + n_caption
        kept = min(embeds.shape[1], length)
        assert int(cond["prompt_embeds_mask"].sum()) == kept
        assert torch.allclose(cond["prompt_embeds"][:kept], embeds[0, :kept], atol=1e-5)
        assert not cond["prompt_embeds"][kept:].any() and not cond["prompt_embeds_mask"][kept:].any()

    # A batch of one size through the pipeline pads to its longest with a mask: ours, cut to that, is the same.
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt([captions[0], captions[2]], image=[images[0], images[2]], device="cpu")
    stacked = {k: torch.stack([out[0][k], out[2][k]]) for k in out[0]}
    got, got_mask = QwenImageEditSpec.text_inputs(stacked)
    assert torch.equal(got_mask, mask) and torch.allclose(got, embeds, atol=1e-5)

    with pytest.raises(ValueError, match="needs images="):
        spec.encode_prompts(encoders, captions)


def test_latents_are_the_pipelines_for_target_and_source(edit_config, pipe):
    spec = get_model_spec(validate_config(edit_config()))
    vae = spec.load_vae(CPU, torch.float32)
    pixels = torch.rand(2, 6, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    got = spec.encode_images(vae, pixels)
    assert got.shape == (2, 2 * C, 4, 6)
    with torch.no_grad():
        for half, part in enumerate((pixels[:, :3], pixels[:, 3:])):
            want = pipe._encode_vae_image(part.unsqueeze(2), generator=None)[:, :, 0]
            assert torch.allclose(got[:, half * C : (half + 1) * C], want, atol=1e-5)
    with pytest.raises(ValueError, match="the dataset has no source images"):
        spec.encode_images(vae, pixels[:, :3])


def _pack(x):
    from diffusers import QwenImageEditPipeline

    b, c, h, w = x.shape
    return QwenImageEditPipeline._pack_latents(x, b, c, h, w)


def _shift_by_hand(u, seq_len):
    """Qwen-Image's scheduler: mu linear in the token count from 0.5 at 256 to 0.9 at 8192, exponential."""
    mu = 0.5 + (0.9 - 0.5) / (8192 - 256) * (seq_len - 256)
    return math.exp(mu) / (math.exp(mu) + (1 / u - 1))


@pytest.mark.parametrize("flow_shift", [None, 3.0])
def test_loss_is_flow_matching_on_the_target_with_the_clean_source_appended(edit_config, flow_shift):
    cfg = validate_config(edit_config(timestep_sampling="logit_normal", logit_mean=0.2, flow_shift=flow_shift))
    spec = get_model_spec(cfg)
    model = spec.load_denoiser().eval()
    gen = torch.Generator().manual_seed(7)
    target = torch.randn(2, C, 8, 12, generator=gen)
    source = torch.randn(2, C, 8, 12, generator=gen)
    mask = torch.tensor([[1] * 5 + [0] * 11, [1] * 9 + [0] * 7])
    embeds = torch.randn(2, 16, TINY_QWEN_TEXT_HIDDEN, generator=gen) * mask.unsqueeze(-1)
    cond = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
    with torch.no_grad():
        got = spec.training_loss(model, torch.cat([target, source], 1), cond, torch.Generator().manual_seed(3))

        g = torch.Generator().manual_seed(3)
        noise = torch.randn(target.shape, generator=g)  # the target's shape: the source draws no noise
        u = torch.sigmoid(torch.randn(2, generator=g) - 0.2)  # logit_mean: diffusers' sign
        # The pipeline's mu: from the target's packed length alone (4 x 6 = 24 tokens), before the cat.
        sigmas = _shift_by_hand(u, 24) if flow_shift is None else flow_shift * u / (1 + (flow_shift - 1) * u)
        s = sigmas.view(-1, 1, 1, 1)

        def by_hand(source_tokens):
            pred = model(
                hidden_states=torch.cat([_pack((1 - s) * target + s * noise), source_tokens], dim=1),
                encoder_hidden_states=embeds[:, :9],
                encoder_hidden_states_mask=mask[:, :9],
                timestep=sigmas,
                img_shapes=[[(1, 4, 6), (1, 4, 6)]] * 2,
                return_dict=False,
            )[0][:, :24]
            return ((pred - _pack(noise - target)) ** 2).mean(dim=(1, 2))

        want = by_hand(_pack(source))
        noised_source = by_hand(_pack((1 - s) * source + s * noise))
        other = spec.training_loss(
            model, torch.cat([target, source.flip(-1)], 1), cond, torch.Generator().manual_seed(3)
        )
    assert got.shape == (2,)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(got, noised_source, atol=1e-5)  # the source is never noised
    assert not torch.allclose(got, other, atol=1e-5)  # and the prediction depends on it
    with pytest.raises(ValueError, match="clear cache_dir_vae"):
        spec.training_loss(model, target, cond, torch.Generator().manual_seed(3))


def test_lora_loads_in_the_edit_pipeline_and_validation_renders(edit_config, tiny_edit, pipe, tmp_path):
    from diffusers import QwenImageEditPipeline

    from simpletuner.models.adapters import prepare_for_training

    cfg = validate_config(edit_config(lora_rank=4, lora_alpha=4))
    spec = get_model_spec(cfg)
    model = prepare_for_training(spec.load_denoiser(), spec.lora_targets, cfg, torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    path = spec.save_lora(tmp_path, model)
    assert path.name == "pytorch_lora_weights.safetensors"

    loaded = QwenImageEditPipeline.from_pretrained(
        str(tiny_edit), processor=load_edit_processor(str(tiny_edit)), use_safetensors=True
    )
    loaded.set_progress_bar_config(disable=True)
    loaded.load_lora_weights(str(tmp_path))
    noisy = torch.randn(1, 32, 4 * C, generator=gen)  # 16 target tokens, then 16 source tokens
    text = torch.randn(1, 6, TINY_QWEN_TEXT_HIDDEN, generator=gen)
    kwargs = dict(
        encoder_hidden_states=text, timestep=torch.tensor([0.5]), img_shapes=[[(1, 4, 4), (1, 4, 4)]], return_dict=False
    )
    with torch.no_grad():
        assert torch.allclose(loaded.transformer(noisy, **kwargs)[0], model.eval()(noisy, **kwargs)[0], atol=1e-5)
        assert not torch.allclose(pipe.transformer(noisy, **kwargs)[0], model(noisy, **kwargs)[0], atol=1e-3)

    # The pipeline resizes the source to about 1 megapixel whatever the output size: a small output keeps it cheap.
    source = _image(32, 32, 4)

    def render(p, **extra):
        return p(
            image=source,
            prompt="make it red",
            num_inference_steps=2,
            height=32,
            width=32,
            output_type="pt",
            generator=torch.Generator().manual_seed(0),
            **extra,
        ).images

    assert not torch.allclose(render(pipe), render(loaded), atol=1e-3)

    # The validation sampler: called (prompt, image=...), guidance_scale is the true CFG against the negative prompt.
    encoders = spec.load_text_encoders(CPU, torch.float32)
    sampler = spec.build_pipeline(model, spec.load_vae(CPU, torch.float32), encoders)
    sampler.set_progress_bar_config(disable=True)
    args = dict(num_inference_steps=2, height=32, width=32, negative_prompt="blurry", output_type="pt")
    plain = sampler("make it red", image=source, guidance_scale=1.0, generator=torch.Generator().manual_seed(0), **args)
    guided = sampler(
        "make it red", image=source, guidance_scale=4.0, generator=torch.Generator().manual_seed(0), **args
    )
    assert plain.images.shape == (1, 3, 32, 32) and not torch.allclose(plain.images, guided.images, atol=1e-4)
    with pytest.raises(ValueError, match="set `validation_image`"):
        sampler("make it red", guidance_scale=1.0, **args)


def test_sampler_scheduler_follows_flow_shift(edit_config):
    spec = get_model_spec(validate_config(edit_config(flow_shift=3.0)))
    scheduler = spec.sampling_scheduler()
    assert scheduler.config.shift == 3.0 and not scheduler.config.use_dynamic_shifting


def test_edit_plus_and_processorless_folders_are_refused(edit_config, tiny_edit, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_edit, folder)
    index_file = folder / "model_index.json"
    index = json.loads(index_file.read_text())

    index_file.write_text(json.dumps({**index, "_class_name": "QwenImageEditPlusPipeline"}))
    with pytest.raises(ValueError, match=r"QwenImageEditPlusPipeline \(Qwen-Image-Edit-2509.*not supported"):
        get_model_spec(validate_config(edit_config(pretrained_model_name_or_path=str(folder))))

    index_file.write_text(json.dumps({**index, "processor": [None, None]}))
    with pytest.raises(ValueError, match=r"names no processor: a Qwen-Image-Edit folder needs its processor"):
        get_model_spec(validate_config(edit_config(pretrained_model_name_or_path=str(folder))))

    index_file.write_text(json.dumps(index))
    (folder / "processor" / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match=r"preprocessor_config.json does not exist: a Qwen-Image-Edit folder"):
        get_model_spec(validate_config(edit_config(pretrained_model_name_or_path=str(folder))))


@pytest.mark.parametrize("resolution, limits", [(64, {}), (1024, {}), (1024, {"max_pixels": 28 * 28 * 256})])
def test_memory_shapes_use_the_processors_image_tokens(edit_config, tiny_edit, tmp_path, resolution, limits):
    folder = tiny_edit
    if limits:  # a processor config of the older form: min_pixels / max_pixels keys beside `size`
        folder = tmp_path / "model"
        shutil.copytree(tiny_edit, folder)
        config_file = folder / "processor" / "preprocessor_config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **limits}))
    spec = get_model_spec(
        validate_config(edit_config(pretrained_model_name_or_path=str(folder), resolution=resolution))
    )
    latents, cond = spec.batch_shapes(2)
    length = _image_tokens(resolution, resolution, **limits) + 7 + 512
    assert latents == (2, 2 * C, resolution // 8, resolution // 8)
    assert cond == {"prompt_embeds": (2, length, TINY_QWEN_TEXT_HIDDEN), "prompt_embeds_mask": (2, length)}
    if resolution == 64:  # the estimator runs a step on fake tensors of those shapes through training_loss
        from simpletuner.memory.estimator import estimate_memory

        est = estimate_memory(spec.config, device_kind="cpu")
        assert est.latent_shape == (2 * C, 8, 8) and est.activations > 0
