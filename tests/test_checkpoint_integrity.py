"""Checkpoints verify themselves: every file of the newest checkpoint truncated, deleted or with a
flipped byte is found before anything loads, and "latest" continues from the previous checkpoint to
the same weights as an undisturbed run; nothing left to resume from stops with exit 2 naming the
file; ``latest`` never leads out of output_dir; another seed's checkpoint is refused by run id and
seed; a full disk during a save (exit 5) leaves the previous checkpoint and ``latest`` as they were.

One 4-step run (checkpoints at steps 2 and 4) is trained once for the module; each case works on a
copy of its checkpoints.
"""

from __future__ import annotations

import logging
import os
import shutil
import zipfile
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
import torch
from safetensors.torch import load_file
from training_helpers import train

from simpletuner import diskspace
from simpletuner.cli.train import main as train_main
from simpletuner.training import checkpoint as ckpt
from simpletuner.training import run_folder

STEPS = 4


@pytest.fixture(scope="module")
def base(tiny_sd, shapes_dir, tmp_path_factory):
    """``raw(**overrides)`` for this module's runs (one shared cache), and the undisturbed run."""
    root = tmp_path_factory.mktemp("ckpt_integrity")

    def raw(**overrides):
        config = {
            "pretrained_model_name_or_path": str(tiny_sd),
            "model_family": "sd",
            "resolution": 64,
            "aspect_bucket_alignment": 16,
            "train_batch_size": 2,
            "max_train_steps": STEPS,
            "learning_rate": 1e-3,
            "logging_steps": 1,
            "seed": 123,
            "checkpointing_steps": 2,
            "output_dir": str(root / "straight"),
            "cache_config": {"cache_dir": str(root / "cache")},
            "datasets": [{"id": "shapes", "type": "local", "instance_data_dir": str(shapes_dir)}],
        }
        config.update(overrides)
        return config

    _, result = train(raw())
    return SimpleNamespace(raw=raw, out=root / "straight", weights=load_file(result.output_path))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _copy_checkpoints(base, dest: Path) -> Path:
    """The undisturbed run's checkpoints and ``latest`` (no final weights) in a fresh output_dir."""
    dest.mkdir()
    for name in ("checkpoint-2", "checkpoint-4"):
        shutil.copytree(base.out / name, dest / name)
    shutil.copy2(base.out / "latest", dest / "latest")
    return dest


def _data_offset(file: Path) -> int:
    """An offset inside the tensor bytes of a checkpoint file (the JSON's middle for trainer_state)."""
    if file.suffix == ".safetensors":
        header = int.from_bytes(file.read_bytes()[:8], "little")
        return 8 + header + 3
    if file.suffix == ".pt":
        with zipfile.ZipFile(file) as archive:
            members = archive.infolist()
        # A tensor's storage; the pickle for files without tensors (the schedule's state).
        storages = [i for i in members if "/data/" in i.filename]
        member = (storages or [i for i in members if i.filename.endswith(".pkl")])[-1]
        local = file.read_bytes()[member.header_offset :]
        name_len, extra_len = int.from_bytes(local[26:28], "little"), int.from_bytes(local[28:30], "little")
        return member.header_offset + 30 + name_len + extra_len + member.file_size // 2
    return file.stat().st_size // 2


def _damage(file: Path, how: str) -> None:
    if how == "deleted":
        file.unlink()
    elif how == "truncated":
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2])
    else:
        data = bytearray(file.read_bytes())
        data[_data_offset(file)] ^= 0x10
        file.write_bytes(bytes(data))


FILES = [
    "trainable.safetensors",
    "pytorch_lora_weights.safetensors",
    "optimizer.pt",
    "lr_scheduler.pt",
    "rng_state_0.pt",
    "trainer_state.json",
    "COMPLETE",
]
CASES = [(f, how) for f in FILES for how in ("truncated", "deleted", "flipped")]
#: The cases resumed all the way to the end (about 1 s each): every file once, every kind of damage,
#: every tensor file flipped (the damage that used to resume silently with wrong state).
RESUMED = [
    ("trainable.safetensors", "flipped"),
    ("pytorch_lora_weights.safetensors", "flipped"),
    ("optimizer.pt", "flipped"),
    ("rng_state_0.pt", "flipped"),
    ("optimizer.pt", "truncated"),
    ("lr_scheduler.pt", "deleted"),
    ("trainer_state.json", "truncated"),
    ("COMPLETE", "deleted"),
]


def _ids(cases):
    return [f"{f}-{h}" for f, h in cases]


def test_the_checkpoint_lists_every_file_with_size_and_sha256(base):
    folder = base.out / "checkpoint-4"
    manifest = orjson.loads((folder / "COMPLETE").read_bytes())
    assert manifest["step"] == 4 and sorted(manifest["files"]) == sorted(f for f in FILES if f != "COMPLETE")
    for name, entry in manifest["files"].items():
        assert entry["size"] == (folder / name).stat().st_size and len(entry["sha256"]) == 64
    assert ckpt.verify_checkpoint(folder) is None
    state = orjson.loads((folder / "trainer_state.json").read_bytes())
    assert state["identity"]["seed"] == 123 and len(state["run_id"]) == 8
    assert orjson.loads((base.out / "checkpoint-2" / "trainer_state.json").read_bytes())["run_id"] == state["run_id"]


@pytest.mark.parametrize("name, how", CASES, ids=_ids(CASES))
def test_every_damage_is_found_before_anything_loads(base, tmp_path, caplog, name, how):
    out = _copy_checkpoints(base, tmp_path / "out")
    _damage(out / "checkpoint-4" / name, how)
    damage = ckpt.verify_checkpoint(out / "checkpoint-4")
    assert damage is not None and damage.file == name, damage
    with caplog.at_level(logging.WARNING, logger="simpletuner"):
        assert ckpt.resolve_resume(out, "latest") == out / "checkpoint-2"
        with pytest.raises(run_folder.RunFolderTaken, match=r"\(checkpoint-2: run [0-9a-f]{8}, seed 123\)"):
            run_folder.check_output_dir(out, None, {})  # the output_dir check reads the same checkpoint
    assert f"checkpoint checkpoint-4 cannot be resumed from: {damage}. Using checkpoint-2" in caplog.text
    assert str(out / "checkpoint-4" / name) in caplog.text
    with pytest.raises(ckpt.CheckpointDamaged, match="Nothing was loaded") as info:  # named explicitly: refused
        ckpt.resolve_resume(out, str(out / "checkpoint-4"))
    assert str(out / "checkpoint-4" / name) in str(info.value) and "weights_only" not in str(info.value)


@pytest.mark.parametrize("name, how", RESUMED, ids=_ids(RESUMED))
def test_a_damaged_latest_resumes_from_the_previous_checkpoint_to_the_same_weights(base, tmp_path, caplog, name, how):
    out = _copy_checkpoints(base, tmp_path / "out")
    run_id = orjson.loads((out / "checkpoint-2" / "trainer_state.json").read_bytes())["run_id"]
    _damage(out / "checkpoint-4" / name, how)
    with caplog.at_level(logging.WARNING, logger="simpletuner"):
        trainer, result = train(base.raw(output_dir=str(out), resume_from_checkpoint="latest"))
    assert f"checkpoint checkpoint-4 cannot be resumed from: {out / 'checkpoint-4' / name}" in caplog.text
    assert result.global_step == STEPS and len(result.losses) == STEPS - 2  # continued from step 2
    assert _same(load_file(result.output_path), base.weights)  # bit-identical to the undisturbed run
    # The re-saved step 4 is whole again, and the run kept its id.
    assert ckpt.find_latest(out).name == "checkpoint-4" and ckpt.verify_checkpoint(out / "checkpoint-4") is None
    assert trainer.run_id == run_id
    assert orjson.loads((out / "checkpoint-4" / "trainer_state.json").read_bytes())["run_id"] == run_id
    assert not list(out.glob(".checkpoint-*"))


def _write_config(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "cfg.json"
    path.write_bytes(orjson.dumps(raw))
    return path


def test_nothing_left_to_resume_from_stops_with_the_file_and_the_fix(base, tmp_path, capsys):
    out = _copy_checkpoints(base, tmp_path / "out")
    _damage(out / "checkpoint-4" / "optimizer.pt", "flipped")
    _damage(out / "checkpoint-2" / "trainable.safetensors", "truncated")
    assert (
        train_main(
            ["--config", str(_write_config(tmp_path, base.raw(output_dir=str(out), resume_from_checkpoint="latest")))]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert f"no checkpoint in {out} verifies" in err and "Traceback" not in err
    assert str(out / "checkpoint-4" / "optimizer.pt") in err and "sha256" in err
    assert str(out / "checkpoint-2" / "trainable.safetensors") in err and "truncated" in err
    assert "--overwrite" in err and "weights_only" not in err
    # An explicit damaged checkpoint is refused too (it is what the user asked for), naming the file.
    raw = base.raw(output_dir=str(out), resume_from_checkpoint=str(out / "checkpoint-4"))
    assert train_main(["--config", str(_write_config(tmp_path, raw))]) == 2
    err = capsys.readouterr().err
    assert f"cannot resume from {out / 'checkpoint-4'}: {out / 'checkpoint-4' / 'optimizer.pt'}" in err
    assert '"latest"' in err and "Traceback" not in err
    assert not (out / "pytorch_lora_weights.safetensors").exists()  # nothing trained, nothing written


def test_an_unreadable_file_names_itself_and_never_suggests_unpickling(base, tmp_path):
    folder = shutil.copytree(base.out / "checkpoint-4", tmp_path / "checkpoint-4")
    (folder / "optimizer.pt").write_bytes(b"not a zip archive at all")  # past the manifest: read anyway
    with pytest.raises(ckpt.CheckpointDamaged) as info:
        ckpt.load_tensors(folder, 0)
    assert str(folder / "optimizer.pt") in str(info.value) and "weights_only" not in str(info.value)


@pytest.mark.parametrize("pointer", ["../elsewhere", "ABSOLUTE", "checkpoint-9"])
def test_latest_never_leads_outside_output_dir(base, tmp_path, caplog, pointer):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(base.out / "checkpoint-2", out / "checkpoint-2")
    elsewhere = shutil.copytree(base.out / "checkpoint-4", tmp_path / "elsewhere")  # verifies, but not ours
    if pointer == "ABSOLUTE":
        pointer = str(elsewhere)
    if pointer == "checkpoint-9":  # a link named like a checkpoint, leading out
        (out / "checkpoint-9").symlink_to(elsewhere, target_is_directory=True)
    (out / "latest").write_text(pointer)
    with caplog.at_level(logging.WARNING, logger="simpletuner"):
        assert ckpt.resolve_resume(out, "latest") == out / "checkpoint-2"
        with pytest.raises(run_folder.RunFolderTaken, match=r"\(checkpoint-2: run "):
            run_folder.check_output_dir(out, None, {})  # the output_dir check reads checkpoint-2 too
    assert "ignored" in caplog.text or "outside" in caplog.text


def test_another_seed_is_refused_naming_the_run_id_and_seed(base, tmp_path, capsys):
    out = _copy_checkpoints(base, tmp_path / "out")
    run_id = orjson.loads((out / "checkpoint-4" / "trainer_state.json").read_bytes())["run_id"]
    raw = base.raw(output_dir=str(out), seed=7, max_train_steps=6, resume_from_checkpoint="latest")
    assert train_main(["--config", str(_write_config(tmp_path, raw))]) == 2
    err = capsys.readouterr().err
    assert f"(run {run_id}, seed 123)" in err and "seed: checkpoint has 123, config has 7" in err
    assert "Traceback" not in err
    # Without resume_from_checkpoint the output_dir check says whose run is there.
    raw = base.raw(output_dir=str(out), seed=7)
    assert train_main(["--config", str(_write_config(tmp_path, raw))]) == 2
    err = capsys.readouterr().err
    assert f"run {run_id}, seed 123" in err and "seed: checkpoint has 123, config has 7" in err


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(base, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    raw = base.raw(output_dir=str(out))
    monkeypatch.setattr(diskspace, "_reached", {})
    monkeypatch.setenv(diskspace.FAULT_ENV, "checkpoint@2")  # the save of step 4, after its first file
    assert train_main(["--config", str(_write_config(tmp_path, raw))]) == 5
    err = capsys.readouterr().err
    assert "needs ~" in err and "free" in err and "checkpoint-4" in err and "Traceback" not in err
    assert not list(out.glob(".checkpoint-*")), list(out.iterdir())
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert (out / "latest").read_text() == "checkpoint-2"
    assert ckpt.verify_checkpoint(out / "checkpoint-2") is None
    monkeypatch.delenv(diskspace.FAULT_ENV)
    _, result = train(dict(raw, resume_from_checkpoint="latest"))
    assert result.global_step == STEPS and _same(load_file(result.output_path), base.weights)


def _fake_accelerator():
    return SimpleNamespace(is_main_process=True, process_index=0, num_processes=1)


def _tiny_save(out: Path, step: int, token: str = "abc123"):
    param = torch.nn.Parameter(torch.zeros(1000))
    opt = torch.optim.AdamW([param])
    param.grad = torch.ones_like(param)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    contents = ckpt.CheckpointContents({"p": param}, opt, sched, {"identity": {}}, torch.Generator())
    return ckpt.Checkpointer(_fake_accelerator(), out, None, token).write(step, contents)


def test_too_little_space_stops_before_writing(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _tiny_save(out, 1)
    # below the reserve's floor (256 KiB): a small save is refused only on a disk about that full
    monkeypatch.setattr(diskspace, "free_bytes", lambda folder: 200_000)
    with pytest.raises(diskspace.NoSpace) as info:
        _tiny_save(out, 2)
    text = str(info.value)
    assert "checkpoint-2: needs ~" in text and f"in {out}, 200.0 KB free" in text and "nothing was written" in text
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-1", "latest"]
    assert (out / "latest").read_text() == "checkpoint-1"


def test_the_temp_folder_is_the_launchs_own_and_stale_ones_are_removed(tmp_path):
    out = tmp_path / "out"
    complete = _tiny_save(out, 3)
    assert ckpt.verify_checkpoint(complete) is None
    (out / ".checkpoint-4.tmp").mkdir()  # an older version's save, killed
    (out / ".checkpoint-5.tmp-0f1e2d").mkdir()  # a dead launch's save
    os.replace(complete, out / ".checkpoint-3.old-0f1e2d")  # killed between the two renames of a re-save
    (out / ".latest.tmp-4242").write_text("checkpoint-5")
    removed = ckpt.remove_stale_temp_folders(out)
    assert sorted(p.name for p in removed) == [".checkpoint-4.tmp", ".checkpoint-5.tmp-0f1e2d", ".latest.tmp-4242"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "latest"]  # the complete copy put back
    assert ckpt.verify_checkpoint(out / "checkpoint-3") is None
    # --overwrite removes temp folders of any launch too.
    (out / ".checkpoint-6.tmp-99aa").mkdir()
    run_folder.clear_previous_run(out)
    assert list(out.iterdir()) == []


def test_every_rank_raises_the_same_no_space_when_rank_zero_cannot_save(tmp_path, monkeypatch):
    """Rank 1's view of a save rank 0 refused for space: it writes nothing and raises the same
    NoSpace at once, instead of waiting in a collective rank 0 never reaches."""
    out = tmp_path / "out"
    rank0 = ("no_space", "checkpoint-2", str(out), 3_000_000, 1_000, False)
    monkeypatch.setattr(ckpt, "from_main_process", lambda acc, value: rank0)  # what rank 0 broadcasts
    monkeypatch.setattr(
        ckpt, "from_every_process", lambda acc, value: pytest.fail("rank 1 went on to the next collective")
    )
    rank1 = SimpleNamespace(is_main_process=False, process_index=1, num_processes=2)
    param = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([param], lr=0.1)
    with pytest.raises(diskspace.NoSpace, match=r"checkpoint-2: needs ~3.0 MB in .*, 1.0 KB free") as raised:
        ckpt.Checkpointer(rank1, out, None, "abc").write(
            2,
            ckpt.CheckpointContents(
                {"p": param},
                opt,
                torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                {"identity": {}},
                torch.Generator(),
            ),
        )
    assert raised.value.agreed  # rank 0's failure: `simpletuner train` prints it on rank 0 only
    assert not out.exists() or not any(out.iterdir())
