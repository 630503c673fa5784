"""The `object_store` backend (and `in_memory` staged from one) against a real S3 server: moto's, on 127.0.0.1,
with IAM authentication on, so wrong credentials are refused as AWS refuses them. A small HTTP proxy in front
of it drops connections or answers 503 for chosen requests: a flaky store, and one that keeps failing.

Every answer is compared with ``LocalDataBackend`` over the same files (the independent reference)."""

from __future__ import annotations

import http.client
import importlib
import io
import json
import os
import re
import socket
import threading
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from simpletuner.caching import ShardedTensorStore  # noqa: E402
from simpletuner.configuration import ConfigError, load_config, validate_config  # noqa: E402
from simpletuner.data_backend.base import DataBackend, SupportsReadHead  # noqa: E402
from simpletuner.data_backend.factory import build_datasets  # noqa: E402
from simpletuner.data_backend.in_memory import GH200InMemoryBackend  # noqa: E402
from simpletuner.data_backend.local import LocalDataBackend  # noqa: E402
from simpletuner.data_backend.object_store import ObjectStoreBackend, ObjectStoreError  # noqa: E402

BUCKET = "data"
PREFIX = "shapes"
FAST = {"max_retries": 3, "retry_backoff_seconds": 0.01}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FlakyProxy:
    """An HTTP proxy in front of the S3 server that fails chosen requests: ``drop`` closes the connection
    without an answer, ``503`` answers S3's ServiceUnavailable. Rules match a method and a path substring,
    ``times`` times (None: always)."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.rules: list[list] = []
        self.served: Counter = Counter()  # kind -> failures served
        self.requests: Counter = Counter()  # (method, path without query) -> requests seen
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def handle_any(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                kind = proxy._pick(self.command, self.path)
                if kind == "drop":
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                if kind == "503":
                    payload = (
                        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code>'
                        b"<Message>Service unavailable, try again</Message></Error>"
                    )
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for key, value in self.headers.items():
                    upstream.putheader(key, value)
                upstream.endheaders(body or None)
                response = upstream.getresponse()
                data = response.read()
                upstream.close()
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                        self.send_header(key, value)
                length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = handle_any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def fail(self, kind: str, times: int | None = None, match: str = "", method: str = "GET") -> None:
        with self.lock:
            self.rules.append([kind, times, match, method])

    def reset(self) -> None:
        with self.lock:
            self.rules.clear()
            self.served.clear()
            self.requests.clear()

    def _pick(self, method: str, path: str) -> str | None:
        with self.lock:
            self.requests[(method, path.split("?")[0])] += 1
            for rule in self.rules:
                kind, times, match, rule_method = rule
                if rule_method == method and match in path and (times is None or times > 0):
                    if times is not None:
                        rule[1] -= 1
                    self.served[kind] += 1
                    return kind
        return None

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def s3(shapes_dir):
    """moto's S3 server with bucket ``data`` holding the shapes dataset under ``shapes/`` (plus a hidden
    object and a folder marker), IAM authentication on, the trainer's key in the environment; and a
    flaky proxy in front of it."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")  # botocore never looks for an instance role
        mp.setenv("AWS_CONFIG_FILE", os.devnull)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_ACCESS_KEY_ID", "admin-before-auth")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "admin-before-auth")
        import boto3

        iam = boto3.client("iam", endpoint_url=endpoint)
        iam.create_user(UserName="trainer")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=BUCKET)
        for path in sorted(shapes_dir.iterdir()):
            client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{path.name}", Body=path.read_bytes())
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/.hidden/skip.png", Body=b"hidden")
        client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/empty/", Body=b"")
        _set_auth(endpoint, "0")  # from here on every request is signed by a key moto's IAM knows
        mp.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
        mp.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        proxy = FlakyProxy(port)
        try:
            client = boto3.session.Session().client("s3", endpoint_url=endpoint)  # the trainer's key: auth is on
            yield {"endpoint": endpoint, "proxy": proxy, "client": client}
        finally:
            proxy.stop()
            _set_auth(endpoint, "inf")
            server.stop()


def _set_auth(endpoint: str, count: str) -> None:
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth", data=count.encode(), method="POST", headers={"Content-Type": "text/plain"}
    )
    urllib.request.urlopen(request, timeout=10).read()


def _backend(endpoint: str, url: str = f"s3://{BUCKET}/{PREFIX}", **options) -> ObjectStoreBackend:
    return ObjectStoreBackend(url, "shapes", storage_options={"endpoint_url": endpoint}, **{**FAST, **options})


def test_answers_as_the_local_backend_does_over_the_same_files(s3, shapes_dir):
    store, local = _backend(s3["endpoint"]), LocalDataBackend(shapes_dir, "shapes")
    assert isinstance(store, DataBackend) and isinstance(store, SupportsReadHead)
    # the hidden object and the folder marker are skipped, as local skips hidden names
    assert store.list_files() == local.list_files()
    for extensions in ({".png"}, ["TXT"], {".jpg"}):
        assert store.list_files(extensions) == local.list_files(extensions)
    for path in local.list_files():
        assert store.read(path) == local.read(path)
        assert store.size(path) == local.size(path)
        assert store.exists(path)
        assert store.read_head(path, 24) == local.read_head(path, 24)  # one ranged GET
        assert store.read_head(path, 10**6) == local.read_head(path, 10**6)
    assert not store.exists("nope.png") and not store.exists(".hidden/skip.png")
    with pytest.raises(FileNotFoundError, match="nope.png"):
        store.read("nope.png")
    with pytest.raises(ValueError, match="not a relative path"):
        store.read("../other/x.png")
    assert "secret" not in repr(store).lower()


def test_identity_changes_when_an_object_is_rewritten(s3):
    client = s3["client"]
    client.put_object(Bucket=BUCKET, Key="ident/a.txt", Body=b"first")
    before = _backend(s3["endpoint"], f"s3://{BUCKET}/ident")
    assert before.identity("a.txt") == _backend(s3["endpoint"], f"s3://{BUCKET}/ident").identity("a.txt")
    client.put_object(Bucket=BUCKET, Key="ident/a.txt", Body=b"other")  # same size, new content
    after = _backend(s3["endpoint"], f"s3://{BUCKET}/ident")
    assert after.size("a.txt") == before.size("a.txt") == 5
    assert after.identity("a.txt") != before.identity("a.txt")
    assert after.read("a.txt") == b"other"


def test_dropped_connections_and_503s_are_retried(s3, shapes_dir):
    proxy = s3["proxy"]
    proxy.reset()
    proxy.fail("503", times=1, match=f"/{BUCKET}")  # the listing
    proxy.fail("drop", times=2, match=".png")
    proxy.fail("503", times=2, match=".png")
    store, local = _backend(proxy.endpoint), LocalDataBackend(shapes_dir, "shapes")
    for path in local.list_files():
        assert store.read(path) == local.read(path)
    assert proxy.served == Counter({"drop": 2, "503": 3})


def test_a_store_that_keeps_failing_raises_and_stages_nothing_of_the_file(s3, shapes_dir):
    proxy = s3["proxy"]
    proxy.reset()
    victim = "005.png"
    proxy.fail("503", match=f"/{PREFIX}/{victim}")
    store = _backend(proxy.endpoint, max_retries=2)
    with pytest.raises(ObjectStoreError, match=r"failed 3 time\(s\) \(ServiceUnavailable: .*max_retries") as info:
        store.read(victim)
    assert isinstance(info.value, OSError)
    assert proxy.requests[("GET", f"/{BUCKET}/{PREFIX}/{victim}")] == 3  # max_retries + 1, then no more
    proxy.reset()
    proxy.fail("drop", match=f"/{PREFIX}/{victim}")
    staged = GH200InMemoryBackend(store.url, "shapes", source=store, num_workers=4, max_bad_image_fraction=0.5)
    local = LocalDataBackend(shapes_dir, "shapes")
    assert set(staged.failed_files()) == {victim} and "failed 3 time(s)" in staged.failed_files()[victim]
    assert staged.list_files() == [p for p in local.list_files() if p != victim]
    assert not staged.exists(victim)
    with pytest.raises(FileNotFoundError, match="unreadable when staged"):
        staged.read(victim)
    for path in staged.list_files():
        assert staged.read(path) == local.read(path) and staged.identity(path) == store.identity(path)


def test_an_object_removed_after_the_listing_is_not_retried(s3):
    client, proxy = s3["client"], s3["proxy"]
    client.put_object(Bucket=BUCKET, Key="gone/a.txt", Body=b"here")
    proxy.reset()
    store = _backend(proxy.endpoint, f"s3://{BUCKET}/gone")
    client.delete_object(Bucket=BUCKET, Key="gone/a.txt")
    with pytest.raises(FileNotFoundError, match="a.txt"):
        store.read("a.txt")
    assert proxy.requests[("GET", f"/{BUCKET}/gone/a.txt")] == 1


def _datasets(endpoint: str, **extra) -> list[dict]:
    options = {"storage_options": {"endpoint_url": endpoint}, **FAST, **extra}
    url = f"s3://{BUCKET}/{PREFIX}"
    return [
        {"id": "store", "type": "object_store", "instance_data_dir": url, **options},
        {"id": "staged", "type": "in_memory", "instance_data_dir": url, "in_memory": {"num_workers": 2}, **options},
    ]


def test_training_reads_through_a_flaky_store_and_skips_the_file_that_never_comes(s3, tiny_sd, shapes_dir, tmp_path):
    from training_helpers import tiny_config, train

    proxy = s3["proxy"]
    proxy.reset()
    victim = "005.png"
    proxy.fail("503", match=f"/{PREFIX}/{victim}")
    proxy.fail("drop", times=2, match=".png")
    proxy.fail("503", times=2, match=".txt")
    raw = tiny_config(
        tiny_sd, shapes_dir, tmp_path, max_train_steps=2, max_bad_image_fraction=0.2, datasets=_datasets(proxy.endpoint)
    )
    trainer, result = train(raw)
    assert result.global_step == 2
    assert proxy.served["drop"] == 2 and proxy.served["503"] >= 2 + 2 * (FAST["max_retries"] + 1)
    reference = build_datasets(validate_config(tiny_config(tiny_sd, shapes_dir, tmp_path)))[0]
    expected = [(s.path, s.caption, s.bucket) for s in reference.samples if s.path != victim]
    for dataset in trainer.state.datasets:
        assert [(s.path, s.caption, s.bucket) for s in dataset.samples] == expected
        assert victim in dict(dataset.metadata.bad_files)
    staged = trainer.state.datasets[1].backend
    assert isinstance(staged, GH200InMemoryBackend) and set(staged.failed_files()) == {victim}


def _run_fails(raw) -> str:
    from training_helpers import train

    with pytest.raises(ValueError) as info:
        train(raw)
    return str(info.value)


def test_wrong_credentials_stop_before_training_naming_the_fix(s3, tiny_sd, shapes_dir, tmp_path, monkeypatch):
    from training_helpers import tiny_config

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAKEY")
    raw = tiny_config(tiny_sd, shapes_dir, tmp_path, datasets=_datasets(s3["endpoint"])[:1])
    message = _run_fails(raw)
    assert "'store'" in message and f"s3://{BUCKET}/{PREFIX}" in message
    assert "refused the credentials (InvalidAccessKeyId" in message and "AWS_ACCESS_KEY_ID" in message
    monkeypatch.undo()
    datasets = _datasets(s3["endpoint"])[1:]
    datasets[0]["storage_options"] = {**datasets[0]["storage_options"], "key": os.environ["AWS_ACCESS_KEY_ID"]}
    datasets[0]["storage_options"]["secret"] = "not-the-secret"
    message = _run_fails(tiny_config(tiny_sd, shapes_dir, tmp_path, datasets=datasets))
    assert "refused the credentials (SignatureDoesNotMatch" in message and "not-the-secret" not in message
    assert not (tmp_path / "output" / "pytorch_lora_weights.safetensors").exists()


def test_a_missing_bucket_or_an_empty_prefix_stops_naming_it(s3, tiny_sd, shapes_dir, tmp_path):
    from training_helpers import tiny_config

    datasets = _datasets(s3["endpoint"])[:1]
    datasets[0]["instance_data_dir"] = "s3://no-such-bucket/shapes"
    message = _run_fails(tiny_config(tiny_sd, shapes_dir, tmp_path, datasets=datasets))
    assert "the bucket 'no-such-bucket' of s3://no-such-bucket/shapes does not exist (NoSuchBucket)" in message
    datasets[0]["instance_data_dir"] = f"s3://{BUCKET}/nothing-here"
    message = _run_fails(tiny_config(tiny_sd, shapes_dir, tmp_path, datasets=datasets))
    assert f"no files under s3://{BUCKET}/nothing-here" in message


def test_the_config_refuses_a_path_for_a_store_and_a_url_for_a_folder(tiny_sd, shapes_dir, tmp_path):
    from training_helpers import tiny_config

    def problems(dataset: dict) -> str:
        with pytest.raises(ConfigError) as info:
            validate_config(tiny_config(tiny_sd, shapes_dir, tmp_path, datasets=[{"id": "d", **dataset}]))
        return str(info.value)

    assert "use `type: local`" in problems({"type": "object_store", "instance_data_dir": str(shapes_dir)})
    assert "use `type: object_store`" in problems({"type": "local", "instance_data_dir": "s3://b/p"})
    assert "fsspec knows no protocol 'nosuch'" in problems({"type": "object_store", "instance_data_dir": "nosuch://b"})
    assert "names no bucket" in problems({"type": "object_store", "instance_data_dir": "s3:///p"})
    local_with_options = {"type": "in_memory", "instance_data_dir": str(shapes_dir), "storage_options": {"anon": True}}
    assert "remove `storage_options`" in problems(local_with_options)


def test_a_url_in_a_config_file_is_not_taken_as_a_relative_path(tiny_sd, shapes_dir, tmp_path):
    from training_helpers import tiny_config

    raw = tiny_config(tiny_sd, shapes_dir, tmp_path, datasets=_datasets("http://127.0.0.1:9")[:1])
    (tmp_path / "cfg.json").write_text(json.dumps(raw))
    config = load_config(tmp_path / "cfg.json").config  # the folder check skips a URL: it is listed at build
    assert config.datasets[0].instance_data_dir == f"s3://{BUCKET}/{PREFIX}"
    assert config.datasets[0].storage_options == {"endpoint_url": "http://127.0.0.1:9"}


def test_simpletuner_aws_datasets_become_object_store_and_load(s3, tiny_sd, tmp_path, monkeypatch):
    entry = {
        "id": "photos",
        "type": "aws",
        "aws_bucket_name": BUCKET,
        "aws_data_prefix": PREFIX,
        "aws_endpoint_url": s3["endpoint"],
        "aws_region_name": None,
        "aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
        "caption_strategy": "textfile",
    }
    (tmp_path / "multidatabackend.json").write_text(json.dumps([entry]))
    simpletuner = {
        "--model_family": "sd1x",
        "--model_type": "lora",
        "--pretrained_model_name_or_path": str(tiny_sd),
        "--data_backend_config": "multidatabackend.json",
        "--output_dir": "output",
        "--resolution": 64,
        "--aspect_bucket_alignment": 16,
        "--max_train_steps": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(simpletuner))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")  # the entry's own keys are used
    config = load_config(tmp_path / "config.json").config
    (ds,) = config.datasets
    assert ds.type == "object_store" and ds.instance_data_dir == f"s3://{BUCKET}/{PREFIX}"
    assert ds.storage_options == {
        "endpoint_url": s3["endpoint"],
        "key": entry["aws_access_key_id"],
        "secret": entry["aws_secret_access_key"],
    }
    built = build_datasets(config)[0]
    assert (
        len(built.samples) == 12
        and built.backend.list_files()
        == ObjectStoreBackend(ds.instance_data_dir, "x", storage_options=ds.storage_options).list_files()
    )
    # the bucket and prefix in either order, and `instance_data_dir` beside them is refused
    (tmp_path / "multidatabackend.json").write_text(json.dumps([{**entry, "instance_data_dir": "/data"}]))
    with pytest.raises(ConfigError, match="for `type: aws` give the folder inside the bucket as `aws_data_prefix`"):
        load_config(tmp_path / "config.json")


def test_a_missing_protocol_package_names_the_extra(monkeypatch):
    registry = importlib.import_module("fsspec.registry")  # `fsspec.registry` is also a mapping's name

    monkeypatch.delitem(registry._registry, "s3", raising=False)
    monkeypatch.setitem(
        registry.known_implementations, "s3", {"class": "no_such_s3fs.S3FileSystem", "err": "Install s3fs"}
    )
    with pytest.raises(ImportError, match=r"pip install -e '\.\[s3\]'"):
        ObjectStoreBackend("s3://b/p", "d")


def test_the_run_folders_copy_of_the_config_leaves_out_secrets(tmp_path):
    from simpletuner.training.run_folder import REDACTED, write_run_config

    options = {"endpoint_url": "http://127.0.0.1:9", "key": "AKIAEXAMPLE", "secret": "s3cr3t", "anon": False}
    raw = {"datasets": [{"id": "a", "type": "object_store", "storage_options": options}, {"id": "b"}], "seed": 1}
    write_run_config(tmp_path, raw)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["datasets"][0]["storage_options"] == {
        "endpoint_url": "http://127.0.0.1:9",
        "key": REDACTED,
        "secret": REDACTED,
        "anon": False,
    }
    assert written["datasets"][1] == {"id": "b"} and written["seed"] == 1
    assert b"s3cr3t" not in (tmp_path / "config.json").read_bytes()
    assert raw["datasets"][0]["storage_options"]["secret"] == "s3cr3t"  # the run's own copy is untouched


# --- an object rewritten while a run reads it (N5) -----------------------------------------------------------------
def _stored_png(image: Image.Image) -> bytes:
    """``image`` as a stored (level-0) PNG: its length depends on the pixel count only, so an image of other
    pixels can replace it with the same size (same Content-Length, new ETag)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=0)
    return buffer.getvalue()


@pytest.fixture
def rewritable(s3, shapes_dir, request):
    """The shapes dataset under a prefix of its own whose ``005.png`` is a stored PNG, and its other-pixel
    twin of the same size: ``(prefix, {name: bytes uploaded}, twin)``."""
    prefix, client = "rewrite-" + re.sub(r"\W+", "-", request.node.name)[-40:], s3["client"]
    files = {p.name: p.read_bytes() for p in sorted(shapes_dir.iterdir())}
    image = Image.open(shapes_dir / "005.png").convert("RGB")
    files["005.png"], twin = _stored_png(image), _stored_png(Image.eval(image, lambda value: 255 - value))
    assert len(twin) == len(files["005.png"]) and twin != files["005.png"]
    for name, data in files.items():
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=data)
    return prefix, files, twin


@pytest.mark.parametrize("request_kind", ["if_match", "info_after_read"])
def test_a_rewritten_object_is_never_read_as_the_listed_version(s3, rewritable, request_kind, monkeypatch):
    """The listing keys the cache by ETag, so a read must return the listed version or fail naming the object:
    S3 asks with If-Match (and checks the ETag that came back); other stores compare the object's tag after
    the read with the listed one."""
    if request_kind == "info_after_read":
        monkeypatch.setattr(ObjectStoreBackend, "_reads_by_etag", lambda self, obj: False)
    prefix, files, twin = rewritable
    store = _backend(s3["endpoint"], f"s3://{BUCKET}/{prefix}")
    assert store.read("005.png") == files["005.png"]
    s3["client"].put_object(Bucket=BUCKET, Key=f"{prefix}/005.png", Body=twin)  # same size, other pixels
    for read in (store.read, lambda path: store.read_head(path, 24)):
        with pytest.raises(OSError, match=rf"s3://{BUCKET}/{prefix}/005\.png changed after it was listed") as info:
            read("005.png")
        assert "Run again" in str(info.value) and not isinstance(info.value, FileNotFoundError)
        assert ("(PreconditionFailed: " if request_kind == "if_match" else "(ETag: listed ETag ") in str(info.value)
    assert store.read("000.png") == files["000.png"]
    s3["client"].put_object(Bucket=BUCKET, Key=f"{prefix}/005.png", Body=files["005.png"])  # put back: readable
    assert store.read("005.png") == files["005.png"]


def test_an_object_rewritten_during_the_fill_is_left_out_and_encoded_when_put_back(
    s3, rewritable, tiny_sd, shapes_dir, tmp_path, monkeypatch, capsys
):
    """N5 of the second reliability attack: rewritten (same size) after the scan, put back after the run. The
    run leaves it out (it cannot be read as the listed version) instead of storing the other image's latent
    under the listed ETag's key, so the next run over the original bytes encodes it rather than reusing a
    latent of other pixels. `cache verify --content` reads the store too: a latent whose recorded source is
    not what the object holds is reported, the others are not."""
    from training_helpers import tiny_config, train

    import simpletuner.data_backend.factory as factory
    from simpletuner.caching.fingerprint import source_hash
    from simpletuner.cli.cache import main as cache_main

    prefix, files, twin = rewritable
    key = f"{prefix}/005.png"
    datasets = [{"id": "store", "type": "object_store", "instance_data_dir": f"s3://{BUCKET}/{prefix}", **FAST}]
    datasets[0]["storage_options"] = {"endpoint_url": s3["endpoint"]}
    raw = tiny_config(tiny_sd, shapes_dir, tmp_path, max_train_steps=1, datasets=datasets)
    scan = factory.build_metadata

    def scan_then_rewrite(*args, **kwargs):
        metadata = scan(*args, **kwargs)
        s3["client"].put_object(Bucket=BUCKET, Key=key, Body=twin)
        return metadata

    monkeypatch.setattr(factory, "build_metadata", scan_then_rewrite)
    first, _ = train(dict(raw, output_dir=str(tmp_path / "out1")))
    monkeypatch.undo()
    (dataset,) = first.state.datasets
    assert "005.png" not in {s.path for s in dataset.samples}
    assert "changed after it was listed" in dict(dataset.metadata.bad_files)["005.png"]
    store = ShardedTensorStore(tmp_path / "cache" / "sd" / "vae")
    listed = {source_hash([data]) for name, data in files.items() if name.endswith(".png")}
    assert set(store.source_hashes(store.keys()).values()) <= listed  # every latent is of the listed bytes

    s3["client"].put_object(Bucket=BUCKET, Key=key, Body=files["005.png"])
    second, _ = train(dict(raw, output_dir=str(tmp_path / "out2")))
    report = second.data.fill_reports["latents"]
    assert (report.num_computed, report.num_hits) == (1, 11)

    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(raw))
    capsys.readouterr()
    assert cache_main(["verify", "--config", str(cfg), "--content"]) == 0
    assert "sources: 12 unchanged, 0 changed since encoded" in capsys.readouterr().out
    latent_key = second.data.latent_keys["store/005.png"]
    store = ShardedTensorStore(tmp_path / "cache" / "sd" / "vae")  # a latent of other pixels under this key
    store.put_many({latent_key: store.get(latent_key)}, source_hashes={latent_key: source_hash([twin])})
    assert cache_main(["verify", "--config", str(cfg), "--content"]) == 1
    out = capsys.readouterr().out
    assert "sources: 11 unchanged, 1 changed since encoded" in out
    assert f"changed s3://{BUCKET}/{key} (entry {latent_key})" in out
