"""`simpletuner ui`: the web UI (simpletuner.ui.app) over the run folders under --runs, served by uvicorn.

Prints the URL with this server's token and serves until Ctrl-C, which stops the server and the launch queue's
scheduler; runs it launched keep running (each in its own session). :class:`ServerThread` serves an app on a
thread (tests, scripts/ui_screenshots.py). See documentation/UI.md.
"""

from __future__ import annotations

import argparse
import secrets
import signal
import socket
import sys
import threading
from pathlib import Path

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``simpletuner ui``'s options."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: only this machine; use SSH -L)"
    )
    parser.add_argument("--port", type=int, default=7860, help="port (default 7860; 0 = any free port)")
    parser.add_argument("--runs", default=".", help="folder whose run folders the UI lists (default: this folder)")
    parser.add_argument(
        "--workdir",
        default=None,
        help="the UI's own files: configs, the demo, job logs (default <runs>/.simpletuner-ui)",
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one), so the printed URL has the real port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    return sock


def url(sock: socket.socket, token: str | None = None) -> str:
    """``http://host:port/`` of a bound socket (with ``?token=`` when given)."""
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/" + (f"?token={token}" if token else "")


def make_server(app):
    """A uvicorn server of ``app`` (run it with ``sockets=[bind(...)]``): quiet; open event streams end 2 s
    after a Ctrl-C."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, lifespan="off")
    return uvicorn.Server(config)


class ServerThread:
    """``app`` served on ``host`` (a free port) from a daemon thread: ``with ServerThread(app) as server:``
    ``server.url``. Leaving the block stops the server."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.sock = bind(host, port)
        self.url = url(self.sock)
        self.server = make_server(app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread ended before it started serving")
            self.thread.join(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def run(args: argparse.Namespace) -> int:
    """``simpletuner ui``: serve until Ctrl-C; returns the exit code."""
    from simpletuner.ui.app import create_app
    from simpletuner.ui.jobs import JobQueue

    runs_root = Path(args.runs).resolve()
    if not runs_root.is_dir():
        print(f"simpletuner ui: --runs {runs_root} is not a folder", file=sys.stderr)
        return 2
    workdir = Path(args.workdir).resolve() if args.workdir else runs_root / ".simpletuner-ui"
    if args.host not in LOOPBACK:
        print(
            f"simpletuner ui: WARNING: listening on {args.host}, not only this machine: the token is the only guard "
            "and the traffic is not encrypted. Prefer the default 127.0.0.1 and `ssh -L 7860:127.0.0.1:7860 host`.",
            file=sys.stderr,
        )
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        print(f"simpletuner ui: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    token = secrets.token_urlsafe(24)
    queue = JobQueue(workdir, runs_root)
    server = make_server(create_app(runs_root, token, queue))
    print(f"simpletuner ui: runs under {runs_root}; its own files in {workdir}")
    print(f"simpletuner ui: open {url(sock, token)}", flush=True)
    # uvicorn re-raises the Ctrl-C it handled once the server is down: as KeyboardInterrupt, not as a death
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        queue.shutdown()
        sock.close()
    print("simpletuner ui: stopped (runs it started keep running)")
    return 0
