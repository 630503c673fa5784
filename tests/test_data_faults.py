"""Faults of the data sources that used to end as internal errors or go unchecked (the second reliability
attack, N1 and N2), and `cache verify --content` over shards.

- An object store that cannot be listed when the run starts (nothing listens on the port; every request
  answered 503) stops with exit 2, naming the URL, the endpoint and the retries: no traceback.
- A webdataset or Parquet shard deleted after the scan: its samples are unreadable files under
  ``max_bad_image_fraction``, as a broken image is (the run goes on without them, naming the shard and the
  dataset, or stops cleanly above the limit).
- ``cache verify --content`` reads the sources of webdataset and Parquet datasets in place, so an image
  edited inside its shard (same size, mtime put back) is reported and the others are not.

Real shards (tarfile, pyarrow), a real s3fs client, the tiny SD model; nothing is mocked but the moment a
file disappears.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import socket
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image
from training_helpers import train

import simpletuner.data_backend.factory as factory
from simpletuner.cli.cache import main as cache_main
from simpletuner.cli.train import main as train_main

NUM_SHARDS, PER_SHARD = 3, 4
SHARD_NAMES = {"webdataset": "{:05d}.tar", "parquet": "train-{:05d}.parquet"}


def _png(index: int, invert: bool = False) -> bytes:
    """A 64x64 image of its own colour as a stored (level-0) PNG: its length does not depend on its pixels."""
    colour = (37 * index % 256, 90, 200 - 11 * index)
    image = Image.new("RGB", (64, 64), tuple(255 - c for c in colour) if invert else colour)
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=0)
    return out.getvalue()


def _write_shards(kind: str, root: Path) -> dict[str, tuple[Path, int]]:
    """:data:`NUM_SHARDS` shards of :data:`PER_SHARD` captioned images under ``root``, uncompressed (so an image
    can be edited in place); ``{virtual path: (shard, image index)}``."""
    root.mkdir(parents=True, exist_ok=True)
    where = {}
    for shard_index in range(NUM_SHARDS):
        shard = root / SHARD_NAMES[kind].format(shard_index)
        indices = range(shard_index * PER_SHARD, (shard_index + 1) * PER_SHARD)
        if kind == "webdataset":
            with tarfile.open(shard, "w", format=tarfile.PAX_FORMAT) as archive:
                for i in indices:
                    for name, data in ((f"{i:04d}.png", _png(i)), (f"{i:04d}.txt", f"shape number {i}".encode())):
                        info = tarfile.TarInfo(name)
                        info.size = len(data)
                        archive.addfile(info, io.BytesIO(data))
                    where[f"{shard.name}/{i:04d}.png"] = (shard, i)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.table({"image": [_png(i) for i in indices], "text": [f"shape number {i}" for i in indices]})
            pq.write_table(table, shard, row_group_size=1, compression="none", use_dictionary=False)
            where.update({f"{shard.name}/{row:06d}.png": (shard, i) for row, i in enumerate(indices)})
    return where


def _config_file(tmp_path: Path, raw: dict, name: str = "cfg.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return str(path)


# --- N1: an object store that cannot be listed at start ------------------------------------------------------------
class _Always503(BaseHTTPRequestHandler):
    """Every request answered with S3's ServiceUnavailable, counted."""

    protocol_version = "HTTP/1.1"
    num_requests = 0

    def log_message(self, *args):
        pass

    def do_GET(self):
        type(self).num_requests += 1
        body = b"<Error><Code>ServiceUnavailable</Code><Message>Please reduce your request rate.</Message></Error>"
        self.send_response(503)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_PUT = do_POST = do_GET


@pytest.fixture
def s3_env(monkeypatch):
    """botocore with made-up keys that looks nowhere but where the dataset says (no profile, no instance role)."""
    pytest.importorskip("s3fs")
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (
        ("AWS_EC2_METADATA_DISABLED", "true"),
        ("AWS_CONFIG_FILE", os.devnull),
        ("AWS_SHARED_CREDENTIALS_FILE", os.devnull),
        ("AWS_DEFAULT_REGION", "us-east-1"),
        ("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE"),
        ("AWS_SECRET_ACCESS_KEY", "not-a-secret"),
    ):
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("store", ["nothing_listens", "answers_503"])
def test_a_store_that_cannot_be_listed_stops_naming_the_endpoint_and_the_retries(
    store, s3_env, make_config, tmp_path, capsys
):
    server = None
    if store == "answers_503":
        _Always503.num_requests = 0
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Always503)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    else:
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            endpoint = f"http://127.0.0.1:{free.getsockname()[1]}"  # closed again: nothing listens there
    dataset = {"id": "store", "type": "object_store", "instance_data_dir": "s3://data/shapes"}
    dataset.update(storage_options={"endpoint_url": endpoint}, max_retries=2, retry_backoff_seconds=0.01)
    try:
        code = train_main(["--config", _config_file(tmp_path, make_config(datasets=[dataset]))])
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    err = capsys.readouterr().err
    assert code == 2, err
    assert "internal error" not in err and "Traceback" not in err
    assert "error: dataset 'store': listing s3://data/shapes failed 3 time(s) (" in err
    assert f"at {endpoint} (from storage_options.endpoint_url)" in err and "2 retries" in err
    assert ("ServiceUnavailable" if server else "EndpointConnectionError") in err and "max_retries" in err
    assert "not-a-secret" not in err
    if server is not None:
        assert _Always503.num_requests == 3  # one attempt and the 2 retries, no more
    assert not (tmp_path / "output" / "pytorch_lora_weights.safetensors").exists()


# --- N2: a shard deleted after the scan -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["webdataset", "parquet"])
def test_a_shard_deleted_after_the_scan_is_named_and_counted_as_unreadable(
    kind, make_config, tmp_path, monkeypatch, capsys, caplog
):
    root = tmp_path / kind
    _write_shards(kind, root)
    victim = root / SHARD_NAMES[kind].format(1)
    kept = shutil.copy2(victim, tmp_path / victim.name)  # the same bytes and mtime: the same identity
    scan = factory.build_metadata

    def scan_then_delete(*args, **kwargs):
        metadata = scan(*args, **kwargs)
        victim.unlink()
        return metadata

    monkeypatch.setattr(factory, "build_metadata", scan_then_delete)
    raw = make_config(max_train_steps=1, datasets=[{"id": "shards", "type": kind, "instance_data_dir": str(root)}])
    with caplog.at_level(logging.WARNING, logger="simpletuner"):
        assert train_main(["--config", _config_file(tmp_path, raw)]) == 0, capsys.readouterr().err
    gone = f"dataset 'shards': {victim} is gone: the shard was deleted or moved after the run found it"
    skipped = f"dataset 'shards': {PER_SHARD} of {NUM_SHARDS * PER_SHARD} image files are unreadable and left out"
    assert skipped in caplog.text and gone in caplog.text

    # Above max_bad_image_fraction the same loss stops the run before training, naming the shard.
    shutil.copy2(kept, victim)
    raw.update(max_bad_image_fraction=0.25, output_dir=str(tmp_path / "output2"))
    assert train_main(["--config", _config_file(tmp_path, raw, "cfg2.json")]) == 2
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err
    assert f"error: dataset 'shards': {PER_SHARD} of {NUM_SHARDS * PER_SHARD} image files under {root}" in err
    assert gone in err and not (tmp_path / "output2" / "pytorch_lora_weights.safetensors").exists()


# --- `cache verify --content` over shards ---------------------------------------------------------------------------
def _edit_in_shard(shard: Path, old: bytes, new: bytes) -> None:
    """Replace an image's bytes inside its shard with others of the same length, and put the mtime back."""
    before = shard.stat()
    data = shard.read_bytes()
    assert len(new) == len(old) and data.count(old) >= 1
    shard.write_bytes(data.replace(old, new))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (shard.stat().st_size, shard.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.mark.parametrize("kind", ["webdataset", "parquet"])
def test_cache_verify_content_reads_shards_in_place(kind, make_config, tmp_path, capsys):
    root = tmp_path / kind
    where = _write_shards(kind, root)
    raw = make_config(max_train_steps=1, datasets=[{"id": "shards", "type": kind, "instance_data_dir": str(root)}])
    cfg = _config_file(tmp_path, raw)
    trainer, _ = train(raw)
    capsys.readouterr()
    assert cache_main(["verify", "--config", cfg, "--content"]) == 0
    assert "sources: 12 unchanged, 0 changed since encoded" in capsys.readouterr().out

    edited = sorted(where)[5]
    shard, index = where[edited]
    _edit_in_shard(shard, _png(index), _png(index, invert=True))
    assert cache_main(["verify", "--config", cfg, "--content"]) == 1
    out = capsys.readouterr().out
    assert "sources: 11 unchanged, 1 changed since encoded" in out
    assert f"changed {root}/{edited} (entry {trainer.data.latent_keys[f'shards/{edited}']})" in out
