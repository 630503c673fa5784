"""The GH200 batch hook on the trainer's data path, against the recording fake CUDA runtime.

``CachedData`` (what the trainer iterates) calls ``optimize_batch_for_gh200`` once per prepared
micro-batch. With `unified_memory` caches the store prefetches each distinct entry before the
batch is stacked, the batch is stacked into managed memory, and the hook then advises the
stacked fields by role and prefetches them to the training device: every call is checked here,
in order, batch by batch.
"""

from __future__ import annotations

import logging

import pytest
import torch

from simpletuner.caching import MemoryTensorStore, open_caches
from simpletuner.data_backend.metadata import Sample
from simpletuner.data_backend.sampler import BucketSampler
from simpletuner.gh200 import uvm
from simpletuner.gh200.uvm import ENV_ALIAS, ENV_VAR, optimize_batch_for_gh200, set_uvm_hint_override
from simpletuner.hardware.runtime import NoCudaRuntime, use_runtime
from simpletuner.training.batches import CachedData

BATCH = 3
NUM_SAMPLES = 6
CAPTIONS = ("a red circle", "a blue square")  # batches repeat captions: their entries are read once per batch
LATENT_SHAPE = (4, 8, 8)
EMBED_SHAPE = (7, 16)
CPU = torch.device("cpu")  # the training device here; the fake's GPU is device 0


@pytest.fixture(autouse=True)
def _no_hint_env(monkeypatch):
    for name in (ENV_VAR, ENV_ALIAS):
        monkeypatch.delenv(name, raising=False)


def _samples() -> list[Sample]:
    return [
        Sample(
            key=f"ds/{i}.png",
            dataset_id="ds",
            path=f"{i}.png",
            caption=CAPTIONS[i % 2],
            original_size=(64, 64),
            bucket=(64, 64),
            crop_style="center",
            crop_seed=0,
        )
        for i in range(NUM_SAMPLES)
    ]


def _cached_data(tmp_path, kind: str = "unified_memory") -> tuple[CachedData, list[Sample]]:
    """Real caches of ``kind``, filled with one latent per sample and one embedding per caption."""
    samples = _samples()
    vae, text = open_caches(tmp_path / "cache", "sd", None, kind, kind, persistent=False)
    latent_keys = {s.key: f"latent-{s.key}" for s in samples}
    text_keys = {c: f"text-{c}" for c in CAPTIONS}
    vae.fill(
        [(latent_keys[s.key], i) for i, s in enumerate(samples)],
        lambda ids: [{"latents": torch.full(LATENT_SHAPE, float(i))} for i in ids],
        batch_size=8,
    )
    text.fill(
        [(text_keys[c], i) for i, c in enumerate(CAPTIONS)],
        lambda ids: [{"prompt_embeds": torch.full(EMBED_SHAPE, float(i))} for i in ids],
        batch_size=8,
    )
    return CachedData(vae, text, latent_keys, text_keys, {}), samples


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _entry_names(data: CachedData) -> dict[int, str]:
    """Address of every cached entry's allocation -> a readable name."""
    names = {}
    for cache in (data.vae_cache, data.text_cache):
        for key, entry in cache.store._entries.items():
            for tensor in entry.values():
                names[_ptr(tensor)] = key
    return names


def _read_batches(data: CachedData, runtime, num: int):
    """``num`` batches from ``CachedData.iterate`` and the runtime calls made while preparing each."""
    sampler = BucketSampler(_samples(), BATCH, seed=0)
    batches = data.iterate(sampler, CPU)
    out = []
    for _ in range(num):
        before = len(runtime.calls)
        batch = next(batches)
        out.append((batch, runtime.calls[before:]))
    return out


def test_each_prepared_batch_gets_exactly_one_batch_level_placement_and_prefetch(fake_runtime, tmp_path):
    set_uvm_hint_override(True, "test")
    data, _ = _cached_data(tmp_path)
    entries = _entry_names(data)
    num_batches = 2 * NUM_SAMPLES // BATCH  # two epochs
    for batch, calls in _read_batches(data, fake_runtime, num_batches):
        latents, embeds = batch.latents, batch.conditioning["prompt_embeds"]
        assert latents.shape == (BATCH, *LATENT_SHAPE) and embeds.shape == (BATCH, *EMBED_SHAPE)
        assert [float(v) for v in latents[:, 0, 0, 0]] == [float(s.key.split("/")[1][:-4]) for s in batch.samples]
        names = {**entries, _ptr(latents): "batch:latents", _ptr(embeds): "batch:prompt_embeds"}
        seen = [(c.op, names.get(c.ptr, "?"), c.location, c.detail) for c in calls]

        distinct_captions = list(dict.fromkeys(s.caption for s in batch.samples))
        expected = [("prefetch", f"latent-{s.key}", 0, None) for s in batch.samples]  # each entry, to the GPU
        expected.append(("managed_alloc", "batch:latents", None, (BATCH, *LATENT_SHAPE)))  # stacked in managed memory
        expected += [("prefetch", f"text-{c}", 0, None) for c in distinct_captions]  # a repeated caption: once
        expected.append(("managed_alloc", "batch:prompt_embeds", None, (BATCH, *EMBED_SHAPE)))
        expected += [  # the batch hook, once: placement by role, then a prefetch to the training device
            ("advise", "batch:latents", "cpu", "preferred_location"),
            ("advise", "batch:latents", 0, "accessed_by"),
            ("prefetch", "batch:latents", "cpu", None),
            ("advise", "batch:prompt_embeds", 0, "preferred_location"),
            ("prefetch", "batch:prompt_embeds", "cpu", None),
        ]
        assert seen == expected
        prefetched = [c.ptr for c in calls if c.op == "prefetch"]
        assert len(prefetched) == len(set(prefetched)), "a range was prefetched twice for one batch"
    assert fake_runtime.synchronized == 0  # nothing waits for the GPU


def test_eval_batches_go_through_the_same_hook(fake_runtime, tmp_path):
    set_uvm_hint_override(True, "test")
    data, samples = _cached_data(tmp_path)
    fake_runtime.calls.clear()
    batch = data.batch(samples[:2], CPU)
    hook = [
        (c.op, c.detail, c.location)
        for c in fake_runtime.calls
        if c.ptr in (_ptr(batch.latents), _ptr(batch.conditioning["prompt_embeds"]))
    ]
    assert hook == [
        ("managed_alloc", (2, *LATENT_SHAPE), None),
        ("managed_alloc", (2, *EMBED_SHAPE), None),
        ("advise", "preferred_location", "cpu"),
        ("advise", "accessed_by", 0),
        ("prefetch", None, "cpu"),
        ("advise", "preferred_location", 0),
        ("prefetch", None, "cpu"),
    ]


def test_hints_off_by_default_the_hook_and_the_store_make_no_calls(fake_runtime, tmp_path):
    """Unified caches opened with hints only off by default still hold managed memory, unadvised."""
    data, _ = _cached_data(tmp_path)
    for batch, calls in _read_batches(data, fake_runtime, 2):
        assert [c.op for c in calls] == ["managed_alloc", "managed_alloc"]
        assert torch.equal(
            batch.conditioning["prompt_embeds"][0],
            torch.full(EMBED_SHAPE, float(CAPTIONS.index(batch.samples[0].caption))),
        )


@pytest.mark.parametrize("kind", ["disk", "memory"])
def test_cpu_caches_give_ordinary_batches_and_no_calls(fake_runtime, tmp_path, kind):
    set_uvm_hint_override(True, "test")
    data, _ = _cached_data(tmp_path, kind)
    assert fake_runtime.calls == []
    for batch, calls in _read_batches(data, fake_runtime, 2):
        assert calls == []
        assert not fake_runtime.is_managed(batch.latents)


class _Untouchable(dict):
    """A batch that fails if anything looks inside it."""

    def items(self):
        raise AssertionError("the hook walked the batch although hints are off")

    def values(self):
        raise AssertionError("the hook walked the batch although hints are off")


@pytest.mark.parametrize("runtime", [NoCudaRuntime(), None], ids=["no-cuda", "hints-off"])
def test_hook_returns_at_once_without_cuda_or_hints(fake_runtime, runtime):
    if runtime is None:
        set_uvm_hint_override(False, "test")
        runtime = fake_runtime
    else:
        set_uvm_hint_override(True, "test")
    batch = _Untouchable(latents=torch.ones(2))
    with use_runtime(runtime):
        assert optimize_batch_for_gh200(batch, CPU) is batch
    assert fake_runtime.calls == []


def test_hook_advises_and_prefetches_one_allocation_once(fake_runtime):
    """Two fields viewing one allocation: placement and prefetch cover the allocation, once."""
    set_uvm_hint_override(True, "test")
    base = fake_runtime.managed_empty((2, 8), torch.float32)
    fake_runtime.calls.clear()
    batch = {"prompt_embeds": base[0], "pooled_prompt_embeds": base[1], "latents": base}
    assert optimize_batch_for_gh200(batch, "cuda:1") is batch
    assert [(c.op, c.detail, c.location, c.nbytes) for c in fake_runtime.calls] == [
        ("advise", "preferred_location", 1, 64),  # the first role seen wins
        ("prefetch", None, 1, 64),
    ]


def test_hook_goes_to_the_training_device_on_the_given_stream(fake_runtime):
    set_uvm_hint_override(True, "test")
    lat = fake_runtime.managed_empty((2, 4), torch.float32)
    emb = fake_runtime.managed_empty((2, 3), torch.float16)
    mask = fake_runtime.managed_empty((2, 3), torch.int64)
    fake_runtime.calls.clear()
    stream = type("Stream", (), {"cuda_stream": 99})()
    optimize_batch_for_gh200(
        {"latents": lat, "conditioning": {"encoder_hidden_states": emb, "attention_mask": mask}},
        torch.device("cuda:2"),
        stream,
    )
    assert [(c.op, c.ptr, c.detail, c.location) for c in fake_runtime.calls] == [
        ("advise", _ptr(lat), "preferred_location", "cpu"),
        ("advise", _ptr(lat), "accessed_by", 2),
        ("prefetch", _ptr(lat), 99, 2),
        ("advise", _ptr(emb), "preferred_location", 2),
        ("prefetch", _ptr(emb), 99, 2),
        ("advise", _ptr(mask), "preferred_location", 2),
        ("prefetch", _ptr(mask), 99, 2),
    ]


def test_stacking_falls_back_to_torch_stack_without_managed_memory(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    uvm._reset_for_tests()
    set_uvm_hint_override(True, "test")
    try:
        with use_runtime(NoCudaRuntime()):
            data, samples = _cached_data(tmp_path)
            batch = data.batch(samples[:3], CPU)
    finally:
        uvm._reset_for_tests()
    assert isinstance(data.vae_cache.store, MemoryTensorStore)
    assert batch.latents.shape == (3, *LATENT_SHAPE) and batch.latents.device.type == "cpu"
    assert any("keeping the cache in plain CPU memory" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
def test_real_cuda_stacks_a_unified_batch_into_managed_memory_and_places_it():
    from simpletuner.gh200.uvm import stack_unified, to_unified
    from simpletuner.hardware.runtime import CudaBindingsRuntime

    rt = CudaBindingsRuntime()
    reason = rt.unavailable_reason()
    if reason is not None:
        pytest.skip(f"managed memory unavailable: {reason}")
    uvm._reset_for_tests()
    set_uvm_hint_override(True, "test")
    try:
        with use_runtime(rt):
            rows = [to_unified(torch.full((256,), float(i)), "cpu") for i in range(3)]  # 3 KiB in all
            stacked = stack_unified(rows)
            assert rt.is_managed(stacked) and stacked.shape == (3, 256)
            fields = {
                "latents": stacked,
                "conditioning": {"prompt_embeds": stack_unified([to_unified(torch.ones(8), "gpu")])},
            }
            assert optimize_batch_for_gh200(fields, torch.device("cuda", rt.current_device())) is fields
            rt.synchronize()
            assert [float(v) for v in stacked[:, 0].cpu()] == [0.0, 1.0, 2.0]
    finally:
        uvm._reset_for_tests()
