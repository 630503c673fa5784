"""The weights' bytes the pre-flight check counts come from the safetensors headers, with no model class imported.

``component_bytes`` (simpletuner/memory/components.py) must agree with a model built on ``meta`` from the same
folder up to the buffers the file does not hold, pick the files the loader reads (a sharded index, never a
variant), and fall back to the meta build only where there are no safetensors weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from simpletuner.memory.components import component_bytes
from simpletuner.models.spec import read_model_index, resolve_component_class


def _meta_build(root, component):
    """The component built on ``meta`` from its config, as the estimate did before reading headers."""
    import transformers

    library, class_name = read_model_index(root)[component]
    cls = resolve_component_class(library, class_name, "model")
    with torch.device("meta"):
        if library == "diffusers":
            return cls.from_config(cls.load_config(str(root), subfolder=component))
        return cls(transformers.AutoConfig.from_pretrained(str(root / component)))


def _model_components(root):
    """The components of ``root`` whose class is a model (not a tokenizer or scheduler)."""
    out = []
    for name, entry in read_model_index(root).items():
        try:
            resolve_component_class(*entry, "model")
        except (TypeError, ValueError):
            continue
        out.append(name)
    return out


@pytest.mark.parametrize("family", ["sd", "sdxl", "flux", "wan", "sd3"])
def test_header_bytes_match_the_meta_build_up_to_the_buffers_not_in_the_file(zoo, family):
    root = zoo(family)
    components = _model_components(root)
    assert "vae" in components and len(components) >= 3
    for component in components:
        model = _meta_build(root, component)
        in_file = set(model.state_dict())
        params = sum(p.numel() for p in model.parameters())
        persistent = sum(b.numel() for n, b in model.named_buffers() if n in in_file)
        not_persistent = sum(b.nbytes for n, b in model.named_buffers() if n not in in_file)
        meta_fp32 = params * 4 + sum(b.nbytes for b in model.buffers())  # the meta build's figure at fp32
        for dtype in (torch.float32, torch.bfloat16):
            assert component_bytes(root, component, dtype) == (params + persistent) * dtype.itemsize, component
        assert meta_fp32 - component_bytes(root, component, torch.float32) == not_persistent, component


def test_a_sharded_component_is_counted_from_its_index_and_a_variant_file_is_ignored(zoo, tmp_path):
    root = shutil.copytree(zoo("sd"), tmp_path / "model")
    unet = root / "unet"
    single = component_bytes(root, "unet", torch.float32)
    state = load_file(unet / "diffusion_pytorch_model.safetensors")
    names = sorted(state)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[::2]}
    shards["diffusion_pytorch_model-00002-of-00002.safetensors"] = names[1::2]
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, unet / shard)
        weight_map.update(dict.fromkeys(keys, shard))
    (unet / "diffusion_pytorch_model.safetensors").unlink()
    (unet / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # An fp16 variant the loader does not read (no ``variant=`` is passed): a different size, never counted.
    save_file({"extra": torch.zeros(1000)}, unet / "diffusion_pytorch_model.fp16.safetensors")
    assert component_bytes(root, "unet", torch.float32) == single


def test_without_safetensors_weights_the_meta_build_counts_and_unknown_stays_none(zoo, tmp_path):
    root = shutil.copytree(zoo("sd"), tmp_path / "model")
    vae = _meta_build(root, "vae")
    (root / "vae" / "diffusion_pytorch_model.safetensors").unlink()  # a configs-only folder
    expected = sum(p.numel() for p in vae.parameters()) * 2 + sum(b.nbytes for b in vae.buffers())
    assert component_bytes(root, "vae", torch.float16) == expected
    assert component_bytes(root, "safety_checker", torch.float32) is None  # [null, null] in model_index.json
    assert component_bytes(root, "image_encoder", torch.float32) is None
    (root / "model_index.json").unlink()
    assert component_bytes(root, "unet", torch.float32) is None


_PREFLIGHT = textwrap.dedent(
    """
    import dataclasses, json, sys
    import torch
    from simpletuner.configuration import validate_config
    from simpletuner.data_backend import LocalDataBackend, build_metadata
    from simpletuner.hardware.machine import detect_hardware
    from simpletuner.memory.preflight import check_run_memory
    from simpletuner.models import get_model_spec

    config = validate_config(json.loads(sys.argv[1]))
    spec = get_model_spec(config)
    ds = config.datasets[0]

    class Dataset:
        samples = build_metadata(LocalDataBackend(ds.instance_data_dir, ds.id), ds, config, seed=0).samples

    machine = dataclasses.replace(detect_hardware(), device_name=None, gpu_free_bytes=None)
    estimate = check_run_memory(config, spec, [Dataset], torch.float32, machine)
    watched = ("diffusers.models.autoencoders", "diffusers.models.unets", "transformers.models.clip.modeling_clip")
    imported = [m for m in watched if m in sys.modules]
    print(json.dumps({"models": estimate.host["models (weights)"], "imported": imported}))
    """
)


def test_a_cpu_runs_preflight_imports_no_model_module_and_counts_the_weights(make_config, tiny_sd):
    raw = make_config()  # the tiny SD folder and the shapes dataset
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _PREFLIGHT, json.dumps(raw)], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["imported"] == []
    # text_dtype float32: every component at 4 bytes a parameter (the tiny SD has no persistent buffers)
    params = sum(p.numel() for name in ("vae", "text_encoder", "unet") for p in _meta_build(tiny_sd, name).parameters())
    assert result["models"] == params * 4
