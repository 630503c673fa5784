"""Safe loading: a config or a model folder is data, never code.

(a) the package's source has no ``torch.load`` without ``weights_only=True``, no pickle,
    ``eval``/``exec``/``compile``/``__import__``, no ``trust_remote_code``;
(b) weights we did not write come from safetensors only: every weights ``from_pretrained``
    passes ``use_safetensors=True`` and a folder holding only pickle weights is refused,
    with the fix, before anything loads;
(c) no config value or ``model_index.json`` entry picks a module, class or callable: the
    family is a Literal looked up in a dict, each family loads fixed classes, and the class
    names a folder gives are only compared against an allow-list.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import simpletuner
from simpletuner.configuration import validate_config
from simpletuner.models import MODEL_FAMILIES, get_model_spec
from simpletuner.models.spec import pickle_only_weights, resolve_component_class
from simpletuner.state import StateTracker

PACKAGE = Path(simpletuner.__file__).parent
ROOT = PACKAGE.parent
SOURCES = sorted(PACKAGE.rglob("*.py"))

#: Unpickling modules: importing any of them is refused outright.
PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
#: Builtins that run or import code given as a string.
CODE_BUILTINS = {"eval", "exec", "compile", "__import__"}
#: ``from_pretrained`` receivers that read only JSON/text (no weights): no ``use_safetensors``.
NO_WEIGHTS_SUFFIXES = ("Tokenizer", "TokenizerFast", "Scheduler", "Config", "Processor", "FeatureExtractor")
#: Weight-loading entry points that must pass ``use_safetensors=True``.
WEIGHT_LOADERS = {"from_pretrained", "load_lora_weights", "load_attn_procs", "from_single_file"}
#: Files that may call ``importlib.import_module`` (the argument is built from a constant table).
IMPORT_MODULE_ALLOWED = {
    "simpletuner/gh200/__init__.py",
    "simpletuner/cli/__init__.py",
    "simpletuner/models/__init__.py",
}
#: Files that may look a class up by a name read from a model folder (only through the allow-list).
CLASS_LOOKUP_ALLOWED = {"simpletuner/models/spec.py"}
#: Files that still do ``getattr(diffusers|transformers, name_from_model_index)`` directly. They
#: should call ``simpletuner.models.spec.resolve_component_class`` (see the strict xfail below).


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _trees():
    for path in SOURCES:
        yield _rel(path), ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _dotted(node: ast.AST) -> str:
    """``torch.load`` for ``Attribute(Name(torch), load)``; ``""`` for anything not a plain name chain."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _keyword_is_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def _calls(tree):
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


# --- (a) the source ---------------------------------------------------------------------------
def test_the_source_scan_finds_the_package():
    assert len(SOURCES) > 30 and any(p.name == "checkpoint.py" for p in SOURCES)


def test_every_torch_load_passes_weights_only_true():
    offenders, seen = [], 0
    for rel, tree in _trees():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "torch"
                and any(a.name == "load" for a in node.names)
            ):
                offenders.append(f"{rel}:{node.lineno}: `from torch import load` hides torch.load from this check")
        for call in _calls(tree):
            if _dotted(call.func) in ("torch.load", "torch.serialization.load"):
                seen += 1
                if not _keyword_is_true(call, "weights_only"):
                    offenders.append(f"{rel}:{call.lineno}: torch.load without weights_only=True")
    assert not offenders, "\n".join(offenders)
    assert seen, "no torch.load found at all: the scan is looking at the wrong thing"


def test_no_pickle_eval_exec_or_dynamic_import():
    offenders = []
    for rel, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PICKLE_MODULES:
                        offenders.append(f"{rel}:{node.lineno}: import {alias.name}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
                offenders.append(f"{rel}:{node.lineno}: from {node.module} import ...")
            elif isinstance(node, ast.Call):
                name = _dotted(node.func)
                if name in CODE_BUILTINS or name in {f"builtins.{b}" for b in CODE_BUILTINS}:
                    offenders.append(f"{rel}:{node.lineno}: {name}(...)")
                if name.endswith("import_module") and rel not in IMPORT_MODULE_ALLOWED:
                    offenders.append(f"{rel}:{node.lineno}: {name}(...) outside {sorted(IMPORT_MODULE_ALLOWED)}")
                if name in ("np.load", "numpy.load") and not any(
                    k.arg == "allow_pickle" and isinstance(k.value, ast.Constant) and k.value.value is False
                    for k in node.keywords
                ):
                    offenders.append(f"{rel}:{node.lineno}: {name} without allow_pickle=False")
                if name.split(".")[-1] in ("load", "loads") and name.split(".")[0] in PICKLE_MODULES:
                    offenders.append(f"{rel}:{node.lineno}: {name}(...)")
    assert not offenders, "\n".join(offenders)


def test_the_lazy_gh200_import_only_takes_names_from_its_own_table():
    source = (PACKAGE / "gh200" / "__init__.py").read_text()
    assert "if name not in _EXPORTS" in source and "_EXPORTS[name]" in source


def test_the_lazy_family_table_only_imports_its_own_model_modules():
    import simpletuner.models as models

    assert all(v.startswith("simpletuner.models.") for v in models._SPEC_CLASSES.values())
    assert not hasattr(models, "os_system")  # a name outside the table is not looked up
    with pytest.raises(KeyError):
        models.MODEL_FAMILIES["os"]


def test_trust_remote_code_and_custom_code_are_never_passed():
    offenders = []
    for rel, tree in _trees():
        for call in _calls(tree):
            for k in call.keywords:
                if k.arg in ("trust_remote_code", "custom_pipeline", "custom_revision"):
                    offenders.append(f"{rel}:{call.lineno}: {k.arg}=")
                if k.arg is None and isinstance(k.value, ast.Dict):  # **{"trust_remote_code": ...}
                    keys = {key.value for key in k.value.keys if isinstance(key, ast.Constant)}
                    if keys & {"trust_remote_code", "custom_pipeline"}:
                        offenders.append(f"{rel}:{call.lineno}: {keys}")
    assert not offenders, "\n".join(offenders)


# --- (b) safetensors only ---------------------------------------------------------------------
def test_every_weights_from_pretrained_passes_use_safetensors():
    offenders, checked = [], 0
    for rel, tree in _trees():
        for call in _calls(tree):
            if not isinstance(call.func, ast.Attribute) or call.func.attr not in WEIGHT_LOADERS:
                continue
            receiver = call.func.value
            receiver_name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
            if call.func.attr == "from_pretrained" and receiver_name.endswith(NO_WEIGHTS_SUFFIXES):
                continue  # JSON / vocab files only
            checked += 1
            if not _keyword_is_true(call, "use_safetensors"):
                offenders.append(f"{rel}:{call.lineno}: {receiver_name}.{call.func.attr} without use_safetensors=True")
    assert not offenders, "\n".join(offenders)
    assert checked >= 3  # unet, vae, text encoder


def _copy_model(tiny_sd: Path, dest: Path) -> Path:
    shutil.copytree(tiny_sd, dest)
    return dest


def _resave_as_pickle(model: Path, component: str) -> None:
    """Replace ``component``'s safetensors with a pickle ``.bin`` (what old checkpoints ship)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    cls = {"unet": UNet2DConditionModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModel}[component]
    loaded = cls.from_pretrained(model / component)
    for f in (model / component).glob("*.safetensors"):
        f.unlink()
    if component == "text_encoder":  # transformers 5 always writes safetensors: pickle it by hand
        torch.save(loaded.state_dict(), model / component / "pytorch_model.bin")
    else:
        loaded.save_pretrained(model / component, safe_serialization=False)
    assert list((model / component).glob("*.bin")) and not list((model / component).glob("*.safetensors"))


@pytest.fixture
def no_unpickling(monkeypatch):
    """Fail the test if anything reaches torch.load (how diffusers/transformers read a .bin)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"torch.load was called on {args[:1]}")

    monkeypatch.setattr(torch, "load", refuse)


@pytest.mark.parametrize(
    "component,weights", [("unet", "diffusion_pytorch_model.bin"), ("text_encoder", "pytorch_model.bin")]
)
def test_a_pickle_only_model_folder_is_refused_with_the_fix(
    component, weights, tiny_sd, tmp_path, make_config, no_unpickling
):
    model = _copy_model(tiny_sd, tmp_path / "model")
    _resave_as_pickle(model, component)
    assert pickle_only_weights(model / component) == [weights]
    raw = make_config(pretrained_model_name_or_path=str(model))
    with pytest.raises(ValueError) as info:
        get_model_spec(validate_config(raw))
    message = str(info.value)
    assert str(model / component) in message and weights in message
    assert "safetensors only" in message and "safe_serialization=True" in message

    # The trainer refuses it at set-up, before scanning datasets or encoding anything.
    from simpletuner.training.trainer import Trainer

    with pytest.raises(ValueError, match="only pickle weights"):
        Trainer(StateTracker(validate_config(raw), raw)).train()
    assert not (tmp_path / "cache").exists()


def test_use_safetensors_refuses_pickle_even_past_the_folder_check(
    tiny_sd, tmp_path, make_config, monkeypatch, no_unpickling
):
    model = _copy_model(tiny_sd, tmp_path / "model")
    _resave_as_pickle(model, "unet")
    spec_cls = MODEL_FAMILIES["sd"]
    monkeypatch.setattr(spec_cls, "check_model_folder", lambda self: None)
    spec = get_model_spec(validate_config(make_config(pretrained_model_name_or_path=str(model))))
    with pytest.raises(OSError, match="safetensors"):
        spec.load_denoiser()


def test_a_folder_with_both_formats_loads_the_safetensors(tiny_sd, tmp_path, make_config, no_unpickling):
    model = _copy_model(tiny_sd, tmp_path / "model")
    (model / "unet" / "diffusion_pytorch_model.bin").write_bytes(b"not even a pickle")
    spec = get_model_spec(validate_config(make_config(pretrained_model_name_or_path=str(model))))
    assert sum(p.numel() for p in spec.load_denoiser().parameters()) > 0
    assert spec.load_vae(torch.device("cpu"), torch.float32) is not None
    assert spec.load_text_encoders(torch.device("cpu"), torch.float32)["text_encoder"] is not None


def test_configs_only_and_hub_ids_are_not_refused(tiny_sd, tmp_path, make_config):
    configs = tmp_path / "configs_only"
    shutil.copytree(tiny_sd, configs, ignore=shutil.ignore_patterns("*.safetensors"))
    get_model_spec(validate_config(make_config(pretrained_model_name_or_path=str(configs)), check_files=False))
    get_model_spec(validate_config(make_config(pretrained_model_name_or_path="org/some-model"), check_files=False))


# --- (c) no config value or folder entry picks code ------------------------------------------------
@pytest.mark.parametrize("family", ["os", "os.system", "simpletuner.models.sd", "__import__"])
def test_model_family_is_a_closed_set(family, make_config):
    with pytest.raises(ValueError, match="model_family"):
        validate_config(make_config(model_family=family))
    forged = validate_config(make_config()).model_copy(update={"model_family": family})
    with pytest.raises(ValueError, match=r"is not one of .*\bsd\b"):
        get_model_spec(forged)


@pytest.mark.parametrize("key", ["trust_remote_code", "custom_pipeline", "model_class", "unet_class"])
def test_config_keys_that_would_name_code_are_rejected(key, make_config):
    with pytest.raises(ValueError, match=key):
        validate_config(make_config(**{key: "os.system"}))


@pytest.mark.parametrize(
    "component,entry",
    [
        ("unet", ["os", "system"]),
        ("unet", ["builtins", "eval"]),
        ("unet", ["diffusers", "UNet2DModel"]),
        ("vae", ["diffusers", "utils"]),
        ("text_encoder", ["transformers", "pipeline"]),
        ("tokenizer", ["transformers", "AutoTokenizer.register"]),
        ("scheduler", ["os", "system"]),
        ("scheduler", ["diffusers", "__import__"]),
        ("unet", None),
        ("unet", [None, None]),
    ],
)
def test_model_index_naming_anything_else_is_refused(component, entry, tiny_sd, tmp_path, make_config, monkeypatch):
    monkeypatch.setattr(os, "system", lambda *a: pytest.fail("os.system was called"))
    model = _copy_model(tiny_sd, tmp_path / "model")
    index = json.loads((model / "model_index.json").read_text())
    index[component] = entry
    (model / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError) as info:
        get_model_spec(validate_config(make_config(pretrained_model_name_or_path=str(model))))
    message = str(info.value)
    assert "model_index.json" in message and repr(component) in message


def test_unused_components_of_model_index_are_ignored(tiny_sd, tmp_path, make_config):
    model = _copy_model(tiny_sd, tmp_path / "model")
    index = json.loads((model / "model_index.json").read_text())
    index["safety_checker"] = ["stable_diffusion", "StableDiffusionSafetyChecker"]  # never loaded
    index["scheduler"] = ["diffusers", "PNDMScheduler"]  # the family builds its own DDPM scheduler
    (model / "model_index.json").write_text(json.dumps(index))
    spec = get_model_spec(validate_config(make_config(pretrained_model_name_or_path=str(model))))
    assert type(spec.load_noise_scheduler()).__name__ == "DDPMScheduler"


def test_the_family_loads_fixed_classes(tiny_sd, make_config):
    spec = get_model_spec(validate_config(make_config()))
    assert type(spec.load_denoiser()).__name__ == "UNet2DConditionModel"
    assert type(spec.load_vae(torch.device("cpu"), torch.float32)).__name__ == "AutoencoderKL"
    assert type(spec.load_text_encoders(torch.device("cpu"), torch.float32)["text_encoder"]).__name__ == "CLIPTextModel"


@pytest.mark.parametrize(
    "library,name,kind",
    [
        ("diffusers", "UNet2DConditionModel", "model"),
        ("diffusers", "AutoencoderKL", "model"),
        ("transformers", "CLIPTextModel", "model"),
        ("transformers", "CLIPTokenizer", "tokenizer"),
        ("diffusers", "DDPMScheduler", "scheduler"),
    ],
)
def test_resolve_component_class_accepts_library_classes(library, name, kind):
    assert resolve_component_class(library, name, kind).__name__ == name


@pytest.mark.parametrize(
    "library,name,kind",
    [
        ("os", "system", "model"),
        ("builtins", "eval", "model"),
        ("subprocess", "Popen", "model"),
        ("transformers", "pipeline", "model"),  # a function
        ("diffusers", "utils", "model"),  # a module
        ("diffusers", "os.system", "model"),
        ("diffusers", "__class__", "model"),
        ("diffusers", "UNet2DConditionModel", "tokenizer"),  # wrong kind
        ("transformers", "PretrainedConfig", "model"),
        (None, None, "model"),
        ("diffusers", ["UNet2DConditionModel"], "model"),
    ],
)
def test_resolve_component_class_refuses_everything_else(library, name, kind, monkeypatch):
    monkeypatch.setattr(os, "system", lambda *a: pytest.fail("os.system was called"))
    with pytest.raises(ValueError, match="refusing to load it"):
        resolve_component_class(library, name, kind)


def _dynamic_class_lookups() -> set[str]:
    """Files calling ``getattr(<diffusers|transformers|module>, <not a constant>)``."""
    found = set()
    for rel, tree in _trees():
        for call in _calls(tree):
            if _dotted(call.func) != "getattr" or len(call.args) < 2 or isinstance(call.args[1], ast.Constant):
                continue
            target = call.args[0]
            if _dotted(target) in ("diffusers", "transformers", "module", "importlib"):
                found.add(rel)
    return found


def test_class_names_from_folders_are_only_looked_up_through_the_allow_list():
    unexpected = _dynamic_class_lookups() - CLASS_LOOKUP_ALLOWED
    assert not unexpected, f"use simpletuner.models.spec.resolve_component_class in {sorted(unexpected)}"
