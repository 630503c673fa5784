"""A full disk: checked before a cache fill and the final save, and an ENOSPC during a write.

Faults are injected where the bytes are written (``SIMPLETUNER_FAULT_ENOSPC=<site>[@N]``) through
``simpletuner.train.main``, and produced for real on a small tmpfs where this machine can mount one
(root, as in CI): the exit code (5), the message ("needs ~X in DIR, Y free", no traceback), the
files left (no temp files, what was there before intact), and that the rerun completes with the
weights of an undisturbed run.
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from training_helpers import same_weights, tiny_config

from simpletuner import diskspace
from simpletuner.caching.memory_store import MemoryTensorStore
from simpletuner.caching.store import ShardedTensorStore
from simpletuner.caching.tensor_cache import TensorCache
from simpletuner.cli.train import main as train_main
from simpletuner.diskspace import NoSpace, disk_full_guard, is_disk_full
from simpletuner.models.spec import FINAL_SAVE_PREFIX
from simpletuner.training import run_folder

LORA = "pytorch_lora_weights.safetensors"


def _config(root: Path, tiny_sd: Path, shapes_dir: Path, **overrides) -> dict:
    return tiny_config(tiny_sd, shapes_dir, root, **{"max_train_steps": 2, **overrides})


def _main(raw: dict, folder: Path, monkeypatch, capsys, fault: str | None = None, *extra: str) -> tuple[int, str]:
    """``simpletuner train`` in this process with ENOSPC injected at ``fault``; ``(exit code, stderr)``."""
    path = folder / f"config-{len(list(folder.glob('config-*.json')))}.json"
    path.write_text(json.dumps(raw))
    monkeypatch.setattr(diskspace, "_reached", {})  # count the fault's writes from this run on
    if fault:
        monkeypatch.setenv(diskspace.FAULT_ENV, fault)
    else:
        monkeypatch.delenv(diskspace.FAULT_ENV, raising=False)
    capsys.readouterr()
    code = train_main(["--config", str(path), *extra])
    return code, capsys.readouterr().err


def _same_weights(a: Path, b: Path) -> bool:
    return same_weights(load_file(a), load_file(b))


def _temp_files(*folders: Path) -> list[Path]:
    """Temp files and folders of unfinished writes (shards, final saves) under ``folders``."""
    return [
        p
        for folder in folders
        if folder.exists()
        for p in folder.rglob("*")
        if p.name.startswith((".tmp-shard-", FINAL_SAVE_PREFIX))
    ]


def _assert_clear_failure(code: int, err: str, what: str) -> None:
    assert code == 5, err
    assert f"error: not enough disk space for {what}" in err, err
    assert "needs ~" in err and " free (" in err, err
    assert "Traceback" not in err, err


@pytest.fixture(scope="module")
def undisturbed(tiny_sd, shapes_dir, tmp_path_factory):
    """A finished 2-step run (its cache, checkpoint-2 and final LoRA), and the same run resumed to step
    3: what the faulted runs below must end up equal to."""
    root = tmp_path_factory.mktemp("undisturbed")
    raw = _config(root, tiny_sd, shapes_dir)
    (root / "two.json").write_text(json.dumps(raw))
    assert train_main(["--config", str(root / "two.json")]) == 0
    shutil.copytree(root / "output", root / "two_steps")  # kept as it was after 2 steps
    (root / "three.json").write_text(json.dumps({**raw, "max_train_steps": 3, "resume_from_checkpoint": "latest"}))
    assert train_main(["--config", str(root / "three.json")]) == 0
    return root


def test_a_full_disk_while_writing_a_cache_shard_keeps_the_written_shards_and_the_rerun_encodes_the_rest(
    undisturbed, tiny_sd, shapes_dir, tmp_path, monkeypatch, capsys
):
    raw = _config(tmp_path, tiny_sd, shapes_dir)
    vae, text = tmp_path / "cache" / "sd" / "vae", tmp_path / "cache" / "sd" / "text"
    # The 1st shard (the 12 latents) is written; the 2nd (the 12 text embeddings) hits a full disk.
    code, err = _main(raw, tmp_path, monkeypatch, capsys, "cache_shard@2")
    _assert_clear_failure(code, err, "a cache shard of 12 entries")
    assert "the disk filled while writing it" in err and str(text) in err
    assert _temp_files(tmp_path) == [], "the failed shard's temp file must be removed"
    written = sorted(vae.glob("shard-*.safetensors"))
    assert len(written) == 1 and list(text.glob("shard-*.safetensors")) == []
    before = written[0].read_bytes()
    assert run_folder.final_weights(tmp_path / "output") == []

    code, err = _main(raw, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    # Only what was missing is encoded: the latents come from the shard the failed run wrote.
    assert "vae cache: 12 items, 12 hits, 0 computed" in err and "text cache: 12 items, 0 hits, 12 computed" in err
    assert written[0].read_bytes() == before
    assert _same_weights(tmp_path / "output" / LORA, undisturbed / "two_steps" / LORA)


def test_a_full_disk_during_the_final_save_keeps_the_earlier_adapter_and_the_rerun_replaces_it(
    undisturbed, tiny_sd, shapes_dir, tmp_path, monkeypatch, capsys
):
    output = tmp_path / "output"
    shutil.copytree(undisturbed / "two_steps", output)
    earlier = (output / LORA).read_bytes()
    # checkpointing_steps: step 3 is checkpointed before the final save fails, so the rerun has
    # nothing left to train, only the weights to save.
    raw = _config(
        tmp_path,
        tiny_sd,
        shapes_dir,
        max_train_steps=3,
        resume_from_checkpoint="latest",
        checkpointing_steps=1,
        cache_config={"cache_dir": str(undisturbed / "cache")},
    )
    code, err = _main(raw, tmp_path, monkeypatch, capsys, "final_save")
    _assert_clear_failure(code, err, "the final adapter")
    assert f"in {output}," in err
    assert _temp_files(output) == [], sorted(p.name for p in output.iterdir())
    assert (output / LORA).read_bytes() == earlier, "the earlier final adapter must be intact"
    assert (output / "checkpoint-3").is_dir()

    code, err = _main(raw, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "is at step 3 but its final weights are of step 2: resuming only to save them" in err
    assert _temp_files(output) == []
    assert _same_weights(output / LORA, undisturbed / "output" / LORA)


def test_a_cache_that_does_not_fit_stops_before_anything_is_encoded(tiny_sd, shapes_dir, tmp_path, monkeypatch, capsys):
    """free_bytes as a nearly full disk reports it; the tmpfs test below does it for real. 270 KB: the
    run's record in the cache folder (~0.4 KB + the 256 KiB reserve floor) fits, the latents do not."""
    raw = _config(tmp_path, tiny_sd, shapes_dir)
    real_free = diskspace.free_bytes
    monkeypatch.setattr(
        diskspace,
        "free_bytes",
        lambda folder: 270_000 if str(folder).startswith(str(tmp_path / "cache")) else real_free(folder),
    )
    code, err = _main(raw, tmp_path, monkeypatch, capsys)
    _assert_clear_failure(code, err, "the VAE latent cache (12 new entries)")
    assert "needs ~15.6 KB in " in err and "270.0 KB free (nothing was written" in err
    assert "262.1 KB is kept free beyond what this write needs" in err
    assert "vae cache:" not in err  # no fill report: nothing was encoded
    assert not list((tmp_path / "cache").rglob("*.safetensors")) and _temp_files(tmp_path) == []


def _mount_tmpfs(folder: Path, size: str) -> None:
    """Mount a tmpfs of ``size`` on ``folder``, or skip saying why (needs root / CAP_SYS_ADMIN)."""
    folder.mkdir(parents=True, exist_ok=True)
    mount = shutil.which("mount")
    if mount is None:
        pytest.skip("no `mount` command to make a small file system")
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a {size} tmpfs here ({done.stderr.strip() or done.returncode}); "
            "the injected-fault tests cover the same paths"
        )


@pytest.fixture
def small_disk(tmp_path, request):
    """A 64 KiB tmpfs (another size with ``indirect`` parametrization; unmounted after the test)."""
    folder = tmp_path / "small"
    _mount_tmpfs(folder, getattr(request, "param", "64k"))
    yield folder
    if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
        gc.collect()  # a writer kept alive by a traceback may still hold a file open there
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], check=True)  # busy: detach now, freed when closed


# 268 KiB: the run's record (a 4 KiB page, checked against ~0.4 KB + the 256 KiB reserve floor) fits; the
# latents (15.6 KB + that floor) do not.
@pytest.mark.parametrize("small_disk", ["268k"], indirect=True)
def test_on_a_real_small_disk_the_cache_fill_stops_with_the_message(
    small_disk, tiny_sd, shapes_dir, tmp_path, monkeypatch, capsys
):
    raw = _config(tmp_path, tiny_sd, shapes_dir, cache_config={"cache_dir": str(small_disk / "cache")})
    code, err = _main(raw, tmp_path, monkeypatch, capsys)
    _assert_clear_failure(code, err, "the VAE latent cache (12 new entries)")
    assert f"in {small_disk / 'cache' / 'sd' / 'vae'}," in err
    assert not list(small_disk.rglob("*.safetensors")) and _temp_files(small_disk) == []


def test_a_real_enospc_during_a_shard_write_removes_its_temp_file_and_keeps_the_earlier_shards(small_disk, monkeypatch):
    """The check before passed and someone else filled the disk since: safetensors' own error."""
    import simpletuner.caching.store as store_module

    monkeypatch.setattr(store_module, "require_space", lambda *args: None)
    store = ShardedTensorStore(small_disk / "vae")
    first = store.put_many({"a": {"latents": torch.ones(100)}})
    with pytest.raises(NoSpace, match=r"a cache shard of 1 entries: needs ~\d+\.\d KB in .*the disk filled") as info:
        store.put_many({"b": {"latents": torch.ones(40_000)}})  # 160 KB on a 64 KiB disk
    assert info.value.during_write and info.value.__cause__ is None
    assert sorted(p.name for p in (small_disk / "vae").iterdir()) == [first.name]
    reopened = ShardedTensorStore(small_disk / "vae")
    assert reopened.keys() == ["a"] and torch.equal(reopened.get("a")["latents"], torch.ones(100))
    store.close(), reopened.close()  # their mmaps would keep the file system busy


@pytest.mark.parametrize("writer", ["safetensors", "torch.save to a path", "torch.save to a file object"])
def test_the_writers_real_full_disk_errors_are_recognised(small_disk, writer):
    """The exact errors each writer raises when a 64 KiB tmpfs fills (safetensors: SafetensorError
    "... No space left on device (os error 28)"; torch.save to a path: RuntimeError "[enforce fail
    at inline_container.cc] ... unexpected pos", the errno lost; to a file object: an OSError
    chain), and what disk_full_guard makes of them: NoSpace, the temp file removed."""
    target = small_disk / "weights.tmp"
    big = {"w": torch.ones(40_000)}

    def write():
        if writer == "safetensors":
            save_file(big, str(target))
        elif writer == "torch.save to a path":
            torch.save(big, str(target))
        else:
            with open(target, "wb") as handle:
                torch.save(big, handle)

    with pytest.raises(Exception) as raw_error:
        write()
    assert is_disk_full(raw_error.value) == (writer != "torch.save to a path"), repr(raw_error.value)
    target.unlink(missing_ok=True)
    with pytest.raises(NoSpace, match="the disk filled while writing it"):
        with disk_full_guard(small_disk, 160_000, "the test weights", cleanup=[target]):
            write()
    assert not target.exists()


def test_recorded_writer_errors_are_recognised_without_a_small_disk(tmp_path, monkeypatch):
    """The same texts as above, for machines that cannot mount a tmpfs."""
    from safetensors import SafetensorError

    assert is_disk_full(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert is_disk_full(OSError(122, "Disk quota exceeded"))
    short_write = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert not is_disk_full(short_write)
    monkeypatch.setattr(diskspace, "free_bytes", lambda folder: 0)  # the disk is full when the write fails
    with pytest.raises(NoSpace):
        with disk_full_guard(tmp_path, 1000, "x"):
            raise short_write
    monkeypatch.setattr(diskspace, "free_bytes", lambda folder: 10**12)  # room left: another fault, kept as is
    with pytest.raises(RuntimeError, match="unexpected pos"):
        with disk_full_guard(tmp_path, 1000, "x"):
            raise short_write


def test_a_memory_cache_is_not_checked_but_its_backing_folder_is(tmp_path, monkeypatch):
    monkeypatch.setattr(diskspace, "free_bytes", lambda folder: 0)
    items = [(f"k{i}", i) for i in range(3)]

    def compute(payloads):
        return [{"x": torch.full((4,), float(p))} for p in payloads]

    report = TensorCache(MemoryTensorStore("vae"), "vae").fill(items, compute, batch_size=2)
    assert report.num_computed == 3
    backed = TensorCache(MemoryTensorStore("vae", backing=ShardedTensorStore(tmp_path / "vae")), "vae")
    with pytest.raises(NoSpace, match=r"the VAE latent cache \(3 new entries\)"):
        backed.fill(items, compute, batch_size=2, entry_bytes=lambda payload: 16)
    # Without an estimate, the first batch is measured before anything is written.
    with pytest.raises(NoSpace, match=r"the VAE latent cache \(3 new entries\)"):
        backed.fill(items, compute, batch_size=2)
    assert not list((tmp_path / "vae").iterdir())


def test_the_final_model_folder_is_replaced_whole(tiny_sd, make_config, tmp_path, monkeypatch):
    """A full fine-tune's final save writes ``unet/`` into a temp folder, then swaps it in: a full disk
    leaves the earlier folder as it was, and the next save replaces it (no set-aside folder left)."""
    from simpletuner.configuration import validate_config
    from simpletuner.models import get_model_spec

    spec = get_model_spec(validate_config(make_config(training_type="full")))
    unet = spec.load_denoiser()
    output = tmp_path / "output"
    output.mkdir()
    first = spec.save_final(output, unet, full=True)
    assert first == output / "unet" and (first / "config.json").is_file()
    earlier = {p.name: p.read_bytes() for p in first.iterdir()}
    with torch.no_grad():
        next(unet.parameters()).add_(1.0)
    monkeypatch.setattr(diskspace, "_reached", {})
    monkeypatch.setenv(diskspace.FAULT_ENV, "final_save")
    with pytest.raises(NoSpace, match="the final model: needs ~"):
        spec.save_final(output, unet, full=True)
    assert {p.name: p.read_bytes() for p in first.iterdir()} == earlier
    assert sorted(p.name for p in output.iterdir()) == ["unet"]
    monkeypatch.delenv(diskspace.FAULT_ENV)
    spec.save_final(output, unet, full=True)
    assert sorted(p.name for p in output.iterdir()) == ["unet"]
    assert {p.name: p.read_bytes() for p in first.iterdir()} != earlier


def test_a_killed_final_save_leaves_no_finished_weights_and_overwrite_removes_it(tmp_path):
    output = tmp_path / "output"
    temp = output / f"{FINAL_SAVE_PREFIX}tmp-123-abcd"
    (temp / "unet").mkdir(parents=True)
    (temp / LORA).write_bytes(b"half")
    aside = output / f"{FINAL_SAVE_PREFIX}old-123-abcd"  # a model folder set aside while being replaced
    aside.mkdir()
    (aside / "config.json").write_text("{}")
    (aside / "diffusion_pytorch_model.safetensors").write_bytes(b"old")
    assert run_folder.final_weights(output) == []
    assert sorted(run_folder.clear_previous_run(output)) == [aside, temp]
    assert list(output.iterdir()) == []
