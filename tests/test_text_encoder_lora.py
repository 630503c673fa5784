"""``train_text_encoder`` (sd, sdxl): a LoRA on each CLIP text encoder trains with the UNet's, captions are encoded in
each step from the token ids the text cache holds, and the adapter file loads into the family's pipeline with
``load_lora_weights`` (and as kohya's file) to the model that trained. Tiny zoo models, two steps in fp32."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from training_helpers import same_weights, tiny_config, train

from simpletuner.configuration import ConfigError, validate_config
from simpletuner.configuration.simpletuner import translate as dialect
from simpletuner.models import get_model_spec
from simpletuner.models.text_encoder_lora import TEXT_ENCODER_GROUP, UNetWithTextEncoders

ENCODERS = {"sd": ("text_encoder",), "sdxl": ("text_encoder", "text_encoder_2")}
TE_RATE = 5e-4


def _raw(zoo, shapes_dir, root, family, **overrides):
    settings = {
        "model_family": family,
        "train_text_encoder": True,
        "text_encoder_lr": TE_RATE,
        "max_train_steps": 2,
        "mixed_precision": "no",  # the pipeline below loads fp32 weights: the same base, so outputs compare exactly
    }
    return tiny_config(zoo(family), shapes_dir, root, **{**settings, **overrides})


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module", params=list(ENCODERS))
def trained(request, zoo, shapes_dir, tmp_path_factory):
    """``(family, trainer, result, log lines)`` of a two-step run that trains the text encoders, validates and
    writes a kohya file too."""
    family = request.param
    raw = _raw(
        zoo,
        shapes_dir,
        tmp_path_factory.mktemp(f"te_{family}"),
        family,
        output_formats=["diffusers", "kohya"],
        validation_prompt="a red square",
        validation_steps=2,
        validation_num_inference_steps=1,
    )
    lines, package = _Lines(), logging.getLogger("simpletuner")
    level = package.level
    package.addHandler(lines)
    package.setLevel(logging.INFO)
    try:
        trainer, result = train(raw)
    finally:
        package.removeHandler(lines)
        package.setLevel(level)
    return family, trainer, result, lines.lines


def _model(trainer) -> UNetWithTextEncoders:
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert isinstance(model, UNetWithTextEncoders)
    return model


def _ups(module: torch.nn.Module) -> list[torch.Tensor]:
    """The LoRA up-projections (peft's ``lora_B``, zero at the start) of ``module``."""
    layers = [m.lora_B["default"] for m in module.modules() if isinstance(m, LoraLayer)]
    return [w for layer in layers if isinstance(w := layer.weight, torch.Tensor)]


def _ids(trainer, captions=("a red square", "a blue circle")) -> dict[str, torch.Tensor]:
    return trainer.spec.token_ids(trainer.validator.text_encoders, list(captions))


def test_a_step_trains_the_text_encoders_lora_and_the_unets(trained):
    family, trainer, result, lines = trained
    model = _model(trainer)
    assert set(model.encoders()) == set(ENCODERS[family])
    for part in [model.unet, *model.encoders().values()]:
        ups = _ups(part)
        assert ups and all(u.abs().sum() > 0 for u in ups)  # zero before the first step
    for name, encoder in model.encoders().items():
        trained = [n.split(".") for n, p in encoder.named_parameters() if p.requires_grad]
        assert {n[-4] for n in trained} == {"q_proj", "k_proj", "v_proj", "out_proj"}
        layers = {int(n[n.index("layers") + 1]) for n in trained}
        # sdxl's first encoder is read at its penultimate layer: its last one would get no gradient
        last = encoder.config.num_hidden_layers - (family == "sdxl" and name == "text_encoder")
        assert layers == set(range(last))
    groups = {g["name"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert groups == {"default": 1e-3, TEXT_ENCODER_GROUP: TE_RATE}
    said = [line for line in lines if line.startswith("train_text_encoder:")]
    assert len(said) == 1 and "each step encodes its captions" in said[0] and "token ids" in said[0]
    assert len(result.losses) == 2 and result.validation_images


def test_the_text_cache_holds_token_ids_and_each_step_embeds_them(trained):
    """No embedding of a trained encoder is cached: a batch carries each encoder's token ids (int64), and the
    model's forward embeds them with the encoders being trained."""
    family, trainer, _, _ = trained
    samples = trainer.state.datasets[0].samples[:1]
    batch = trainer.data.batch(samples, torch.device("cpu"))
    ids = {"input_ids", "input_ids_2"} if family == "sdxl" else {"input_ids"}
    assert ids <= set(batch.conditioning) and not {"prompt_embeds", "pooled_prompt_embeds"} & set(batch.conditioning)
    assert all(batch.conditioning[k].dtype == torch.int64 for k in ids)
    expected = trainer.spec.token_ids(trainer.validator.text_encoders, [samples[0].caption])
    assert all(torch.equal(batch.conditioning[k], expected[k]) for k in ids)


def _pipeline(trainer):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(trainer.config.pretrained_model_name_or_path, use_safetensors=True)


@pytest.mark.parametrize("fmt", ["diffusers", "kohya"])
def test_the_saved_file_loads_with_the_pipeline_to_the_trained_model(trained, fmt):
    """``load_lora_weights`` on the final file (and on its kohya export): the pipeline's text encoders give the
    trained encoders' outputs, and its UNet on them the trained model's prediction."""
    family, trainer, result, _ = trained
    path = result.output_path
    if fmt == "kohya":
        path = path.with_name("pytorch_lora_weights.kohya.safetensors")
        assert any(k.startswith("lora_te") for k in load_file(path))
    pipe = _pipeline(trainer)
    pipe.load_lora_weights(str(path))
    model, spec, ids = _model(trainer), trainer.spec, _ids(trainer)
    loaded = {name: getattr(pipe, name) for name in ENCODERS[family]}
    gen = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 4, 8, 8, generator=gen)
    timesteps = torch.tensor([10, 500])
    with torch.no_grad():
        ours, theirs = spec.embed(model.encoders(), ids), spec.embed(loaded, ids)
        for name in ours:
            torch.testing.assert_close(theirs[name], ours[name], rtol=1e-5, atol=1e-5)
        base = spec.embed({n: getattr(_pipeline(trainer), n) for n in ENCODERS[family]}, ids)
        assert not torch.allclose(base["prompt_embeds"], ours["prompt_embeds"], atol=1e-4)  # the LoRA counts
        want = model(noisy, timesteps, ids)
        got = spec.unet_predict(pipe.unet, noisy, timesteps, theirs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_validation_samples_with_the_trained_encoders(trained):
    family, trainer, _, _ = trained
    model = _model(trainer)
    pipe = trainer.spec.build_pipeline(model, trainer.validator.vae, trainer.validator.text_encoders)
    assert pipe.unet is model.unet
    for name in ENCODERS[family]:
        assert getattr(pipe, name) is model.text_encoders[name]
    assert not any(isinstance(v, torch.nn.Module) for v in trainer.validator.text_encoders.values())  # tokenizers


def test_the_card_says_the_text_encoders_were_trained(trained):
    from simpletuner.training.model_card import CardFacts, model_card

    _, trainer, _, _ = trained
    facts = CardFacts("org/x", None, 2, 1, ("pytorch_lora_weights.safetensors",))
    assert f"- Text encoders: trained, a LoRA on each at learning rate {TE_RATE:g}" in model_card(trainer.config, facts)
    plain = trainer.config.model_copy(update={"train_text_encoder": False, "text_encoder_lr": None})
    assert "- Text encoders: not trained" in model_card(plain, facts)


def test_the_estimate_counts_the_encoders_adapter_and_embeds_their_ids(trained):
    """The estimator's meta model is the trained one: the same trainable elements; its batch holds token ids."""
    from simpletuner.memory.estimator import batch_shapes, estimate_memory

    family, trainer, _, _ = trained
    estimate = estimate_memory(trainer.config, device_kind="cpu")
    trainable = sum(p.numel() for p in _model(trainer).parameters() if p.requires_grad)
    assert estimate.num_trainable_parameters == trainable
    _, shapes = batch_shapes(trainer.config, 2)
    ids = {"input_ids", "input_ids_2"} if family == "sdxl" else {"input_ids"}
    assert set(shapes) == ids and all(s.dtype == torch.int64 for s in shapes.values())
    plain = estimate_memory(trainer.config.model_copy(update={"train_text_encoder": False}), device_kind="cpu")
    assert plain.num_trainable_parameters < trainable and plain.weights < estimate.weights


def test_a_resumed_run_equals_the_uninterrupted_one(zoo, shapes_dir, tmp_path):
    """Resumed at step 1 of 2: the encoders' adapter and their optimizer group come back; the same losses and
    weights bit for bit."""
    common = dict(checkpoint_at_end=False)
    _, straight = train(_raw(zoo, shapes_dir, tmp_path / "a", "sd", **common))
    root = tmp_path / "b"
    train(_raw(zoo, shapes_dir, root, "sd", max_train_steps=1, checkpointing_steps=1, **common))
    trainer, resumed = train(_raw(zoo, shapes_dir, root, "sd", resume_from_checkpoint="latest", **common))
    assert resumed.losses == straight.losses[1:]
    weights = load_file(straight.output_path)
    assert any(k.startswith("text_encoder.") for k in weights)
    assert same_weights(weights, load_file(resumed.output_path))
    state = trainer.optimizer.state_dict()
    assert [g["lr"] for g in state["param_groups"]] == [1e-3, TE_RATE]


# --- configuration ---------------------------------------------------------------------------------------------
def _problems(raw) -> str:
    with pytest.raises(ConfigError) as caught:
        validate_config(raw, check_files=False)
    return str(caught.value)


@pytest.mark.parametrize(
    "overrides, says",
    [
        ({"model_family": "flux"}, "model_family 'flux''s text encoders are not trained here"),
        ({"training_type": "full"}, "a full fine-tune of them is not supported"),
        ({"lora_type": "lycoris"}, "use lora_type 'standard'"),
        ({"train_text_encoder": False}, "text_encoder_lr is the learning rate of the text encoders' LoRA"),
        ({"optimizer": "prodigy", "learning_rate": 1.0}, "text_encoder_lr 0.0005 with optimizer prodigy"),
    ],
)
def test_what_cannot_train_the_text_encoders_is_refused(make_config, overrides, says):
    raw = make_config(**{"train_text_encoder": True, "text_encoder_lr": TE_RATE, **overrides})
    assert says in _problems(raw)


def test_simpletuners_keys(tmp_path):
    (tmp_path / "multidatabackend.json").write_text(
        json.dumps([{"id": "d", "type": "local", "instance_data_dir": "x"}])
    )
    top = {
        "model_type": "lora",
        "model_family": "sd1x",
        "pretrained_model_name_or_path": "model",
        "data_backend_config": "multidatabackend.json",
        "max_train_steps": 10,
    }
    native, report = dialect.translate({**top, "train_text_encoder": "true", "text_encoder_lr": "5e-6"}, None, tmp_path)
    assert (native["train_text_encoder"], native["text_encoder_lr"]) == (True, 5e-6)
    assert any(line.startswith("`train_text_encoder`") for line in report.approximated)
    native, report = dialect.translate({**top, "text_encoder_lr": 5e-6}, None, tmp_path)
    assert "text_encoder_lr" not in native and any("`text_encoder_lr`" in line for line in report.ignored)


def test_gradient_checkpointing_keeps_the_encoders_gradients(zoo_config):
    """Checkpointed encoder layers take a frozen embedding's output (no gradient): their LoRA still gets one."""
    spec = get_model_spec(validate_config(zoo_config("sd", train_text_encoder=True, gradient_checkpointing=True)))
    model = spec.prepare_denoiser(spec.load_denoiser(), torch.float32)
    assert isinstance(model, UNetWithTextEncoders) and model.text_encoders["text_encoder"].is_gradient_checkpointing
    ids = spec.token_ids(spec.load_text_encoders(torch.device("cpu"), torch.float32), ["a red square"])
    loss = spec.training_loss(model, torch.randn(1, 4, 8, 8), ids, torch.Generator().manual_seed(0))
    loss.sum().backward()
    grads = [p.grad for n, p in model.text_encoders.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_the_family_specs_without_the_switch_are_unchanged(zoo_config):
    """Off, the cache keeps embeddings under the identity it always had, and the denoiser is the plain UNet."""
    for family in ENCODERS:
        raw = zoo_config(family)
        spec = get_model_spec(validate_config(raw))
        on = get_model_spec(validate_config({**raw, "train_text_encoder": True}))
        assert spec.text_encoder_identity() != on.text_encoder_identity()
        assert set(spec.batch_shapes(1)[1]) >= {"prompt_embeds"}
        assert not isinstance(spec.denoiser_from_config(), UNetWithTextEncoders)
        assert isinstance(on.denoiser_from_config(), UNetWithTextEncoders)


@pytest.mark.slow
def test_two_processes_train_the_text_encoders(zoo, shapes_dir, tmp_path):
    """DDP over the UNet and both sdxl encoders in one module: every adapted layer reaches the loss (the first
    encoder's unread last layer has none), so DDP needs no unused-parameter search (with one there, step 2 fails)."""
    from test_distributed import _launch, _write

    raw = _raw(zoo, shapes_dir, tmp_path, "sdxl", train_batch_size=1)
    proc = _launch(_write(raw, tmp_path / "cfg.json"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    weights = load_file(tmp_path / "output" / "pytorch_lora_weights.safetensors")
    ups = [t for k, t in weights.items() if k.startswith("text_encoder") and "lora_B" in k]
    assert ups and all(t.abs().sum() > 0 for t in ups)
