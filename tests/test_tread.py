"""TREAD token routing (``tread_config``) on the tiny transformers of every family it trains (sd3, flux, wan,
qwen_image), each rebuilt with four blocks: SimpleTuner's meaning (helpers/training/tread.py, the families'
transformer forwards at SIMPLETUNER_COMMIT), the loss it changes and the one it must not, and a resume."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel

from simpletuner.configuration import validate_config
from simpletuner.models import get_model_spec, tread
from simpletuner.testing.zoo import write_tiny_model

FAMILIES = ("sd3", "flux", "wan", "qwen_image")
#: Four blocks each (Flux: two double-stream, then two single-stream: SimpleTuner's numbering runs across both).
BLOCKS = {"flux": {"num_layers": 2, "num_single_layers": 2}}
CLASSES = {
    "sd3": SD3Transformer2DModel,
    "flux": FluxTransformer2DModel,
    "wan": WanTransformer3DModel,
    "qwen_image": QwenImageTransformer2DModel,
}
#: Blocks 1 and 2 of four (Flux: the second double-stream block and the first single-stream one).
ROUTE = {"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": -2}


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """``family -> folder``: the tiny zoo model with a four-block transformer (random weights, seed 0)."""
    made = {}

    def get(family: str):
        if family not in made:
            folder = write_tiny_model(family, tmp_path_factory.mktemp(f"tread_{family}") / "model")
            cls = CLASSES[family]
            config = dict(cls.load_config(folder, subfolder="transformer"))
            config.update(BLOCKS.get(family, {"num_layers": 4}))
            torch.manual_seed(0)
            cls.from_config(config).save_pretrained(folder / "transformer", safe_serialization=True)
            made[family] = folder
        return made[family]

    return get


def _config(folder, family, routes=None, **extra):
    raw = {
        "pretrained_model_name_or_path": str(folder),
        "model_family": family,
        "resolution": 64,
        "aspect_bucket_alignment": 16,
        "training_type": "full",
        "max_train_steps": 1,
        "datasets": [{"id": "d", "type": "local", "instance_data_dir": str(folder)}],
        **extra,
    }
    if routes is not None:
        raw["tread_config"] = {"routes": routes}
    return validate_config(raw, check_files=False)


def _model(folder, family, routes=None, **extra):
    """The spec and its denoiser as the trainer prepares it (full training: every weight gets a gradient)."""
    spec = get_model_spec(_config(folder, family, routes, **extra))
    torch.manual_seed(0)
    return spec, spec.prepare_denoiser(spec.load_denoiser(), torch.float32)


def _batch(spec, batch_size=2, seed=1):
    """Random cached-batch tensors of the shapes the spec describes."""
    gen = torch.Generator().manual_seed(seed)
    latent_shape, shapes = spec.batch_shapes(batch_size)
    conditioning = {
        k: (torch.ones(s, dtype=torch.int64) if k.endswith("_mask") else torch.randn(s, generator=gen))
        for k, s in shapes.items()
    }
    return torch.randn(latent_shape, generator=gen), conditioning


def _loss(spec, denoiser, seed=3, batch=None, generator=None):
    latents, conditioning = batch or _batch(spec)
    return spec.training_loss(denoiser, latents, conditioning, generator or torch.Generator().manual_seed(seed))


def _route(ratio, start, end):
    return SimpleNamespace(selection_ratio=ratio, start_layer_idx=start, end_layer_idx=end)


# --- what SimpleTuner's routing means ------------------------------------------------------------------------------
def test_budget_and_block_numbering_are_simpletuners(deep):
    """A sample keeps S - round(S * selection_ratio) tokens (tread.py:82, Python's rounding); negative indices count
    from the end of all blocks, Flux's double-stream blocks first (flux/transformer.py:1121); the published examples'
    routes fit the released models (Wan 2.1 1.3B: 30 blocks, Wan 2.2 A14B: 40, Flux.1: 19 + 38)."""
    assert [tread.num_kept(s, r) for s, r in ((4096, 0.5), (16, 0.1), (5, 0.5), (7, 0.5), (4, 0.9))] == [
        2048,
        14,
        3,  # round(2.5) == 2
        3,  # round(3.5) == 4
        1,  # never none
    ]
    spec, denoiser = _model(deep("flux"), "flux", [ROUTE])
    router = tread.routers_in(denoiser)[0]
    assert router.routes == [tread.Route(0.5, 1, 2)]
    blocks = tread.blocks_of(denoiser, router.layout)
    assert blocks[2] is denoiser.single_transformer_blocks[0]
    assert [bool(b._forward_pre_hooks) for b in blocks] == [False, True, True, False]
    wan = [_route(0.1, 2, 8), _route(0.25, 9, 11), _route(0.4, 12, 15), _route(0.25, 16, 23), _route(0.1, 24, -2)]
    assert tread.resolve_routes(wan, 30, "Wan 2.1 1.3B")[-1] == tread.Route(0.1, 24, 28)
    assert tread.resolve_routes(wan, 40, "Wan 2.2 A14B")[-1] == tread.Route(0.1, 24, 38)
    assert tread.resolve_routes([_route(0.5, 2, -2)], 19 + 38, "Flux.1") == [tread.Route(0.5, 2, 55)]


def test_selection_keeps_random_tokens_per_sample_and_masked_ones_always():
    """Each sample's lowest noise values are kept (tread.py:93-107), sorted here; force-kept tokens always, the budget
    growing to the most a sample must keep; nothing is routed when every token would be kept."""
    noise = torch.tensor([[0.9, 0.1, 0.5, 0.3], [0.2, 0.8, 0.7, 0.1]])
    assert torch.equal(tread.select_tokens(noise, 2), torch.tensor([[1, 3], [0, 3]]))
    force = torch.tensor([[True, False, False, False], [True, True, True, False]])
    assert torch.equal(tread.select_tokens(noise, 2, force), torch.tensor([[0, 1, 3], [0, 1, 2]]))
    assert tread.select_tokens(noise, 4) is None
    mask = torch.zeros(1, 1, 4, 4)
    mask[..., :2, 2:] = 1.0  # the top-right 2x2 latent cell: token 1 of the 2x2 token grid
    assert torch.equal(tread.token_mask(mask, 2), torch.tensor([[False, True, False, False]]))


# --- the loss ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_zero_is_the_run_without_routing(deep, family):
    """selection_ratio 0 draws nothing and routes nothing: the same loss, bit for bit, and the same next draw."""
    spec, plain = _model(deep(family), family)
    routed_spec, routed = _model(deep(family), family, [{**ROUTE, "selection_ratio": 0.0}])
    batch = _batch(spec)
    gen, routed_gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(
        _loss(spec, plain, batch=batch, generator=gen), _loss(routed_spec, routed, batch=batch, generator=routed_gen)
    )
    assert torch.equal(gen.get_state(), routed_gen.get_state())


@pytest.mark.parametrize("family", FAMILIES)
def test_routing_changes_the_loss_and_every_block_still_learns(deep, family):
    """Half the tokens skip blocks 1-2: another loss, finite; the same parameters get gradients as without routing
    (the routed blocks see the kept tokens); two SGD steps change every block's weights."""
    spec, plain = _model(deep(family), family)
    routed_spec, routed = _model(deep(family), family, [ROUTE])
    batch = _batch(spec)
    base, loss = _loss(spec, plain, batch=batch), _loss(routed_spec, routed, batch=batch)
    assert torch.isfinite(loss).all() and not torch.equal(base, loss)
    base.sum().backward()
    loss.sum().backward()

    def learning(model):
        return {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}

    assert learning(routed) == learning(plain)
    blocks = tread.blocks_of(routed, tread.routers_in(routed)[0].layout)
    before = [[p.detach().clone() for p in block.parameters()] for block in blocks]
    optimizer = torch.optim.SGD(routed.parameters(), lr=1e-2)
    for seed in (4, 5):
        optimizer.zero_grad()
        step = _loss(routed_spec, routed, seed=seed, batch=batch)
        assert torch.isfinite(step).all()
        step.sum().backward()
        optimizer.step()
    for block, was in zip(blocks, before):
        assert any(not torch.equal(p, w) for p, w in zip(block.parameters(), was))


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_and_no_grad_see_every_token(deep, family):
    """Validation (eval mode) and the regularisation target (no gradients) are never routed
    (flux/transformer.py:1105): the loss of the model without routing."""
    spec, plain = _model(deep(family), family)
    routed_spec, routed = _model(deep(family), family, [ROUTE])
    batch = _batch(spec)
    with torch.no_grad():
        assert torch.equal(_loss(spec, plain, batch=batch), _loss(routed_spec, routed, batch=batch))
    plain.eval()
    routed.eval()
    assert torch.equal(_loss(spec, plain, batch=batch), _loss(routed_spec, routed, batch=batch))


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_tokens_a_loss_mask_covers_are_never_routed(deep, family):
    """With a loss mask, the tokens whose 2x2 latent cell it covers are kept (flux/model.py:824-842): a mask over the
    whole image keeps every token, the loss of the model without routing; weights of 0.4 (under half) keep none."""
    from simpletuner.data_backend.masks import MASK_KEY

    spec, plain = _model(deep(family), family)
    routed_spec, routed = _model(deep(family), family, [ROUTE])
    latents, conditioning = _batch(spec)
    for fill, same in ((1.0, True), (0.4, False)):
        batch = (latents, {**conditioning, MASK_KEY: torch.full((latents.shape[0], 1, *latents.shape[-2:]), fill)})
        assert torch.equal(_loss(spec, plain, batch=batch), _loss(routed_spec, routed, batch=batch)) == same


def test_ti2v_never_routes_the_clean_first_frame(zoo, tmp_path):
    """Wan 2.2 TI2V-5B with ti2v_first_frame: the first latent frame's tokens (clean, timestep 0) are always kept
    (wan/model.py:779, 926-932); its per-token timestep embeddings follow the kept tokens."""
    route = [{"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 0}]
    spec, denoiser = _model(zoo("wan22_ti2v"), "wan", route, ti2v_first_frame=True, aspect_bucket_alignment=32)
    latents = torch.randn(spec.latent_shape(2, frames=9), generator=torch.Generator().manual_seed(1))
    _, shapes = spec.batch_shapes(2)
    conditioning = {k: torch.randn(s) for k, s in shapes.items()}
    frames, height, width = latents.shape[2], latents.shape[3] // 2, latents.shape[4] // 2
    assert torch.isfinite(_loss(spec, denoiser, batch=(latents, conditioning))).all()
    kept = tread.routers_in(denoiser)[0].kept(0)
    assert kept is not None and kept.shape == (2, frames * height * width // 2)
    assert (kept[:, : height * width] == torch.arange(height * width)).all()


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_the_selection_is_the_generators(deep, family):
    """The kept tokens come from the run's noise generator: the same seed routes the same tokens (the same loss),
    another seed others; gradient checkpointing recomputes a block with the forward's tokens."""
    spec, routed = _model(deep(family), family, [ROUTE])
    batch = _batch(spec)
    first, again, other = (_loss(spec, routed, seed=s, batch=batch) for s in (3, 3, 30))
    assert torch.equal(first, again) and not torch.equal(first, other)
    first.sum().backward()
    grads = [p.grad.clone() for p in routed.parameters()]
    _, checkpointed = _model(deep(family), family, [ROUTE], gradient_checkpointing=True)
    recomputed = _loss(spec, checkpointed, seed=3, batch=batch)
    torch.testing.assert_close(recomputed, first)
    recomputed.sum().backward()  # the blocks run again in backward: with the forward's tokens, the same gradients
    for got, want in zip((p.grad for p in checkpointed.parameters()), grads):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_rotary_rows_follow_their_tokens(deep, family, monkeypatch):
    """Every token kept, each sample in its own shuffled order: attention does not care about the order as long as
    each token's rotary rows (Flux, Qwen-Image: one table per sample, attention run per sample; Wan: a batched table)
    and per-token arguments follow it, so the prediction is the one without routing."""

    def shuffled(noise, num_keep, force_keep=None):
        gen = torch.Generator().manual_seed(5)
        return torch.stack([torch.randperm(noise.shape[1], generator=gen) for _ in range(noise.shape[0])])

    spec, plain = _model(deep(family), family)
    routed_spec, routed = _model(deep(family), family, [ROUTE])
    batch = _batch(spec)
    monkeypatch.setattr(tread, "select_tokens", shuffled)
    torch.testing.assert_close(
        _loss(routed_spec, routed, batch=batch), _loss(spec, plain, batch=batch), rtol=1e-5, atol=1e-6
    )


# --- the config ----------------------------------------------------------------------------------------------------
def test_routes_that_do_not_fit_are_refused_when_the_model_folder_is_read(deep):
    routes = [
        {"selection_ratio": 0.5, "start_layer_idx": 1, "end_layer_idx": 9},
        {"selection_ratio": 0.5, "start_layer_idx": 2, "end_layer_idx": 1},
        {"selection_ratio": 0.5, "start_layer_idx": 0, "end_layer_idx": 0},
        {"selection_ratio": 0.5, "start_layer_idx": -1, "end_layer_idx": -1},
        {"selection_ratio": 0.5, "start_layer_idx": -2, "end_layer_idx": 3},
    ]
    with pytest.raises(ValueError) as err:
        get_model_spec(_config(deep("wan"), "wan", routes))
    where = f"the wan transformer in {deep('wan')}"
    assert str(err.value).splitlines() == [
        f"tread_config.routes[0].end_layer_idx 9 is outside the 4 blocks of {where} (0 to 3, or -4 to -1 from the "
        "end): use an index inside",
        f"tread_config.routes[1] starts at block 2 (start_layer_idx 2) after it ends at block 1 (end_layer_idx 1) of "
        f"the 4 of {where}: swap them",
        "tread_config.routes[4] starts at block 2, not after block 3 where routes[3] ends: routes run in order and "
        "must not overlap (SimpleTuner skips such a route and the ones after it): start it at block 4 or later",
    ]
    assert get_model_spec(_config(deep("wan"), "wan", routes[2:4])).config.tread_config is not None


def test_a_unet_family_refuses_tread(tmp_path):
    from training_helpers import config_problems

    raw = {
        "pretrained_model_name_or_path": str(tmp_path),
        "model_family": "sdxl",
        "datasets": [{"id": "d", "type": "local", "instance_data_dir": str(tmp_path)}],
        "tread_config": {"routes": [ROUTE]},
    }
    assert (
        "tread_config routes the tokens of a transformer's blocks, but model_family 'sdxl' is a UNet: remove "
        "tread_config (TREAD trains sd3, flux, wan, qwen_image)"
    ) in config_problems(raw)
    raw["tread_config"] = {"routes": [{**ROUTE, "selection_ratio": 1.0}]}
    raw["model_family"] = "flux"
    assert "tread_config.routes[0].selection_ratio: must be < 1.0, got 1.0" in config_problems(raw)


# --- memory and the run --------------------------------------------------------------------------------------------
def test_the_estimate_counts_the_routed_blocks_activations(deep):
    """The estimator's fake step routes as training does: fewer tokens in blocks 1-2, fewer activation bytes."""
    from simpletuner.memory.estimator import estimate_memory

    folder = deep("flux")
    plain = estimate_memory(_config(folder, "flux", train_batch_size=2), device_kind="cpu")
    routed = estimate_memory(_config(folder, "flux", [ROUTE], train_batch_size=2), device_kind="cpu")
    assert routed.activations < plain.activations
    assert routed.weights == plain.weights and routed.gradients == plain.gradients


def test_a_resumed_run_routes_as_the_uninterrupted_one(make_config, deep, tmp_path):
    """The selections come from the checkpointed noise generator: resumed at step 2 of 3, the same losses and
    weights bit for bit (and the trainer does route: the losses are not those of the run without routing)."""
    from safetensors.torch import load_file
    from training_helpers import same_weights, straight_and_resumed, train

    model = {"pretrained_model_name_or_path": str(deep("flux")), "model_family": "flux"}
    common = {**model, "tread_config": {"routes": [ROUTE]}}
    (_, straight), (_, resumed) = straight_and_resumed(make_config, tmp_path, 3, 2, **common)
    assert resumed.losses == straight.losses[2:]
    _, plain = train(make_config(max_train_steps=3, output_dir=str(tmp_path / "plain"), **model))
    assert plain.losses[0] != straight.losses[0]
    assert same_weights(load_file(straight.output_path), load_file(resumed.output_path))
