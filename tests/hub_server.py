"""A local Hugging Face Hub for tests: a real HTTP server on 127.0.0.1 that huggingface_hub's own client talks to.

Usage: the ``hub_server`` fixture (tests/conftest.py) starts one per test with the client pointed at it and online;
``hub_server.add_repo("org/name", {"model_index.json": b"{}"}, revision="main", gated=False, private=False)`` serves a
repo (returns its commit hash, the one ``hub_fixtures.lay_out_hub_cache`` gives for the same files), and the code under
test downloads it with ``snapshot_download`` / ``hf_hub_download`` / diffusers / ``HfFileSystem`` into its cache.
Uploads (``create_repo``, ``upload_folder``, ``upload_file``, ``create_commit``) land in ``hub_server.commits``
(``RecordedCommit``: message, operations, added files' bytes) and ``hub_server.repo_files(repo_id)``; writes need
``token=hub_server.token`` (or ``HF_TOKEN`` set to it): without one the client raises ``HfHubHTTPError`` (401); a
token in ``.read_tokens`` reads but gets 403 on writes, as does a write outside ``user`` and ``.writable_namespaces``
(when set).
A gated repo without a token gives ``GatedRepoError``, a missing or private one ``RepositoryNotFoundError``, a bad
revision ``RevisionNotFoundError``, a missing file ``EntryNotFoundError`` (huggingface_hub maps the ``X-Error-Code``
header the server sends). ``hub_server.fail("POST", "/commit/", 503, times=2)`` makes the next matching requests fail
(retries, error reports); ``hub_server.hold("POST", "/commit/")`` keeps them waiting until the event it returns is set.
``hub_server.unhandled`` lists requests no route answered (assert it stays empty).

How the client is switched per test (``HubServer.use``): huggingface_hub reads ``HF_ENDPOINT`` at import into
``constants.ENDPOINT`` and ``constants.HUGGINGFACE_CO_URL_TEMPLATE``, and the module-level ``HfApi`` behind
``huggingface_hub.create_repo`` & co took it at import too: all three are monkeypatched, and the environment (for
subprocesses). ``HF_HUB_OFFLINE`` (the suite sets 1) is read at import into ``constants.HF_HUB_OFFLINE``, which every
request checks: ``hub_fixtures.hub_online`` patches it off (and diffusers' import-time copies). Xet is switched off
(``constants.HF_HUB_DISABLE_XET``) so large files upload through the LFS batch protocol and download over plain
HTTP; ``use(monkeypatch, xet=True)`` keeps it on, and the server then answers every preupload "regular". No token is
found implicitly (``HF_TOKEN`` unset, ``HF_TOKEN_PATH`` an empty temporary folder).

Endpoints: ``GET /api/{models,datasets}/{repo}[/revision/{rev}]`` (``sha``, ``siblings``; sizes and LFS with
``blobs=1``), ``GET .../tree/{rev}[/{path}]`` (``recursive``), ``POST .../paths-info/{rev}``, ``HEAD``/``GET
/[datasets/]{repo}/resolve/{rev}/{path}`` (``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag`` / ``X-Linked-Size`` for LFS
files, ``Content-Length``, single ``Range``; no redirects), ``POST /api/repos/create``, ``POST .../preupload/{rev}``,
``POST /[datasets/]{repo}.git/info/lfs/objects/batch`` with its upload (``PUT``) and verify hrefs, ``POST
.../commit/{rev}`` (NDJSON; ``create_pr=1`` makes ``refs/pr/N``), ``POST /api/validate-yaml`` (README.md uploads),
``GET /api/whoami-v2`` and ``GET /api/agent-harnesses`` (the client's user-agent registry).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

from hub_fixtures import LFS_SUFFIXES, HubFile, commit_hash_for, hub_files, hub_online, is_lfs_path, use_hub_cache

if TYPE_CHECKING:
    import pytest


@dataclass
class RecordedCommit:
    """One commit the server accepted: what the client sent (``operations``: the NDJSON lines, file contents left
    out) and the added files' bytes."""

    repo_id: str
    repo_type: str
    revision: str
    oid: str
    message: str
    description: str
    operations: list[dict[str, Any]]
    files: dict[str, bytes]
    deleted: list[str]


@dataclass
class _Repo:
    repo_id: str
    repo_type: str
    private: bool = False
    gated: bool = False
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    trees: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> {path: bytes}


_GITATTRIBUTES = "".join(f"*{suffix} filter=lfs diff=lfs merge=lfs -text\n" for suffix in sorted(LFS_SUFFIXES))


class HubServer:
    """An in-memory Hub on ``http://127.0.0.1:<free port>`` (``.url``), served by ``http.server`` in a thread.

    Reads: ``add_repo`` repos answer repo info, tree listings, paths-info and ``resolve`` (HEAD and GET) with the
    headers the client needs; private and gated repos want a valid token. Writes (create repo, preupload, LFS batch +
    upload + verify, commit, validate-yaml) want ``Authorization: Bearer <token>`` with a token in ``.tokens``
    (``.token`` is the first). ``.commits`` records every commit; ``.requests`` every ``(method, path)``;
    ``.unhandled`` requests no route answered (a test can assert it stays empty).
    """

    def __init__(self, token: str = "hf_test_write_token", user: str = "test-user") -> None:
        self.token = token
        self.tokens: set[str] = {token}
        self.read_tokens: set[str] = set()  # valid tokens with the "read" role: reads work, writes get 403
        #: Namespaces the tokens may write to besides ``user`` (others: 403); None: any namespace.
        self.writable_namespaces: set[str] | None = None
        self.user = user
        self.repos: dict[tuple[str, str], _Repo] = {}
        self.commits: list[RecordedCommit] = []
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        self.lfs_objects: dict[str, bytes] = {}
        self.regular_uploads_only = False  # answer every preupload "regular" (set by ``use(xet=True)``)
        self.cache_dir: Path | None = None  # the test's default Hub cache, where running_hub_server set one
        self._failures: list[list[Any]] = []  # [method, path regex, status, times left]
        self._holds: list[tuple[str, re.Pattern[str], threading.Event]] = []  # requests kept waiting: hold()
        self._lock = threading.RLock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._client_dir: tempfile.TemporaryDirectory[str] | None = None

    # -- life cycle ---------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("the hub server is not running: use it as a context manager")
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> HubServer:
        server = self

        class Handler(_HubHandler):
            hub = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="hub-server", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._client_dir is not None:
            self._client_dir.cleanup()
        self._httpd = self._thread = self._client_dir = None

    def use(self, monkeypatch: pytest.MonkeyPatch, *, xet: bool = False) -> None:
        """Point this process's huggingface_hub client at the server for one test, online, Xet off unless ``xet``,
        no implicit token (the module docstring says which settings and why)."""
        from huggingface_hub import constants, hf_api

        url = self.url
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(hf_api.api, "endpoint", url)
        hub_online(monkeypatch)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "0" if xet else "1")
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", not xet)
        self.regular_uploads_only = xet
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
            monkeypatch.delenv(name, raising=False)
        if self._client_dir is None:
            self._client_dir = tempfile.TemporaryDirectory(prefix="hub-client-")
        token_path = os.path.join(self._client_dir.name, "token")
        monkeypatch.setenv("HF_TOKEN_PATH", token_path)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", token_path)
        monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", os.path.join(self._client_dir.name, "stored_tokens"))
        # the client caches the Hub's agent-harness registry (user-agent telemetry) under HF_HOME, and hf_xet writes
        # its logs under HF_XET_CACHE (read from the environment when its session starts): not the user's
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", os.path.join(self._client_dir.name, "agent_harnesses"))
        monkeypatch.setenv("HF_XET_CACHE", os.path.join(self._client_dir.name, "xet"))
        monkeypatch.setattr(constants, "HF_XET_CACHE", os.path.join(self._client_dir.name, "xet"))

    # -- repos --------------------------------------------------------------------------------------------------------
    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes | Path],
        repo_type: str = "model",
        revision: str = "main",
        gated: bool = False,
        private: bool = False,
        commit: str | None = None,
    ) -> str:
        """Serve ``files`` as ``revision`` of ``repo_id`` (added to the repo if it exists); returns the commit hash,
        the same one ``lay_out_hub_cache`` gives for the same arguments."""
        entries = hub_files(files)
        commit = commit or commit_hash_for(repo_id, repo_type, entries)
        with self._lock:
            repo = self.repos.setdefault((repo_type, repo_id), _Repo(repo_id, repo_type))
            repo.private, repo.gated = private, gated
            repo.trees[commit] = {f.path: f.data for f in entries}
            if revision != commit:
                repo.refs[revision] = commit
        return commit

    def repo_files(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> dict[str, bytes]:
        """The files of ``repo_id`` at ``revision`` as the server holds them (after any commits)."""
        with self._lock:
            repo = self.repos[(repo_type, repo_id)]
            return dict(repo.trees[repo.refs.get(revision, revision)])

    def fail(self, method: str, path_regex: str, status: int = 500, times: int = 1) -> None:
        """Answer the next ``times`` requests whose method and path (``re.search``) match with ``status`` (to test
        retries and error reports: e.g. ``fail("POST", "/commit/", 503, times=2)``)."""
        with self._lock:
            self._failures.append([method, re.compile(path_regex), status, times])

    def hold(self, method: str, path_regex: str) -> threading.Event:
        """Keep every matching request waiting until the returned event is set (at most 60 s): an upload that is
        still being sent, for tests of what goes on meanwhile."""
        event = threading.Event()
        with self._lock:
            self._holds.append((method, re.compile(path_regex), event))
        return event

    def repo(self, repo_id: str, repo_type: str = "model") -> _Repo:
        return self.repos[(repo_type, repo_id)]


class _HubError(Exception):
    """An error answer: status, ``X-Error-Code`` (what huggingface_hub maps to its exceptions), message."""

    def __init__(self, status: int, code: str | None, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}


class _HubHandler(BaseHTTPRequestHandler):
    """Routes one request of the Hub's HTTP API to the ``HubServer`` in ``hub``; one request per connection."""

    hub: HubServer
    protocol_version = "HTTP/1.1"
    _raw_body = b""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass

    # -- plumbing -----------------------------------------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        parts = [unquote(p) for p in split.path.split("/")[1:]]
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        with self.hub._lock:
            self.hub.requests.append((method, split.path))
        # read the whole body first: closing the connection on unread bytes could reset it before the answer arrives
        self._raw_body = b""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self._send_json(411, {"error": "the test hub wants a Content-Length"})
            return
        self._raw_body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.hub._lock:
            failure = next((f for f in self.hub._failures if f[0] == method and f[1].search(split.path)), None)
            if failure is not None:
                failure[3] -= 1
                if failure[3] <= 0:
                    self.hub._failures.remove(failure)
        if failure is not None:
            self._send_json(failure[2], {"error": f"injected failure {failure[2]}"})
            return
        with self.hub._lock:
            held = [event for m, pattern, event in self.hub._holds if m == method and pattern.search(split.path)]
        for event in held:
            event.wait(timeout=60)  # a test that never releases it fails on the client's side, not by hanging
        try:
            handled = self._route(method, parts, query)
        except _HubError as e:
            headers = {"X-Error-Message": e.message, **e.headers}
            if e.code:
                headers["X-Error-Code"] = e.code
            self._send_json(e.status, {"error": e.message}, headers)
            return
        if not handled:
            with self.hub._lock:
                self.hub.unhandled.append((method, split.path))
            self._send_json(404, {"error": f"no such endpoint on the test hub: {method} {split.path}"})

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def _body(self) -> bytes:
        return self._raw_body

    def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool = False) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _send_json(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None:
        self._send(
            status,
            json.dumps(payload).encode(),
            {"Content-Type": "application/json", **(headers or {})},
            head=self.command == "HEAD",
        )

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    def _authorized(self) -> bool:
        """True for a valid token, False for none; a token that is not valid is a 401 whatever the request."""
        token = self._token()
        if token is None:
            return False
        if token not in self.hub.tokens and token not in self.hub.read_tokens:
            raise _HubError(401, None, "Invalid credentials in Authorization header")
        return True

    def _require_write(self, namespace: str | None = None) -> None:
        if not self._authorized():
            raise _HubError(401, None, "You must be authenticated to write to the Hub: pass a token")
        if self._token() in self.hub.read_tokens:
            raise _HubError(403, None, "You don't have the rights to write with this token (read-only)")
        allowed = self.hub.writable_namespaces
        if namespace is not None and allowed is not None and namespace not in {self.hub.user, *allowed}:
            raise _HubError(403, None, f"You don't have the rights to create a model under the namespace {namespace}")

    # -- reads --------------------------------------------------------------------------------------------------------
    def _readable_repo(self, repo_type: str, repo_id: str) -> _Repo:
        authorized = self._authorized()
        repo = self.hub.repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not authorized):
            raise _HubError(404 if authorized else 401, "RepoNotFound", "Repository not found")
        if repo.gated and not authorized:
            raise _HubError(
                401,
                "GatedRepo",
                f"Access to {repo_type} {repo_id} is restricted. You must have access to it and be authenticated to "
                "access it. Please log in.",
            )
        return repo

    @staticmethod
    def _commit_of(repo: _Repo, revision: str) -> str:
        if revision in repo.refs:
            return repo.refs[revision]
        if revision in repo.trees:
            return revision
        raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    def _route(self, method: str, parts: list[str], query: dict[str, str]) -> bool:
        if len(parts) >= 2 and parts[0] == "api" and parts[1] in _TYPES:
            return self._route_api(method, _TYPES[parts[1]], parts[2:], query)
        if parts[:2] == ["api", "repos"] and method == "POST" and parts[2:] == ["create"]:
            self._create_repo()
            return True
        if parts == ["api", "validate-yaml"] and method == "POST":  # README.md metadata, checked before uploads
            self._send_json(200, {"errors": [], "warnings": []})
            return True
        if parts == ["api", "agent-harnesses"] and method == "GET":  # the client's user-agent telemetry registry
            self._send_json(200, {"standardEnvVars": [], "harnesses": {}})
            return True
        if parts == ["api", "whoami-v2"] and method == "GET":
            if not self._authorized():
                raise _HubError(401, None, "Invalid credentials in Authorization header")
            role = "read" if self._token() in self.hub.read_tokens else "write"
            token = {"displayName": "test", "role": role}
            self._send_json(
                200, {"type": "user", "name": self.hub.user, "auth": {"type": "access_token", "accessToken": token}}
            )
            return True
        if len(parts) == 2 and parts[0] in ("lfs-upload", "lfs-verify") and method in ("PUT", "POST"):
            self._lfs_transfer(parts[0], parts[1])
            return True
        repo_type = "model"
        if parts and parts[0] in ("datasets", "spaces"):
            repo_type, parts = _TYPES[parts[0]], parts[1:]
        if method in ("GET", "HEAD") and "resolve" in parts[1:3]:
            at = parts.index("resolve", 1)
            self._resolve("/".join(parts[:at]), repo_type, parts[at + 1], "/".join(parts[at + 2 :]), method)
            return True
        batch = ["info", "lfs", "objects", "batch"]
        if method == "POST" and len(parts) >= 6 and parts[-4:] == batch and parts[-5].endswith(".git"):
            self._lfs_batch("/".join(parts[:-5] + [parts[-5][: -len(".git")]]), repo_type)
            return True
        return False

    def _route_api(self, method: str, repo_type: str, parts: list[str], query: dict[str, str]) -> bool:
        for verb in ("revision", "tree", "paths-info", "preupload", "commit"):
            if verb in parts[1:3]:
                at = parts.index(verb, 1)
                repo_id, revision, rest = "/".join(parts[:at]), (parts[at + 1 : at + 2] or ["main"])[0], parts[at + 2 :]
                break
        else:
            verb, repo_id, revision, rest = "info", "/".join(parts), "main", []
        if method == "GET" and verb in ("info", "revision"):
            self._repo_info(repo_type, repo_id, revision, blobs=query.get("blobs") in ("1", "true", "True"))
        elif method == "GET" and verb == "tree":
            recursive = query.get("recursive") in ("1", "true", "True")
            self._tree(repo_type, repo_id, revision, "/".join(rest), recursive)
        elif method == "POST" and verb == "paths-info":
            self._paths_info(repo_type, repo_id, revision)
        elif method == "POST" and verb == "preupload":
            self._preupload(repo_type, repo_id, revision)
        elif method == "POST" and verb == "commit":
            self._commit(repo_type, repo_id, revision, create_pr=query.get("create_pr") == "1")
        else:
            return False
        return True

    def _repo_info(self, repo_type: str, repo_id: str, revision: str, blobs: bool) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        commit = self._commit_of(repo, revision)
        siblings = []
        for f in hub_files(dict(repo.trees[commit])):
            sibling: dict[str, object] = {"rfilename": f.path}
            if blobs:
                sibling.update(size=f.size, blobId=f.blob_id)
                if f.lfs_sha256:
                    sibling["lfs"] = {"size": f.size, "sha256": f.lfs_sha256, "pointerSize": len(f.lfs_pointer)}
            siblings.append(sibling)
        info = {
            "id": repo_id,
            "_id": hashlib.sha1(f"{repo_type}:{repo_id}".encode()).hexdigest()[:24],
            "author": repo_id.split("/")[0] if "/" in repo_id else None,
            "sha": commit,
            "private": repo.private,
            "gated": "auto" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "lastModified": "2024-01-01T00:00:00.000Z",
            "createdAt": "2024-01-01T00:00:00.000Z",
            "siblings": siblings,
        }
        self._send_json(200, info)

    @staticmethod
    def _tree_entries(tree: dict[str, bytes]) -> list[dict[str, object]]:
        """Every file and folder of a tree, as the tree and paths-info endpoints list them."""
        entries: dict[str, dict[str, object]] = {}
        for f in hub_files(dict(tree)):
            parents = f.path.split("/")[:-1]
            for depth in range(1, len(parents) + 1):
                folder = "/".join(parents[:depth])
                oid = hashlib.sha1(f"tree {folder}".encode()).hexdigest()
                entries.setdefault(folder, {"type": "directory", "oid": oid, "size": 0, "path": folder})
            entry: dict[str, object] = {"type": "file", "oid": f.blob_id, "size": f.size, "path": f.path}
            if f.lfs_sha256:
                entry["lfs"] = {"oid": f.lfs_sha256, "size": f.size, "pointerSize": len(f.lfs_pointer)}
            entries[f.path] = entry
        return [entries[path] for path in sorted(entries)]

    def _tree(self, repo_type: str, repo_id: str, revision: str, path: str, recursive: bool) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        commit = self._commit_of(repo, revision)
        entries = self._tree_entries(repo.trees[commit])
        prefix = f"{path.strip('/')}/" if path.strip("/") else ""
        if prefix and not any(str(e["path"]).startswith(prefix) for e in entries):
            raise _HubError(404, "EntryNotFound", f"{path} does not exist on {revision}", {"X-Repo-Commit": commit})
        listed = []
        for e in entries:
            name = str(e["path"])
            if name.startswith(prefix) and (recursive or "/" not in name[len(prefix) :]):
                listed.append(e)
        self._send_json(200, listed)

    def _paths_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        form = parse_qs(self._body().decode())
        repo = self._readable_repo(repo_type, repo_id)
        commit = self._commit_of(repo, revision)
        wanted = {p.strip("/") for p in form.get("paths", [])}
        self._send_json(200, [e for e in self._tree_entries(repo.trees[commit]) if e["path"] in wanted])

    def _resolve(self, repo_id: str, repo_type: str, revision: str, path: str, method: str) -> None:
        repo = self._readable_repo(repo_type, repo_id)
        commit = self._commit_of(repo, revision)
        tree = repo.trees[commit]
        if path not in tree:
            raise _HubError(404, "EntryNotFound", f"{path} does not exist on {revision}", {"X-Repo-Commit": commit})
        f = HubFile(path, tree[path])
        headers = {
            "Content-Type": "application/octet-stream",
            "X-Repo-Commit": commit,
            "ETag": f'"{f.etag}"',
            "Accept-Ranges": "bytes",
        }
        if f.lfs_sha256:
            headers.update({"X-Linked-Etag": f'"{f.lfs_sha256}"', "X-Linked-Size": str(f.size)})
        body, status = f.data, 200
        ranged = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "").strip())
        if method == "GET" and ranged and (ranged[1] or ranged[2]):  # one range, as http_get and HfFileSystem ask
            if ranged[1]:
                start, end = int(ranged[1]), min(int(ranged[2] or f.size - 1), f.size - 1)
            else:
                start, end = max(f.size - int(ranged[2]), 0), f.size - 1
            if start > end:
                self._send(416, b"", {"Content-Range": f"bytes */{f.size}", **headers})
                return
            body, status = f.data[start : end + 1], 206
            headers["Content-Range"] = f"bytes {start}-{end}/{f.size}"
        self._send(status, body, headers, head=method == "HEAD")

    # -- writes -------------------------------------------------------------------------------------------------------
    def _repo_url(self, repo_type: str, repo_id: str) -> str:
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        return f"{self.hub.url}/{prefix}{repo_id}"

    def _create_repo(self) -> None:
        payload = json.loads(self._body() or b"{}")
        self._require_write(payload.get("organization") or self.hub.user)
        repo_type = payload.get("type") or "model"
        repo_id = f"{payload['organization'] or self.hub.user}/{payload['name']}"
        url = self._repo_url(repo_type, repo_id)
        with self.hub._lock:
            if (repo_type, repo_id) in self.hub.repos:
                self._send_json(409, {"error": f"You already created this {repo_type} repo", "url": url})
                return
            private = payload.get("visibility", "public") == "private" or bool(payload.get("private"))
            commit = self.hub.add_repo(repo_id, {".gitattributes": _GITATTRIBUTES.encode()}, repo_type=repo_type)
            self.hub.repos[(repo_type, repo_id)].private = private
        self._send_json(200, {"url": url, "name": repo_id, "id": repo_id, "commit": commit})

    def _writable_repo(self, repo_type: str, repo_id: str) -> _Repo:
        self._require_write(repo_id.split("/")[0])
        repo = self.hub.repos.get((repo_type, repo_id))
        if repo is None:
            raise _HubError(404, "RepoNotFound", "Repository not found")
        return repo

    def _preupload(self, repo_type: str, repo_id: str, revision: str) -> None:
        payload = json.loads(self._body())
        repo = self._writable_repo(repo_type, repo_id)
        tree = repo.trees[self._commit_of(repo, revision)]
        files = []
        for item in payload.get("files", []):
            path, size = item["path"], int(item["size"])
            lfs = not self.hub.regular_uploads_only and size > 0 and is_lfs_path(path, size)
            oid = HubFile(path, tree[path]).etag if path in tree else None
            files.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        self._send_json(200, {"files": files, "commitOid": self._commit_of(repo, revision)})

    def _lfs_batch(self, repo_id: str, repo_type: str) -> None:
        payload = json.loads(self._body())
        self._writable_repo(repo_type, repo_id)
        objects = []
        for obj in payload.get("objects", []):
            oid, size = obj["oid"], int(obj["size"])
            entry: dict[str, object] = {"oid": oid, "size": size, "authenticated": True}
            if oid not in self.hub.lfs_objects:
                entry["actions"] = {
                    "upload": {"href": f"{self.hub.url}/lfs-upload/{oid}", "header": {}},
                    "verify": {"href": f"{self.hub.url}/lfs-verify/{oid}", "header": {}},
                }
            objects.append(entry)
        self._send(200, json.dumps({"transfer": "basic", "objects": objects}).encode(), LFS_JSON)

    def _lfs_transfer(self, action: str, oid: str) -> None:
        body = self._body()
        if action == "lfs-upload":  # the storage URL the batch answer handed out: no Hub token needed, as on S3
            if hashlib.sha256(body).hexdigest() != oid:
                raise _HubError(400, None, f"uploaded bytes do not match the sha256 {oid}")
            with self.hub._lock:
                self.hub.lfs_objects[oid] = body
            self._send(200, b"", {})
            return
        self._require_write()
        if oid not in self.hub.lfs_objects:
            raise _HubError(404, None, f"LFS object {oid} was never uploaded")
        self._send_json(200, {"success": True})

    def _commit(self, repo_type: str, repo_id: str, revision: str, create_pr: bool) -> None:
        lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
        with self.hub._lock:
            repo = self._writable_repo(repo_type, repo_id)
            parent = self._commit_of(repo, revision)
            tree = dict(repo.trees[parent])
            header: dict[str, Any] = {}
            added: dict[str, bytes] = {}
            deleted: list[str] = []
            for line in lines:
                key, value = line["key"], line["value"]
                if key == "header":
                    header = value
                    if value.get("parentCommit") not in (None, parent):
                        raise _HubError(412, None, f"parent commit {value['parentCommit']} is not the head {parent}")
                elif key == "file":
                    added[value["path"]] = base64.b64decode(value["content"])
                elif key == "lfsFile":
                    if value["oid"] not in self.hub.lfs_objects:
                        raise _HubError(422, None, f"LFS object {value['oid']} for {value['path']} was never uploaded")
                    added[value["path"]] = self.hub.lfs_objects[value["oid"]]
                elif key in ("deletedFile", "deletedFolder"):
                    path = value["path"].rstrip("/")
                    gone = [p for p in tree if p == path or (key == "deletedFolder" and p.startswith(path + "/"))]
                    if not gone:
                        raise _HubError(404, "EntryNotFound", f"A file with this name doesn't exist: {path}")
                    for p in gone:
                        del tree[p]
                    deleted.append(path)
                else:
                    raise _HubError(400, None, f"unknown commit operation {key!r}")
            tree.update(added)
            digest = hashlib.sha1(f"{parent}\n{header.get('summary', '')}\n".encode())
            for f in hub_files(dict(tree)):
                digest.update(f"{f.path}\0{f.etag}\n".encode())
            oid = digest.hexdigest()
            target = revision
            if create_pr:
                target = f"refs/pr/{1 + sum(ref.startswith('refs/pr/') for ref in repo.refs)}"
            repo.trees[oid] = tree
            repo.refs[target] = oid
            operations = [
                {**line, "value": {k: v for k, v in line["value"].items() if k != "content"}} for line in lines
            ]
            self.hub.commits.append(
                RecordedCommit(
                    repo_id,
                    repo_type,
                    target,
                    oid,
                    header.get("summary", ""),
                    header.get("description", ""),
                    operations,
                    added,
                    deleted,
                )
            )
        url = self._repo_url(repo_type, repo_id)
        pr_url = f"{url}/discussions/{target.rsplit('/', 1)[-1]}" if create_pr else None
        self._send_json(200, {"commitUrl": f"{url}/commit/{oid}", "commitOid": oid, "pullRequestUrl": pr_url})


LFS_JSON = {"Content-Type": "application/vnd.git-lfs+json"}


@contextlib.contextmanager
def running_hub_server(
    monkeypatch: pytest.MonkeyPatch | None = None, cache_dir: Path | None = None, **kwargs: Any
) -> Iterator[HubServer]:
    """A started ``HubServer``; with ``monkeypatch``, the client pointed at it for the test (``HubServer.use``) and,
    with ``cache_dir``, that folder the default Hub cache (``hub_fixtures.use_hub_cache``; ``server.cache_dir``)."""
    with HubServer(**kwargs) as server:
        if monkeypatch is not None:
            server.use(monkeypatch)
            if cache_dir is not None:
                server.cache_dir = use_hub_cache(monkeypatch, cache_dir)
        yield server
