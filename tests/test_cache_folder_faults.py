"""Cache folders under faults (issue 29): a full disk at the cache-user record (N4), a complete cache
on a read-only file system (N3), the free-space reserve on small disks, and a cache fill resumed
after an interruption giving the latents of an uninterrupted one (N6).

Real file systems where this machine lets a test make them: a small tmpfs and a read-only bind
mount, in a child process with mounts of its own (``unshare``: a user namespace when not root), or,
in this process, a read-only bind mount (root) or ``chmod 0555`` (not root: modes bind). Where none
of these is possible the same checks run with the failure made at the OS boundary (ENOSPC injected
at the write, ``os.access`` answering "not writable"), never skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_helpers import same_weights, tiny_config

from simpletuner import diskspace
from simpletuner.caching import read_only as read_only_module
from simpletuner.caching.read_only import ReadOnlyCaches, is_writable
from simpletuner.caching.store import ShardedTensorStore
from simpletuner.cli.train import main as train_main

ROOT = Path(__file__).resolve().parents[1]
LORA = "pytorch_lora_weights.safetensors"


def _main(raw: dict, folder: Path, monkeypatch, capsys, fault: str | None = None) -> tuple[int, str]:
    """``simpletuner train`` in this process (ENOSPC injected at ``fault``); ``(exit code, stderr)``."""
    path = folder / f"config-{len(list(folder.glob('config-*.json')))}.json"
    path.write_text(json.dumps(raw))
    monkeypatch.setattr(diskspace, "_reached", {})
    if fault:
        monkeypatch.setenv(diskspace.FAULT_ENV, fault)
    else:
        monkeypatch.delenv(diskspace.FAULT_ENV, raising=False)
    capsys.readouterr()
    code = train_main(["--config", str(path)])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def filled(tiny_sd, shapes_dir, tmp_path_factory):
    """A 1-step run that filled its cache from empty, uninterrupted: ``(root, raw config)``."""
    root = tmp_path_factory.mktemp("filled")
    raw = tiny_config(tiny_sd, shapes_dir, root, max_train_steps=1)
    (root / "fill.json").write_text(json.dumps(raw))
    assert train_main(["--config", str(root / "fill.json")]) == 0
    return root, raw


def _private_mounts() -> list[str] | None:
    """The command prefix that runs a child with mounts of its own (``unshare -rm``: root of a new user
    namespace; ``unshare -m`` as root), or None where this machine allows neither."""
    unshare = shutil.which("unshare")
    for prefix in ([unshare, "-rm"], [unshare, "-m"]) if unshare else []:
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return None


# --- N4: a full disk at the cache-user record --------------------------------------------------------------------
_RECORD_CHILD = r"""
import json, sys
from pathlib import Path
from simpletuner import diskspace, locks
base, mode = Path(sys.argv[1]), sys.argv[2]
if mode == "write":  # the space check passes (as if the disk filled after it): the write meets the full disk
    locks.require_space = lambda *args: None
if sys.argv[3] == "faked":  # no small file system here: the OS boundary answers as a full one would
    diskspace.free_bytes = lambda folder: 0
    if mode == "write":
        import os
        os.environ[diskspace.FAULT_ENV] = "cache_user_record"
out = {}
try:
    with locks.CacheLocks(base).use():
        out["held"] = True
except diskspace.NoSpace as exc:
    out.update(error=str(exc), during_write=exc.during_write, code=exc.exit_code)
out["left"] = sorted(str(p.relative_to(base)) for p in base.rglob("*"))
print(json.dumps(out))
"""

# Mount a 64 KiB tmpfs on $1, fill it to the last byte, then run the child on a cache folder there.
_FULL_DISK = 'mount -t tmpfs -o size=64k tmpfs "$1" && mkdir -p "$1/cache/sd" && { head -c 1048576 /dev/zero > "$1/filler" 2>/dev/null; true; } && exec "$2" -c "$3" "$1/cache/sd" "$4" real'  # noqa: E501


def _record_on_a_full_disk(tmp_path: Path, mode: str) -> dict:
    disk = tmp_path / "disk"
    disk.mkdir()
    prefix = _private_mounts()
    if prefix is not None:
        cmd = [*prefix, "sh", "-c", _FULL_DISK, "sh", str(disk), sys.executable, _RECORD_CHILD, mode]
    else:
        (disk / "cache" / "sd").mkdir(parents=True)
        cmd = [sys.executable, "-c", _RECORD_CHILD, str(disk / "cache" / "sd"), mode, "faked"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("mode", ["checked", "write"])
def test_a_full_disk_at_the_cache_user_record_is_no_space_and_leaves_no_temp_file(tmp_path, mode):
    """``checked``: the space check before the record stops it; ``write``: the check passes and the write
    itself meets ENOSPC (another writer filled the disk in between)."""
    out = _record_on_a_full_disk(tmp_path, mode)
    assert out.get("code") == 5, out
    assert "not enough disk space for the record naming this run in the cache folder (.users/)" in out["error"]
    assert out["during_write"] == (mode == "write")
    assert not [name for name in out["left"] if name.endswith(".tmp")], out["left"]
    assert ".users" not in out["left"] or mode == "write"  # checked first: nothing was created for it


def test_a_full_cache_disk_at_start_ends_with_exit_5_and_the_rerun_trains(
    tiny_sd, shapes_dir, tmp_path, monkeypatch, capsys
):
    raw = tiny_config(tiny_sd, shapes_dir, tmp_path, max_train_steps=1)
    code, err = _main(raw, tmp_path, monkeypatch, capsys, fault="cache_user_record")
    assert code == 5, err
    assert "error: not enough disk space for the record naming this run in the cache folder" in err
    assert "Traceback" not in err and "internal error" not in err
    assert not list((tmp_path / "cache").rglob("*.tmp"))
    code, err = _main(raw, tmp_path, monkeypatch, capsys)
    assert code == 0, err


# --- the reserve, scaled with the write ---------------------------------------------------------------------------
_RESERVE_CHILD = r"""
import json, sys
from simpletuner import diskspace
folder = sys.argv[1]
if len(sys.argv) > 2:  # no tmpfs here: the free space as a 4 MiB one reports it
    diskspace.free_bytes = lambda folder: 4 * 2**20
out = {"free": diskspace.free_bytes(folder)}
for name, needed in (("small", 31_200), ("large", 3_800_000)):
    try:
        diskspace.require_space(folder, needed, f"the {name} write")
        out[name] = "ok"
    except diskspace.NoSpace as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""


def test_the_reserve_lets_a_small_write_onto_a_small_disk_and_still_stops_a_large_one(tmp_path):
    """A real 4 MiB tmpfs where one can be mounted (the free space as it reports it otherwise): 31.2 KB
    fits (before: refused for a fixed 16.8 MB reserve); 3.8 MB would fit the 4.2 MB free but not with
    its reserve (an eighth of it), so it stops, saying so."""
    prefix = _private_mounts()
    if prefix is not None:
        script = 'mount -t tmpfs -o size=4m tmpfs "$1" && exec "$2" -c "$3" "$1"'
        cmd = [*prefix, "sh", "-c", script, "sh", str(tmp_path), sys.executable, _RESERVE_CHILD]
    else:
        cmd = [sys.executable, "-c", _RESERVE_CHILD, str(tmp_path), "faked"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["free"] == 4 * 2**20
    assert out["small"] == "ok"
    assert out["large"].startswith("not enough disk space for the large write: needs ~3.8 MB in "), out
    assert "4.2 MB free (nothing was written; 475.0 KB is kept free beyond what this write needs" in out["large"]
    assert diskspace.reserve_bytes(100) == diskspace.RESERVE_FLOOR_BYTES
    assert diskspace.reserve_bytes(10**12) == diskspace.MARGIN_BYTES  # never more than the fixed 16 MiB of before


def test_a_small_cache_on_a_disk_of_a_few_megabytes_fills(tiny_sd, shapes_dir, tmp_path, monkeypatch, capsys):
    """The audit's 4 MB scratch disk (4.2 MB free) held the 12 latents (15.6 KB): refused before."""
    raw = tiny_config(tiny_sd, shapes_dir, tmp_path, max_train_steps=1)
    real_free = diskspace.free_bytes
    cache = str(tmp_path / "cache")
    monkeypatch.setattr(
        diskspace, "free_bytes", lambda folder: 4_200_000 if str(folder).startswith(cache) else real_free(folder)
    )
    code, err = _main(raw, tmp_path, monkeypatch, capsys)
    assert code == 0, err
    assert "the VAE latent cache (12 new entries) needs ~15.6 KB in " in err  # checked against 4.2 MB free
    assert "vae cache: 12 items, 0 hits, 12 computed" in err


# --- N3: a complete cache on a read-only file system ---------------------------------------------------------------
@contextmanager
def _read_only(folder: Path, monkeypatch):
    """``folder`` made read-only for this process: ``chmod 0555`` when not root (modes bind), a
    read-only bind mount as root; where neither is possible, ``os.access`` answers "not writable"
    for it (the folder itself stays writable: the test then checks that nothing was written)."""
    dirs = [folder, *(p for p in folder.rglob("*") if p.is_dir())]
    if os.geteuid() != 0:
        for path in dirs:
            path.chmod(0o555)
        try:
            yield "chmod 0555"
        finally:
            for path in dirs:
                path.chmod(0o755)
        return
    bind = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True)
    if bind.returncode == 0:
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True, capture_output=True)
            yield "read-only bind mount"
        finally:
            import gc

            gc.collect()  # open shard handles (mmaps) of the run keep the mount busy
            if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(folder)], check=True)
        return
    real_access = os.access
    inside = str(folder.resolve())
    monkeypatch.setattr(
        read_only_module.os,
        "access",
        lambda path, mode: False if str(Path(path).resolve()).startswith(inside) else real_access(path, mode),
    )
    yield "os.access"


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_a_complete_read_only_cache_is_read_without_a_lock(filled, tmp_path, monkeypatch, capsys):
    root, raw = filled
    cache = tmp_path / "cache"
    shutil.copytree(root / "cache", cache)
    before = _tree(cache)
    raw = {**raw, "output_dir": str(tmp_path / "output"), "cache_config": {"cache_dir": str(cache)}}
    with _read_only(cache, monkeypatch) as how:
        assert not is_writable(cache / "sd"), how
        code, err = _main(raw, tmp_path, monkeypatch, capsys)
    assert code == 0, f"{how}: {err}"
    assert (
        f"the cache folder {cache / 'sd'} is read-only and holds every entry this run needs: read without a lock" in err
    )
    assert "vae cache: 12 items, 12 hits, 0 computed" in err and "text cache: 12 items, 12 hits, 0 computed" in err
    assert _tree(cache) == before, f"{how}: the run wrote into the read-only cache"
    # the same training as the run that filled it
    assert same_weights(load_file(tmp_path / "output" / LORA), load_file(root / "output" / LORA))


def test_an_incomplete_read_only_cache_stops_naming_the_folder_and_the_count(filled, tmp_path, monkeypatch, capsys):
    root, raw = filled
    cache = tmp_path / "cache"
    shutil.copytree(root / "cache", cache)
    before = _tree(cache)
    # another seed: other latent keys (the seed draws the crops), the captions' embeddings are the same
    raw = {**raw, "seed": 7, "output_dir": str(tmp_path / "output"), "cache_config": {"cache_dir": str(cache)}}
    with _read_only(cache, monkeypatch) as how:
        code, err = _main(raw, tmp_path, monkeypatch, capsys)
    assert code == 2, f"{how}: {err}"
    assert (
        f"error: the cache folder {cache / 'sd'} is read-only and lacks 12 of the 12 VAE latents this run needs" in err
    )
    assert "point cache_config.cache_dir at a writable folder" in err and "Traceback" not in err
    assert _tree(cache) == before


def test_a_missing_image_that_does_not_decode_is_not_needed_from_a_read_only_cache(tmp_path):
    caches = ReadOnlyCaches([])
    items = [("a", "ok"), ("b", "broken"), ("c", "ok")]
    present = {"a", "c"}
    kept = caches.present_items(tmp_path, present.__contains__, items, "VAE latents", lambda p: p != "broken")
    assert kept == [("a", "ok"), ("c", "ok")]  # the fill drops b, as it drops any file that does not decode
    with pytest.raises(ValueError, match=r"lacks 1 of the 3 text embeddings"):
        caches.present_items(tmp_path, present.__contains__, items, "text embeddings")


# --- N6: a fill resumed after an interruption ------------------------------------------------------------------
def test_a_fill_resumed_after_a_rank_died_holds_the_latents_of_an_uninterrupted_fill(tiny_sd, tmp_path):
    """The audit's case with the tiny VAE (32 px images, 2 per encode call, shards of 2 entries), two
    processes run one after the other in this process: rank 1 dies after its first batch is written;
    the resume, with two processes again, stores latents bit-identical to an uninterrupted fill's, and
    those equal a single process's. Before, the missing entries were re-split by count and one of them
    was encoded alone instead of beside its batch-mate (CPU convolutions round differently: ~1e-6)."""
    from diffusers import AutoencoderKL
    from fakes import SequentialShare

    from simpletuner.caching import TensorCache

    vae = AutoencoderKL.from_pretrained(tiny_sd / "vae").eval()
    gen = torch.Generator().manual_seed(0)
    items = [(f"img{i:02d}", torch.rand(3, 32, 32, generator=gen) * 2 - 1) for i in range(10)]
    calls: list[int] = []

    def encode(pixels, die_at: int | None = None):
        calls.append(len(pixels))
        if die_at is not None and len(calls) == die_at:
            raise RuntimeError("rank 1 was killed")
        with torch.no_grad():
            return [{"latents": latent} for latent in vae.encode(torch.stack(pixels)).latent_dist.mode()]

    def fill(folder: Path, ranks: tuple[int, ...], die_at: int | None = None) -> None:
        launch = SequentialShare()
        for rank in ranks:
            cache = TensorCache(ShardedTensorStore(folder), "vae", flush_every=2)
            share = None if ranks == (0,) else launch.rank(rank)
            calls.clear()
            dies = die_at if rank == 1 else None
            cache.fill(items, lambda batch, dies=dies: encode(batch, dies), 2, share=share)
            cache.store.close()

    def latents(folder: Path) -> dict[str, torch.Tensor]:
        store = ShardedTensorStore(folder)
        out = {key: store.get(key)["latents"].clone() for key, _ in items}
        store.close()
        return out

    fill(tmp_path / "uninterrupted", (0, 1))
    with pytest.raises(RuntimeError, match="rank 1 was killed"):
        fill(tmp_path / "resumed", (0, 1), die_at=2)  # rank 1's first batch is in a shard, then it dies
    assert 0 < len(ShardedTensorStore(tmp_path / "resumed")) < len(items)
    fill(tmp_path / "resumed", (0, 1))
    fill(tmp_path / "single", (0,))
    reference = latents(tmp_path / "uninterrupted")
    for other in ("resumed", "single"):
        found = latents(tmp_path / other)
        off = {key: float((found[key] - reference[key]).abs().max()) for key in reference}
        assert all(torch.equal(found[key], reference[key]) for key in reference), (other, off)
