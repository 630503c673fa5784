"""The qwen_image family on its tiny zoo model: prompt embeddings equal to QwenImagePipeline's own
``encode_prompt`` (cached padded to 512 with a mask), latents normalised as the pipeline decodes
them, the flow-matching loss on packed latents by hand (dynamic and static shift), the padding
never changing the prediction, a LoRA that loads into QwenImagePipeline and changes its images,
and a folder with a text encoder of another class refused before anything loads. LoRA training
through the Trainer and the memory estimate: test_families.py."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from simpletuner.configuration import validate_config
from simpletuner.models import QwenImageSpec, get_model_spec
from simpletuner.models.qwen_image import PROMPT_TEMPLATE, QWEN_MAX_LENGTH, TEMPLATE_DROP
from simpletuner.testing.zoo import TINY_QWEN_LATENT_CHANNELS, TINY_QWEN_TEXT_HIDDEN

CPU = torch.device("cpu")


@pytest.fixture
def tiny_qwen(zoo):
    return zoo("qwen_image")


@pytest.fixture
def qwen_config(zoo_config):
    return lambda **overrides: zoo_config("qwen_image", **overrides)


def _pipeline(folder):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(folder), use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _pack(x):
    """[B, C, h, w] -> [B, (h/2)(w/2), 4C], written out: token (i, j) holds channels c of the
    2x2 patch in (c, dy, dx) order."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)


def test_family_is_read_from_the_folder_and_images_are_normalised(make_config, tiny_qwen):
    raw = make_config(pretrained_model_name_or_path=str(tiny_qwen))
    raw.pop("model_family")
    cfg = validate_config(raw)
    assert cfg.model_family == "qwen_image"
    spec = get_model_spec(cfg)
    assert isinstance(spec, QwenImageSpec) and spec.dynamic_shift
    assert spec.vae_scale_from_folder() == 8 and spec.latent_patch_from_folder() == 2
    vae = spec.load_vae(CPU, torch.float32)
    pixels = torch.rand(2, 3, 32, 48) * 2 - 1
    got = spec.encode_images(vae, pixels)
    assert got.shape == (2, TINY_QWEN_LATENT_CHANNELS, 4, 6)  # 4-D: the one frame is dropped
    # The pipeline decodes latents * std + mean: that must give back the VAE's own latents.
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1)
    raw_latents = vae.encode(pixels.unsqueeze(2)).latent_dist.mode()[:, :, 0]
    assert not torch.allclose(std, torch.ones_like(std))
    assert torch.allclose(got * std + mean, raw_latents, atol=1e-5)


def test_prompt_embeddings_equal_the_pipelines_encode_prompt(qwen_config, tiny_qwen):
    long_caption = " ".join(["a red cat"] * 250)  # far more than 512 tokens: cut to 512, as the pipeline does
    captions = ["a red square", "a blue circle on a grey background", "", long_caption]
    spec = get_model_spec(validate_config(qwen_config()))
    encoders = spec.load_text_encoders(CPU, torch.float32)
    out = spec.encode_prompts(encoders, captions)
    tokenizer = encoders["tokenizer"]
    # The tiny tokenizer splits the template's system prompt into the 34 tokens the pipeline drops.
    prefix = tokenizer(PROMPT_TEMPLATE.split("{}")[0]).input_ids
    assert len(prefix) == TEMPLATE_DROP and tokenizer.convert_ids_to_tokens(prefix[-3:]) == [
        "<|im_start|>",
        "user",
        "\u010a",
    ]
    pipe = _pipeline(tiny_qwen)
    for i, caption in enumerate(captions):
        cond = out[i]
        assert cond["prompt_embeds"].shape == (QWEN_MAX_LENGTH, TINY_QWEN_TEXT_HIDDEN)
        assert cond["prompt_embeds_mask"].dtype == torch.int64
        n = len(tokenizer(PROMPT_TEMPLATE.format(caption)).input_ids) - TEMPLATE_DROP
        assert int(cond["prompt_embeds_mask"].sum()) == min(n, QWEN_MAX_LENGTH)
        with torch.no_grad():  # one caption at a time: the pipeline's own length, no padding
            embeds, mask = pipe.encode_prompt(caption, device="cpu", max_sequence_length=QWEN_MAX_LENGTH)
        length = embeds.shape[1]
        assert length == min(n, QWEN_MAX_LENGTH) and mask is None
        assert torch.allclose(cond["prompt_embeds"][:length], embeds[0], atol=1e-5)
        assert not cond["prompt_embeds"][length:].any() and not cond["prompt_embeds_mask"][length:].any()
    # A batch of the pipeline pads to its longest caption with a mask: ours, cut to that, is the same.
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(captions[:3], device="cpu", max_sequence_length=QWEN_MAX_LENGTH)
    stacked = {k: torch.stack([c[k] for c in out[:3]]) for k in out[0]}
    got, got_mask = QwenImageSpec.text_inputs(stacked)
    assert torch.equal(got_mask, mask) and torch.allclose(got, embeds, atol=1e-5)


def test_padding_never_changes_the_prediction(qwen_config):
    spec = get_model_spec(validate_config(qwen_config()))
    model = spec.load_denoiser().eval()
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 7]
    embeds = torch.zeros(2, QWEN_MAX_LENGTH, TINY_QWEN_TEXT_HIDDEN)
    mask = torch.zeros(2, QWEN_MAX_LENGTH, dtype=torch.int64)
    for i, n in enumerate(lengths):
        embeds[i, :n] = torch.randn(n, TINY_QWEN_TEXT_HIDDEN, generator=gen)
        mask[i, :n] = 1
    noisy = torch.randn(2, 16, 4 * TINY_QWEN_LATENT_CHANNELS, generator=gen)
    sigmas = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        ours = spec.predict(model, noisy, sigmas, {"prompt_embeds": embeds, "prompt_embeds_mask": mask}, (8, 8))
        for i, n in enumerate(lengths):  # each sample alone, unpadded, as the pipeline calls it
            alone = model(
                hidden_states=noisy[i : i + 1],
                encoder_hidden_states=embeds[i : i + 1, :n],
                encoder_hidden_states_mask=None,
                timestep=sigmas[i : i + 1],
                img_shapes=[[(1, 4, 4)]],
                return_dict=False,
            )[0]
            assert torch.allclose(ours[i : i + 1], alone, atol=1e-5)


def _shift_by_hand(u, seq_len, time_shift="exponential"):
    """Qwen-Image's scheduler: mu linear in the token count from 0.5 at 256 to 0.9 at 8192."""
    slope = (0.9 - 0.5) / (8192 - 256)
    mu = 0.5 + slope * (seq_len - 256)
    if time_shift == "linear":
        return mu / (mu + (1 / u - 1))
    return math.exp(mu) / (math.exp(mu) + (1 / u - 1))


@pytest.mark.parametrize("flow_shift", [None, 3.0])
def test_loss_is_flow_matching_on_packed_latents(qwen_config, flow_shift):
    from diffusers import QwenImagePipeline

    cfg = validate_config(qwen_config(timestep_sampling="logit_normal", logit_mean=0.2, flow_shift=flow_shift))
    spec = get_model_spec(cfg)
    model = spec.load_denoiser().eval()
    gen = torch.Generator().manual_seed(7)
    latents = torch.randn(2, TINY_QWEN_LATENT_CHANNELS, 8, 12, generator=gen)
    mask = torch.tensor([[1] * 5 + [0] * (QWEN_MAX_LENGTH - 5), [1] * 9 + [0] * (QWEN_MAX_LENGTH - 9)])
    embeds = torch.randn(2, QWEN_MAX_LENGTH, TINY_QWEN_TEXT_HIDDEN, generator=gen) * mask.unsqueeze(-1)
    cond = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
    with torch.no_grad():
        got = spec.training_loss(model, latents, cond, torch.Generator().manual_seed(3))

        g = torch.Generator().manual_seed(3)
        noise = torch.randn(latents.shape, generator=g)
        u = torch.sigmoid(torch.randn(2, generator=g) - 0.2)  # logit_mean: diffusers' sign
        if flow_shift is None:  # 4 x 6 = 24 packed tokens
            sigmas = _shift_by_hand(u, 24)
        else:
            sigmas = flow_shift * u / (1 + (flow_shift - 1) * u)
        s = sigmas.view(-1, 1, 1, 1)
        noisy = (1 - s) * latents + s * noise
        assert torch.equal(_pack(noisy), QwenImagePipeline._pack_latents(noisy, 2, TINY_QWEN_LATENT_CHANNELS, 8, 12))
        pred = model(
            hidden_states=_pack(noisy),
            encoder_hidden_states=embeds[:, :9],
            encoder_hidden_states_mask=mask[:, :9],
            timestep=sigmas,
            img_shapes=[[(1, 4, 6)]] * 2,
            return_dict=False,
        )[0]
        want = ((pred - _pack(noise - latents)) ** 2).mean(dim=(1, 2))
    assert got.shape == (2,)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)


def test_linear_time_shift_is_read_from_the_scheduler():
    from simpletuner.models.packed import dynamic_shift_sigmas

    u = torch.tensor([0.2, 0.5, 0.9])
    base = {"base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192}
    expo = dynamic_shift_sigmas(u, 1024, base)
    linear = dynamic_shift_sigmas(u, 1024, {**base, "time_shift_type": "linear"})
    assert torch.allclose(expo, _shift_by_hand(u, 1024)) and torch.allclose(linear, _shift_by_hand(u, 1024, "linear"))


def test_lora_loads_in_the_pipeline_and_changes_its_images(qwen_config, tiny_qwen, tmp_path):
    from simpletuner.models.adapters import prepare_for_training

    cfg = validate_config(qwen_config(lora_rank=4, lora_alpha=4))
    spec = get_model_spec(cfg)
    model = prepare_for_training(spec.load_denoiser(), spec.lora_targets, cfg, torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    path = spec.save_lora(tmp_path, model)
    assert path.name == "pytorch_lora_weights.safetensors"

    def render(pipe):
        return pipe(
            "a red square",
            num_inference_steps=2,
            height=32,
            width=32,
            output_type="pt",
            generator=torch.Generator().manual_seed(0),
        ).images

    base = _pipeline(tiny_qwen)
    loaded = _pipeline(tiny_qwen)
    loaded.load_lora_weights(str(tmp_path))
    noisy = torch.randn(1, 16, 4 * TINY_QWEN_LATENT_CHANNELS, generator=gen)
    text = torch.randn(1, 6, TINY_QWEN_TEXT_HIDDEN, generator=gen)
    kwargs = dict(encoder_hidden_states=text, timestep=torch.tensor([0.5]), img_shapes=[[(1, 4, 4)]], return_dict=False)
    with torch.no_grad():
        assert torch.allclose(loaded.transformer(noisy, **kwargs)[0], model.eval()(noisy, **kwargs)[0], atol=1e-5)
        assert not torch.allclose(base.transformer(noisy, **kwargs)[0], model(noisy, **kwargs)[0], atol=1e-3)
    assert not torch.allclose(render(base), render(loaded), atol=1e-3)

    # The validation sampler: the config's guidance scale is Qwen-Image's true CFG against the negative prompt.
    encoders = spec.load_text_encoders(CPU, torch.float32)
    sampler = spec.build_pipeline(model, spec.load_vae(CPU, torch.float32), encoders)
    sampler.set_progress_bar_config(disable=True)
    args = dict(num_inference_steps=2, height=32, width=32, negative_prompt="blurry", output_type="pt")
    plain = sampler("a red square", guidance_scale=1.0, generator=torch.Generator().manual_seed(0), **args).images
    guided = sampler("a red square", guidance_scale=4.0, generator=torch.Generator().manual_seed(0), **args).images
    assert plain.shape == (1, 3, 32, 32) and not torch.allclose(plain, guided, atol=1e-4)


def test_a_text_encoder_of_another_class_is_refused_before_loading(qwen_config, tiny_qwen, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["text_encoder"] = ["transformers", "T5EncoderModel"]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError) as err:
        get_model_spec(validate_config(qwen_config(pretrained_model_name_or_path=str(folder))))
    message = str(err.value)
    assert "transformers.T5EncoderModel" in message and "Qwen2_5_VLForConditionalGeneration" in message

    # model_index.json right, but the text_encoder folder holds another model: its config.json says so.
    index["text_encoder"] = ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    (folder / "model_index.json").write_text(json.dumps(index))
    config = json.loads((folder / "text_encoder" / "config.json").read_text())
    config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    (folder / "text_encoder" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"describes Qwen2ForCausalLM.*needs the text encoder Qwen2_5_VL"):
        get_model_spec(validate_config(qwen_config(pretrained_model_name_or_path=str(folder))))


def test_simpletuner_flavours(tmp_path):
    from simpletuner.configuration.simpletuner import translate as dialect

    base = {"model_family": "qwen_image", "pretrained_model_name_or_path": str(tmp_path)}
    with pytest.raises(dialect.DialectError, match=r"Edit Plus model \(several source images per sample\)"):
        dialect.translate({**base, "model_flavour": "edit-v2+"}, None, tmp_path)
    native, _ = dialect.translate({**base, "model_flavour": "v1.0"}, None, tmp_path)
    assert native["model_family"] == "qwen_image"
