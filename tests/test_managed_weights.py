"""managed_memory frozen_weights against the recording fake runtime (tests/fake_cuda.py), on tiny
real diffusers models: which storages are placed and advised, in which order, and the exact
prefetch / event order of the weight prefetcher forward and backward, with and without gradient
checkpointing, for one transformer, a UNet, Flux's two block lists and both Wan 2.2 experts."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from fake_cuda import FakeRuntime
from peft import LoraConfig
from torch import nn

from simpletuner.gh200.managed_weights import PlacedWeights, WeightPrefetcher, place_frozen_weights, weight_units
from simpletuner.hardware.runtime import use_runtime
from simpletuner.models.wan22 import WanExperts

SENTINEL = 0xA5  # what a fresh managed allocation is filled with, to see when the values arrive


class CopyWatchingRuntime(FakeRuntime):
    """The fake, with fresh managed memory filled with SENTINEL bytes and, at every advise and
    prefetch, whether the values had been copied in yet (any byte differs from the sentinel)."""

    def __init__(self):
        super().__init__()
        self.filled_at: list[tuple[str, bool]] = []

    def managed_empty(self, shape, dtype):
        t = super().managed_empty(shape, dtype)
        t.view(torch.uint8).fill_(SENTINEL) if t.numel() else None
        return t

    def _filled(self, tensor) -> bool:
        raw = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
        return bool((raw != SENTINEL).any())

    def advise(self, tensor, advice, location):
        super().advise(tensor, advice, location)
        self.filled_at.append((advice, self._filled(tensor)))

    def prefetch(self, tensor, location, stream=None):
        super().prefetch(tensor, location, stream)
        self.filled_at.append(("prefetch", self._filled(tensor)))


# --- tiny models ---


def tiny_wan(num_layers: int = 3, seed: int = 0):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=num_layers,
        rope_max_seq_len=32,
    )


def wan_inputs(seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 4, 1, 8, 8, generator=gen),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=gen),
        return_dict=False,
    )


def with_lora(model: nn.Module) -> nn.Module:
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k"], init_lora_weights=False))
    return model


def tiny_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=8,
        norm_num_groups=8,
    )


def tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=24,
        pooled_projection_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(2, 2, 4),
    )


def flux_inputs() -> dict:
    gen = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(1, 16, 16, generator=gen),
        encoder_hidden_states=torch.randn(1, 4, 24, generator=gen),
        pooled_projections=torch.randn(1, 16, generator=gen),
        timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(4, 3),
        return_dict=False,
    )


# --- reading the fake's calls ---


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def frozen_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    named = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    return named | dict(model.named_buffers())


def unit_storages(model: nn.Module) -> dict[str, set[int]]:
    """unit name -> the storage addresses of its frozen parameters and buffers."""
    return {u.name: {storage_ptr(t) for t in frozen_tensors(u.module).values()} for u in weight_units(model)}


def trace(runtime: FakeRuntime, model: nn.Module) -> list[tuple[str, str]]:
    """The prefetcher's calls as ("prefetch", unit) / ("wait", unit), clearing them. Checks on the
    way that each prefetch moves exactly its unit's storages, once each, to GPU 0 on the one side
    stream, followed by one event recorded on that stream."""
    storages = unit_storages(model)
    unit_of = {ptr: name for name, ptrs in storages.items() for ptr in ptrs}
    streams = [c.detail for c in runtime.ops("new_stream")]
    assert len(streams) <= 1
    out, batch, event_unit = [], [], getattr(runtime, "_event_unit", {})
    gates, gated = set(), False  # events on the compute stream the side stream waits for before prefetching
    for call in runtime.calls:
        if call.op == "prefetch":
            assert (call.location, call.detail) == (0, streams[0])
            assert gated, "a prefetch queued before the side stream waited for the compute stream"
            batch.append(call.ptr)
        elif call.op == "record_event" and call.location is None:
            gates.add(call.detail)
        elif call.op == "record_event":
            assert call.location == streams[0]
            (name,) = {unit_of[ptr] for ptr in batch}
            assert sorted(batch) == sorted(storages[name])  # one call per storage, all of them
            event_unit[call.detail] = name
            out.append(("prefetch", name))
            batch = []
        elif call.op == "wait_event" and call.location is not None:
            assert call.location == streams[0] and call.detail in gates
            gated = True
        elif call.op == "wait_event":
            gated = False  # a unit started: its prefetches need a gate of their own
            out.append(("wait", event_unit[call.detail]))
    assert not batch
    runtime._event_unit = event_unit
    runtime.calls = [c for c in runtime.calls if c.op == "new_stream"]
    return out


def step(model, inputs, runtime, backward: bool = True) -> tuple[list, list]:
    out = model(**inputs)[0]
    forward = trace(runtime, model)
    if not backward:
        return forward, []
    out.float().square().mean().backward()
    return forward, trace(runtime, model)


def forward_chain(names: list[str]) -> list[tuple[str, str]]:
    """blocks_ahead 1 in a pass after the first: unit i prefetches i+1, unit i+1 waits for it."""
    out = []
    for following in names[1:]:
        out += [("prefetch", following), ("wait", following)]
    return out


# --- placement ---


def test_frozen_weights_are_advised_before_the_copy_and_trainables_stay(caplog):
    model = with_lora(tiny_wan())
    inputs = wan_inputs()
    reference = model(**inputs)[0]
    trainable = {n: (p, p.data_ptr()) for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: t.detach().clone() for n, t in frozen_tensors(model).items()}
    sizes = sorted(t.untyped_storage().nbytes() for t in frozen_tensors(model).values())
    runtime = CopyWatchingRuntime()

    with use_runtime(runtime), caplog.at_level(logging.INFO, "simpletuner.gh200.managed_weights"):
        placed = place_frozen_weights(model)

    # Per storage: allocate, advise preferred CPU then accessed by GPU 0 (still empty), copy, prefetch to the CPU.
    assert len(runtime.calls) == 4 * len(frozen)
    for alloc, preferred, accessed, prefetch in zip(*[iter(runtime.calls)] * 4):
        assert alloc.op == "managed_alloc" and {preferred.ptr, accessed.ptr, prefetch.ptr} == {alloc.ptr}
        assert preferred.nbytes == accessed.nbytes == prefetch.nbytes == alloc.nbytes
        assert (preferred.op, preferred.detail, preferred.location) == ("advise", "preferred_location", "cpu")
        assert (accessed.op, accessed.detail, accessed.location) == ("advise", "accessed_by", 0)
        assert (prefetch.op, prefetch.location, prefetch.detail) == ("prefetch", "cpu", None)
    assert runtime.filled_at == [("preferred_location", False), ("accessed_by", False), ("prefetch", True)] * len(
        frozen
    )
    assert sorted(c.nbytes for c in runtime.ops("managed_alloc")) == sizes
    now = frozen_tensors(model)
    assert {storage_ptr(t) for t in now.values()} == {c.ptr for c in runtime.ops("managed_alloc")}
    assert all(torch.equal(now[n], frozen[n]) and now[n].dtype == frozen[n].dtype for n in frozen)
    for name, (param, ptr) in trainable.items():
        current = dict(model.named_parameters())[name]
        assert current is param and param.data_ptr() == ptr and not runtime.is_managed(param)
    assert torch.equal(model(**inputs)[0], reference)

    lora_bytes = sum(p.numel() * p.element_size() for p, _ in trainable.values())
    assert placed == PlacedWeights(num_tensors=len(frozen), placed_bytes=sum(sizes), trainable_bytes=lora_bytes)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "simpletuner.gh200.managed_weights"]
    assert f"{len(frozen)} frozen tensors ({sum(sizes) / 1024**3:.2f} GiB) placed" in line

    runtime.calls.clear()
    with use_runtime(runtime):
        again = place_frozen_weights(model)
    assert again.num_tensors == again.placed_bytes == 0 and runtime.calls == []


def test_tied_storages_are_placed_once_and_stay_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            whole = torch.arange(48, dtype=torch.float32).reshape(3, 16)
            self.head = nn.Parameter(whole[0].view(4, 4), requires_grad=False)  # two views of one storage
            self.tail = nn.Parameter(whole[2], requires_grad=False)
            self.embed = nn.Linear(4, 4)
            self.out = nn.Linear(4, 4)
            self.out.weight = self.embed.weight  # one Parameter in two modules
            self.embed.requires_grad_(False)
            self.trained = nn.Parameter(torch.ones(8))  # with out.bias: what stays trainable
            self.register_buffer("alias", self.trained.data[:4])  # frozen view of a trainable storage

    model = Tied()
    runtime = FakeRuntime()
    with use_runtime(runtime):
        placed = place_frozen_weights(model)

    allocs = runtime.ops("managed_alloc")
    # head+tail: one byte-sized allocation of the whole 3x16 storage; embed weight once; embed bias.
    assert sorted((c.nbytes, c.detail) for c in allocs) == [(16, (4,)), (64, (4, 4)), (192, (192,))]
    assert model.out.weight is model.embed.weight and runtime.is_managed(model.out.weight)
    assert storage_ptr(model.head) == storage_ptr(model.tail) and runtime.is_managed(model.head)
    assert (model.head.storage_offset(), model.tail.storage_offset()) == (0, 32)
    assert torch.equal(model.head, torch.arange(16.0).view(4, 4)) and torch.equal(model.tail, torch.arange(32.0, 48))
    assert not runtime.is_managed(model.alias) and storage_ptr(model.alias) == storage_ptr(model.trained)
    assert placed == PlacedWeights(num_tensors=4, placed_bytes=192 + 64 + 16, trainable_bytes=32 + 16)


def test_a_quantised_weight_is_refused_by_name_before_anything_is_allocated():
    class Quantised(torch.Tensor):
        pass

    model = tiny_wan(num_layers=1)
    model.requires_grad_(False)
    weight = model.blocks[0].ffn.net[2].weight
    model.blocks[0].ffn.net[2].weight = nn.Parameter(
        torch.Tensor._make_subclass(Quantised, weight.data), requires_grad=False
    )
    runtime = FakeRuntime()
    with use_runtime(runtime), pytest.raises(ValueError, match=r"blocks\.0\.ffn\.net\.2\.weight is a Quantised"):
        place_frozen_weights(model)
    assert runtime.calls == []


# --- the prefetcher ---

WAN_UNITS = ["blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_prefetch_order_one_ahead_forward_and_backward(checkpointing):
    model = with_lora(tiny_wan())
    if checkpointing:
        model.enable_gradient_checkpointing()
    inputs = wan_inputs()
    runtime = FakeRuntime()
    with use_runtime(runtime), warnings.catch_warnings():
        warnings.simplefilter("error")  # no autograd-hook warnings
        place_frozen_weights(model)
        runtime.calls.clear()
        with WeightPrefetcher(model, blocks_ahead=1) as prefetcher:
            assert [u.name for u in prefetcher.units] == WAN_UNITS
            first_forward, first_backward = step(model, inputs, runtime)
            later = [step(model, inputs, runtime) for _ in range(2)]

    assert first_forward == []  # the order is not known yet: pages are read in place
    backward = [("prefetch", "blocks.1"), ("wait", "blocks.1"), ("prefetch", "blocks.0"), ("wait", "blocks.0")]
    assert first_backward == backward
    for forward, back in later:
        assert forward == forward_chain(WAN_UNITS) and back == backward
    assert len(runtime.ops("new_stream")) == 1


def test_two_ahead_prefetches_two_and_waits_before_each():
    model = with_lora(tiny_wan(num_layers=4))
    attention = model.blocks[1].attn1
    # Two parameters on one storage: placed as one allocation, prefetched once (trace checks).
    attention.to_out[0].weight = nn.Parameter(attention.to_v.weight.data, requires_grad=False)
    inputs = wan_inputs()
    runtime = FakeRuntime()
    with use_runtime(runtime):
        place_frozen_weights(model)
        runtime.calls.clear()
        with WeightPrefetcher(model, blocks_ahead=2):
            step(model, inputs, runtime)
            forward, backward = step(model, inputs, runtime)
    p, w = "prefetch", "wait"
    assert forward == [
        (p, "blocks.1"),
        (p, "blocks.2"),
        (w, "blocks.1"),
        (p, "blocks.3"),
        (w, "blocks.2"),
        (w, "blocks.3"),
    ]
    assert backward == [
        (p, "blocks.2"),
        (p, "blocks.1"),
        (w, "blocks.2"),
        (p, "blocks.0"),
        (w, "blocks.1"),
        (w, "blocks.0"),
    ]


def test_order_is_learned_from_execution_not_registration():
    class Reversed(nn.Module):
        """Registers ``late`` first but runs ``early`` first; some weights frozen by hand."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.late = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.early = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            for block in [*self.late, *self.early]:
                block.weight.requires_grad_(False)

        def forward(self, x):
            for block in [*self.early, *self.late]:
                x = torch.tanh(block(x))
            return (x,)

    model = Reversed()
    runtime = FakeRuntime()
    with use_runtime(runtime):
        place_frozen_weights(model)
        runtime.calls.clear()
        with WeightPrefetcher(model, blocks_ahead=1):
            step(model, {"x": torch.randn(2, 8)}, runtime)
            forward, backward = step(model, {"x": torch.randn(2, 8)}, runtime)
    order = ["early.0", "early.1", "late.0", "late.1"]
    assert forward == forward_chain(order)
    assert backward == forward_chain(order[::-1])


# Registered attentions before resnets, run resnet, attention, resnet.
MID_BLOCK = ["mid_block.resnets.0", "mid_block.attentions.0", "mid_block.resnets.1"]


def test_unet_and_flux_block_lists_in_execution_order():
    unet = with_lora(tiny_unet())
    unet_inputs = dict(
        sample=torch.randn(1, 4, 8, 8),
        timestep=torch.tensor([10]),
        encoder_hidden_states=torch.randn(1, 4, 16),
        return_dict=False,
    )
    flux = with_lora(tiny_flux())
    for model, inputs, order in (
        (unet, unet_inputs, ["down_blocks.0", "down_blocks.1", *MID_BLOCK, "up_blocks.0", "up_blocks.1"]),
        (
            flux,
            flux_inputs(),
            [
                "transformer_blocks.0",
                "transformer_blocks.1",
                "single_transformer_blocks.0",
                "single_transformer_blocks.1",
            ],
        ),
    ):
        runtime = FakeRuntime()
        with use_runtime(runtime):
            place_frozen_weights(model)
            runtime.calls.clear()
            with WeightPrefetcher(model, blocks_ahead=1):
                assert step(model, inputs, runtime)[0] == []
                forward, backward = step(model, inputs, runtime)
        assert forward == forward_chain(order), type(model).__name__
        assert backward == forward_chain(order[::-1]), type(model).__name__


def test_idle_wan22_expert_is_placed_but_never_prefetched():
    experts = WanExperts(with_lora(tiny_wan(num_layers=2, seed=0)), tiny_wan(num_layers=2, seed=1), 875.0)
    experts.transformer_2.requires_grad_(False)  # train_stages high: the low-noise expert is idle
    inputs = {k: v for k, v in wan_inputs().items() if k != "return_dict"}
    runtime = FakeRuntime()
    with use_runtime(runtime):
        place_frozen_weights(experts)
        idle = frozen_tensors(experts.transformer_2).values()
        assert all(runtime.is_managed(t) for t in idle)
        runtime.calls.clear()
        with WeightPrefetcher(experts, blocks_ahead=1) as prefetcher:
            assert len(prefetcher.units) == 4
            passes = [step(experts, inputs | {"route": (True,)}, runtime) for _ in range(3)]
            # Validation reaching the low-noise expert: its blocks are a sequence of their own, so the
            # high expert's last block never prefetches them and their first pass reads in place.
            with torch.no_grad():
                low = [step(experts, inputs | {"route": (False,)}, runtime, backward=False)[0] for _ in range(3)]
            passes += [step(experts, inputs | {"route": (True,)}, runtime) for _ in range(2)]

    high = ["transformer.blocks.0", "transformer.blocks.1"]
    assert passes[0] == ([], forward_chain(high[::-1]))
    assert passes[1:] == [(forward_chain(high), forward_chain(high[::-1]))] * 4
    assert low == [[]] + [forward_chain(["transformer_2.blocks.0", "transformer_2.blocks.1"])] * 2


def test_no_prefetch_no_hooks_and_remove_takes_every_hook_off():
    model = with_lora(tiny_wan())
    runtime = FakeRuntime()

    def hook_counts():
        return [(len(u.module._forward_pre_hooks), len(u.module._forward_hooks)) for u in weight_units(model)]

    with use_runtime(runtime):
        place_frozen_weights(model)
        before = hook_counts()
        runtime.calls.clear()
        off = WeightPrefetcher(model, blocks_ahead=0)
        assert off.units == [] and hook_counts() == before
        for _ in range(2):
            step(model, wan_inputs(), runtime)
        assert runtime.calls == []

        prefetcher = WeightPrefetcher(model, blocks_ahead=1)
        assert hook_counts() == [(n + 1, m + 1) for n, m in before]
        prefetcher.remove()
        prefetcher.remove()
        assert hook_counts() == before
        for _ in range(2):
            step(model, wan_inputs(), runtime)
        assert runtime.calls == []

        with pytest.raises(ValueError, match="blocks_ahead must be a whole number >= 0"):
            WeightPrefetcher(model, blocks_ahead=-1)


def test_units_without_managed_weights_get_no_hooks():
    model = with_lora(tiny_wan())
    runtime = FakeRuntime()
    with use_runtime(runtime):  # nothing placed: nothing to prefetch
        prefetcher = WeightPrefetcher(model, blocks_ahead=1)
    assert prefetcher.units == []
    assert all(not u.module._forward_pre_hooks for u in weight_units(model))
