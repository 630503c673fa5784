"""The web UI's Starlette app: pages, a JSON API, server-sent events of a run, and the token that guards them.

``create_app(runs_root, token, queue)`` serves the run folders under ``runs_root`` (read through
:mod:`simpletuner.ui.runs`) and launches, stops and resumes runs through ``queue`` (a
:class:`~simpletuner.ui.jobs.JobQueue`).
Every request needs the token: ``?token=`` once (it sets an HttpOnly SameSite=Strict cookie and redirects to the
same URL without it), then the cookie, or ``Authorization: Bearer <token>``; 401 otherwise. A POST also needs the
header ``X-CSRF-Token`` with this server's CSRF value (embedded in every page, and at ``GET /api/csrf``); 403
otherwise. Files are served only through :func:`simpletuner.ui.runs.resolve_file`. The security model is told in
documentation/UI.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import orjson
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection, Request
from starlette.responses import FileResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from simpletuner.resources import examples_dir
from simpletuner.ui import runs
from simpletuner.ui.jobs import Checked, JobQueue

HERE = Path(__file__).parent
#: How often the event stream looks at the size of a run's metrics.jsonl and training.log.
POLL_S = 0.5
#: How often (in polls) the event stream recomputes the run's summary for a ``state`` event.
STATE_EVERY = 4
#: On connecting, the event stream sends at most this much of the end of training.log (all of metrics.jsonl).
LOG_TAIL_BYTES = 64 * 1024
SECURITY_HEADERS = {
    # pages run only this server's own scripts (no inline script), and are never framed (a Stop button
    # under someone else's page); uPlot sets style attributes from script, which style-src governs
    "content-security-policy": "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
    "frame-ancestors 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


class JSONResponse(Response):
    """JSON through orjson: NaN and infinities (a diverged loss) become null (Starlette's refuses them), paths
    become strings."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, default=str)


def cookie_name(token: str) -> str:
    """The cookie holding ``token``: named after it, so two servers on one host (other ports) keep their own."""
    return "simpletuner_ui_" + hashlib.sha256(token.encode()).hexdigest()[:12]


class TokenGuard:
    """ASGI middleware: every request carries the token (cookie or Bearer), every POST the CSRF header.

    A GET with ``?token=<token>`` sets the cookie and redirects to the URL without it, so the token does
    not stay in the address bar or the history.
    """

    def __init__(self, app: ASGIApp, token: str, csrf: str) -> None:
        self.app, self.token, self.csrf = app, token, csrf
        self.cookie = cookie_name(token)

    def _matches(self, value: str | None, expected: str) -> bool:
        return value is not None and secrets.compare_digest(value.encode(), expected.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        conn = HTTPConnection(scope)
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD"):
            if self._matches(conn.query_params.get("token"), self.token):
                rest = urlencode([(k, v) for k, v in conn.query_params.multi_items() if k != "token"])
                response: Response = RedirectResponse(conn.url.path + (f"?{rest}" if rest else ""), status_code=303)
                response.set_cookie(self.cookie, self.token, httponly=True, samesite="strict", path="/")
                await response(scope, receive, send)
                return
        authorization = conn.headers.get("authorization", "")
        bearer = authorization[7:] if authorization.lower().startswith("bearer ") else None
        if not (self._matches(conn.cookies.get(self.cookie), self.token) or self._matches(bearer, self.token)):
            response = PlainTextResponse(
                "401: this server needs its token: open the URL `simpletuner ui` printed (…/?token=…), "
                "or send 'Authorization: Bearer <token>'.\n",
                status_code=401,
                headers={"www-authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            if not self._matches(conn.headers.get("x-csrf-token"), self.csrf):
                response = PlainTextResponse("403: a POST needs the X-CSRF-Token header of this server\n", 403)
                await response(scope, receive, send)
                return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                headers += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items() if k.encode() not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _sse(event: str, data: Any) -> bytes:
    """One server-sent event; ``data`` as JSON on one line."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data, default=str) + b"\n\n"


def _parse_metric(line: str) -> dict | None:
    """A metrics.jsonl line as a dict, or None for a line that is no record. Python's json reads the NaN a
    diverged loss may be written as (orjson does not); orjson writes it back as null."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


class _Tail:
    """A file followed by byte offset: the complete lines appended since the last look (:func:`runs.read_new`),
    read only when its size changed. ``from_end``: start that many bytes before the end (the first, cut line
    left out)."""

    def __init__(self, path: Path, from_end: int | None = None) -> None:
        self.path = path
        size = self.size()
        self.offset = 0 if from_end is None else max(0, size - from_end)
        self.cut = self.offset > 0

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    async def new_lines(self) -> list[str]:
        size = self.size()
        if size == self.offset:
            return []
        lines, self.offset = await run_in_threadpool(runs.read_new, self.path, self.offset if size > self.offset else 0)
        if self.cut and lines:
            lines, self.cut = lines[1:], False
        return lines


async def run_events(root: Path, run_id: str, poll_s: float = POLL_S) -> AsyncIterator[bytes]:
    """The event stream of one run: ``metric`` (a metrics.jsonl record), ``log`` (a training.log line), ``state``
    (the run's summary, when it changes). Starts with all of metrics.jsonl and the end of training.log, then
    follows both by their byte offsets, looking at their sizes every ``poll_s`` seconds. Runs until the client
    leaves (Starlette cancels it)."""
    folder = (await run_in_threadpool(runs.run_summary, root, run_id)).path
    metrics, log = _Tail(folder / "metrics.jsonl"), _Tail(folder / "training.log", from_end=LOG_TAIL_BYTES)
    last_state: dict | None = None
    yield b"retry: 2000\n\n"
    for tick in itertools.count():
        records = [_parse_metric(line) for line in await metrics.new_lines()]
        chunks = [_sse("metric", record) for record in records if record is not None]
        chunks += [_sse("log", line) for line in await log.new_lines() if line.strip()]
        if tick % STATE_EVERY == 0:
            try:
                state = (await run_in_threadpool(runs.run_summary, root, run_id)).to_json()
            except runs.UnknownRun:  # the folder went away
                state = {**(last_state or {}), "state": "gone"}
            if state != last_state:
                last_state = state
                chunks.append(_sse("state", state))
        if chunks:
            yield b"".join(chunks)
        await asyncio.sleep(poll_s)


def _json_body(data: bytes, *keys: str) -> dict:
    """A POST's JSON object, with ``keys`` present as strings (400 otherwise)."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict) or not all(isinstance(body.get(key), str) for key in keys):
        raise HTTPException(400, "the body must be a JSON object with " + ", ".join(repr(k) for k in keys))
    return body


class _UI:
    """The endpoints, over one runs root and one queue."""

    def __init__(self, runs_root: Path, queue: JobQueue, csrf: str, poll_s: float) -> None:
        self.runs_root, self.queue, self.csrf, self.poll_s = runs_root, queue, csrf, poll_s
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))

    # --- pages ----------------------------------------------------------------------------------------
    def page(self, request: Request, name: str, title: str, **context: Any) -> Response:
        context = {"csrf": self.csrf, "title": title, "runs_root": str(self.runs_root), **context}
        return self.templates.TemplateResponse(request, name, context)

    async def runs_page(self, request: Request) -> Response:
        return self.page(request, "runs.html", "Runs")

    async def run_page(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        return self.page(request, "run.html", run_id, run_id=run_id)

    async def new_page(self, request: Request) -> Response:
        return self.page(request, "new.html", "New run")

    async def compare_page(self, request: Request) -> Response:
        return self.page(request, "compare.html", "Compare")

    # --- reading runs ---------------------------------------------------------------------------------
    def run_path(self, run_id: str) -> Path:
        try:
            return runs.run_summary(self.runs_root, run_id).path
        except runs.UnknownRun:
            raise HTTPException(404, f"no run {run_id!r} under {self.runs_root}") from None

    @staticmethod
    def query(request: Request, name: str) -> str:
        value = request.query_params.get(name)
        if not value:
            raise HTTPException(400, f"missing query parameter {name!r}")
        return value

    async def api_runs(self, request: Request) -> Response:
        found = await run_in_threadpool(runs.find_runs, self.runs_root)
        return JSONResponse({"root": self.runs_root, "runs": [r.to_json() for r in found]})

    async def api_run(self, request: Request) -> Response:
        run_id = self.query(request, "id")
        try:
            return JSONResponse(await run_in_threadpool(runs.run_detail, self.runs_root, run_id))
        except runs.UnknownRun:
            raise HTTPException(404, f"no run {run_id!r} under {self.runs_root}") from None

    async def api_metrics(self, request: Request) -> Response:
        path = self.run_path(self.query(request, "id"))
        return JSONResponse({"metrics": await run_in_threadpool(runs.metrics, path)})

    async def api_events(self, request: Request) -> Response:
        run_id = self.query(request, "id")
        self.run_path(run_id)  # a 404 before the stream starts
        return StreamingResponse(
            run_events(self.runs_root, run_id, self.poll_s),
            media_type="text/event-stream",
            headers={"cache-control": "no-store", "x-accel-buffering": "no"},
        )

    async def file(self, request: Request) -> Response:
        """A file of a run, through :func:`runs.resolve_file` only; ``download=1`` as an attachment."""
        run_id, rel = self.query(request, "run"), self.query(request, "path")
        try:
            path = runs.resolve_file(self.runs_root, run_id, rel)
        except runs.FileOutsideRun:
            raise HTTPException(400, "refused: that path leaves the run folder") from None
        except (runs.UnknownRun, FileNotFoundError):
            raise HTTPException(404, "no such file in that run") from None
        download = request.query_params.get("download") == "1"
        return FileResponse(path, filename=path.name if download else None)

    # --- the queue ------------------------------------------------------------------------------------
    async def api_jobs(self, request: Request) -> Response:
        return JSONResponse({"jobs": [job.to_json() for job in self.queue.jobs()]})

    async def api_job_log(self, request: Request) -> Response:
        """The end of a job's own log (the launcher's output): why a run failed before its folder had a log."""
        job_id = self.query(request, "id")
        job = next((job for job in self.queue.jobs() if job.id == job_id), None)
        if job is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return PlainTextResponse("\n".join(runs.tail_lines(job.log_path, LOG_TAIL_BYTES)))

    async def api_csrf(self, request: Request) -> Response:
        return JSONResponse({"csrf": self.csrf})

    def checked_json(self, checked: Checked) -> dict:
        """The check's answer, with the id the run will have under the runs root (None when outside it)."""
        result = checked.to_json()
        result["run_id"] = None
        if checked.output_dir is not None:
            out = Path(checked.output_dir).resolve()
            if out.is_relative_to(self.runs_root):
                result["run_id"] = out.relative_to(self.runs_root).as_posix()
        return result

    async def check(self, request: Request, estimate: bool) -> tuple[Checked, dict]:
        body = _json_body(await request.body(), "text")
        filename = Path(str(body.get("filename") or "config.json")).name
        checked = await run_in_threadpool(self.queue.check, body["text"], filename, estimate)
        return checked, self.checked_json(checked)

    async def api_check(self, request: Request) -> Response:
        """Every problem the loader finds in the posted config, its notes and (when it loads) the estimate."""
        return JSONResponse((await self.check(request, estimate=True))[1])

    async def api_demo(self, request: Request) -> Response:
        path = await run_in_threadpool(self.queue.write_demo)
        return JSONResponse({"config_path": path, "filename": path.name, "text": path.read_text()})

    async def api_presets(self, request: Request) -> Response:
        """The hardware presets (config/presets/) and the example configs (config/examples/) the New run page offers."""
        from simpletuner.memory.presets import load_presets

        presets = [
            {"name": p.name, "hardware": p.hardware, "workload": p.workload, "model_family": p.model_family}
            for p in await run_in_threadpool(load_presets)
        ]
        return JSONResponse({"presets": presets, "examples": sorted(p.name for p in examples_dir().glob("*.json"))})

    async def api_example(self, request: Request) -> Response:
        """One example config's text, by its file name (only the names /api/presets lists)."""
        name = request.query_params.get("name", "")
        examples = {p.name: p for p in examples_dir().glob("*.json")}
        if name not in examples:
            raise HTTPException(404, f"no example config named {name!r}")
        return JSONResponse({"filename": name, "text": examples[name].read_text(encoding="utf-8")})

    async def api_preset(self, request: Request) -> Response:
        """The posted config with a preset merged in (the config's own settings win), and what each became."""
        body = _json_body(await request.body(), "text")
        filename = Path(str(body.get("filename") or "config.json")).name
        try:
            text, name, lines = await run_in_threadpool(
                self.queue.with_preset, body["text"], filename, str(body.get("preset", ""))
            )
        except ValueError as error:  # ConfigError is a ValueError
            raise HTTPException(400, str(error)) from None
        return JSONResponse({"text": text, "filename": name, "lines": lines})

    async def api_launch(self, request: Request) -> Response:
        """Check the posted config (no estimate) and queue it; 400 with the problems when it does not load or
        its output_dir is outside the runs root (the UI could not show the run)."""
        checked, result = await self.check(request, estimate=False)
        if checked.ok and result["run_id"] is None:
            result["ok"] = False
            result["problems"] = [
                f"output_dir {checked.output_dir} is outside the runs folder {self.runs_root}: this page could "
                "not show the run; set output_dir under it (or start `simpletuner ui --runs` higher up)"
            ]
        if not result["ok"] or checked.config_path is None:
            return JSONResponse(result, status_code=400)
        try:
            job = await run_in_threadpool(self.queue.submit, checked.config_path)
        except ValueError as error:  # a ConfigError the launch finds and the check did not
            return JSONResponse({**result, "ok": False, "problems": [str(error)]}, status_code=400)
        return JSONResponse({**result, "job": job.to_json()})

    async def api_stop(self, request: Request) -> Response:
        """SIGTERM to the run (it saves a checkpoint and exits 143); ``stopped`` is False when nothing ran."""
        path = self.run_path(_json_body(await request.body(), "id")["id"])
        return JSONResponse({"stopped": await run_in_threadpool(self.queue.stop, path)})

    async def api_resume(self, request: Request) -> Response:
        """Queue the run again from its latest checkpoint, with the config as it ran."""
        path = self.run_path(_json_body(await request.body(), "id")["id"])
        try:
            job = await run_in_threadpool(self.queue.resume, path)
        except (ValueError, FileNotFoundError) as error:  # ConfigError is a ValueError
            raise HTTPException(400, f"cannot resume: {error}") from None
        return JSONResponse({"job": job.to_json()})


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code)
    return PlainTextResponse(f"{exc.status_code}: {exc.detail}\n", status_code=exc.status_code)


def create_app(runs_root: Path, token: str, queue: JobQueue, poll_s: float = POLL_S) -> Starlette:
    """The web UI over the run folders under ``runs_root``, launching through ``queue``, guarded by ``token``;
    ``poll_s``: how often an event stream looks for new lines."""
    ui = _UI(Path(runs_root).resolve(), queue, secrets.token_urlsafe(24), poll_s)
    post = ["POST"]
    routes = [
        Route("/", ui.runs_page),
        Route("/runs/{run_id:path}", ui.run_page),
        Route("/new", ui.new_page),
        Route("/compare", ui.compare_page),
        Route("/file", ui.file),
        Route("/api/runs", ui.api_runs),
        Route("/api/run", ui.api_run),
        Route("/api/metrics", ui.api_metrics),
        Route("/api/events", ui.api_events),
        Route("/api/jobs", ui.api_jobs),
        Route("/api/job_log", ui.api_job_log),
        Route("/api/csrf", ui.api_csrf),
        Route("/api/check", ui.api_check, methods=post),
        Route("/api/demo", ui.api_demo, methods=post),
        Route("/api/launch", ui.api_launch, methods=post),
        Route("/api/presets", ui.api_presets),
        Route("/api/example", ui.api_example),
        Route("/api/preset", ui.api_preset, methods=post),
        Route("/api/stop", ui.api_stop, methods=post),
        Route("/api/resume", ui.api_resume, methods=post),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.add_middleware(TokenGuard, token=token, csrf=ui.csrf)
    return app
