"""The web UI's server (simpletuner.ui.app) through Starlette's test client, over real run folders made by a tiny
in-process training: the token on every route, CSRF on POSTs, path traversal refused, the JSON API, the event
stream of a run, the config check; and `simpletuner ui` started as a command and stopped with Ctrl-C."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest
from starlette.routing import Mount, Route
from starlette.testclient import TestClient
from training_helpers import tiny_config

from simpletuner.testing.demo_data import VALIDATION_PROMPT
from simpletuner.ui.app import cookie_name, create_app
from simpletuner.ui.jobs import JobQueue

TOKEN = "test-token-" + "x" * 20
STEPS = 2
RUN = "team/tiny"


@pytest.fixture(scope="module")
def root(tiny_sd, shapes_dir, tmp_path_factory):
    """A runs root holding one finished tiny run (``team/tiny``: 2 steps, a checkpoint each step, validation)."""
    from simpletuner.cli import main

    base = tmp_path_factory.mktemp("ui_server")
    raw = tiny_config(
        tiny_sd,
        shapes_dir,
        base,
        output_dir=str(base / "runs" / RUN),
        max_train_steps=STEPS,
        checkpointing_steps=1,
        validation_prompt=VALIDATION_PROMPT,
        validation_num_inference_steps=1,
    )
    config = base / "config.json"
    config.write_bytes(orjson.dumps(raw))
    assert main(["train", "--config", str(config)]) == 0
    return base / "runs"


@pytest.fixture(scope="module")
def app(root):
    queue = JobQueue(root.parent / "workdir", root)
    yield create_app(root, TOKEN, queue, poll_s=0.05)
    queue.shutdown()


@pytest.fixture()
def anonymous(app):
    return TestClient(app)


@pytest.fixture()
def client(app):
    """A client that opened the start URL: it holds the cookie."""
    client = TestClient(app)
    assert client.get(f"/?token={TOKEN}").status_code == 200
    return client


def csrf_of(client: TestClient) -> str:
    match = re.search(r'name="csrf-token" content="([^"]+)"', client.get("/new").text)
    assert match, "the page embeds the CSRF value"
    return match[1]


def every_route(app) -> list[tuple[str, str]]:
    """(method, url) for each route of the app, so a route added later is covered too."""
    found = []
    for route in app.routes:
        if isinstance(route, Mount):
            found.append(("GET", route.path + "/app.js"))
        elif isinstance(route, Route):
            url = route.path.replace("{run_id:path}", RUN)
            found += [(method, url) for method in sorted(route.methods or ["GET"]) if method != "HEAD"]
    return found


def test_every_route_needs_the_token(app, anonymous):
    routes = every_route(app)
    assert ("POST", "/api/launch") in routes and ("GET", "/api/events") in routes
    for method, url in routes:
        response = anonymous.request(method, url, headers={"X-CSRF-Token": "anything"})
        assert response.status_code == 401, (method, url)
        assert "token" in response.text
    assert anonymous.get("/", params={"token": "wrong"}).status_code == 401
    assert anonymous.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert TestClient(app, cookies={cookie_name(TOKEN): "wrong"}).get("/api/runs").status_code == 401


def test_the_start_url_sets_a_cookie_and_drops_the_token(anonymous):
    response = anonymous.get(f"/runs/{RUN}?token={TOKEN}&x=1", follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == f"/runs/{RUN}?x=1"
    cookie = response.headers["set-cookie"]
    assert cookie.startswith(f"{cookie_name(TOKEN)}={TOKEN};")
    assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower()
    assert anonymous.get("/api/runs").status_code == 200  # the client now sends the cookie
    page = anonymous.get("/")
    assert "DENY" == page.headers["x-frame-options"] and "default-src 'self'" in page.headers["content-security-policy"]


def test_a_bearer_token_works(anonymous):
    response = anonymous.get("/api/runs", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200 and RUN in [run["id"] for run in response.json()["runs"]]


def test_a_post_needs_the_csrf_header(client):
    assert client.post("/api/stop", json={"id": RUN}).status_code == 403
    assert client.post("/api/stop", json={"id": RUN}, headers={"X-CSRF-Token": "wrong"}).status_code == 403
    csrf = csrf_of(client)
    assert client.get("/api/csrf").json() == {"csrf": csrf}
    response = client.post("/api/stop", json={"id": RUN}, headers={"X-CSRF-Token": csrf})
    assert response.status_code == 200 and response.json() == {"stopped": False}  # finished: nothing to stop


def test_files_are_served_only_from_inside_the_run(client, root, tmp_path):
    grid = client.get("/file", params={"run": RUN, "path": f"validation/step_{STEPS:06d}_grid.png"})
    assert grid.status_code == 200 and grid.headers["content-type"] == "image/png"
    download = client.get("/file", params={"run": RUN, "path": "config.json", "download": "1"})
    assert download.status_code == 200 and "attachment" in download.headers["content-disposition"]
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the browser")
    (root / RUN / "link-out").symlink_to(secret)
    try:
        refused = {
            "../../../config.json": 400,
            "validation/../../tiny/config.json": 400,
            str(secret): 400,
            "/etc/passwd": 400,
            "link-out": 400,
            "no-such-file.png": 404,
            "validation": 404,  # a folder
        }
        for rel, status in refused.items():
            response = client.get("/file", params={"run": RUN, "path": rel})
            assert response.status_code == status, rel
            assert "not for the browser" not in response.text
        # encoded by hand: %2e%2e%2f is "../" once the query is decoded; %252e a literal "%2e" (no such file)
        for raw, status in (("%2e%2e%2f%2e%2e%2fconfig.json", 400), ("%252e%252e%252fconfig.json", 404)):
            assert client.get(f"/file?run={RUN}&path={raw}").status_code == status, raw
        for run in ("..", "team/..", "/etc", "team/../team/tiny/../.."):
            assert client.get("/file", params={"run": run, "path": "config.json"}).status_code == 404, run
    finally:
        (root / RUN / "link-out").unlink()


def test_runs_list_and_run_detail(client):
    runs = client.get("/api/runs").json()["runs"]
    tiny = next(run for run in runs if run["id"] == RUN)
    assert tiny["state"] == "finished" and tiny["step"] == STEPS and tiny["total"] == STEPS
    assert tiny["model_family"] == "sd" and tiny["last_loss"] is not None
    detail = client.get("/api/run", params={"id": RUN}).json()
    assert [c["step"] for c in detail["checkpoints"]] == [1, 2]
    assert [v["step"] for v in detail["validation"]][-1] == STEPS and detail["validation"][-1]["grid"]
    assert detail["config"]["max_train_steps"] == STEPS and detail["sources"]
    assert detail["weights"] and all(w["bytes"] > 0 for w in detail["weights"])
    assert client.get("/api/run", params={"id": "team/none"}).status_code == 404
    metrics = client.get("/api/metrics", params={"id": RUN}).json()["metrics"]
    assert [m["step"] for m in metrics if "loss" in m][-1] == STEPS
    for page in ("/", f"/runs/{RUN}", "/new", f"/compare?runs={RUN},{RUN}"):
        assert client.get(page).status_code == 200, page


def _events(response: httpx.Response):
    """(event, data) pairs of a server-sent event stream."""
    event = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: ") and event:
            yield event, orjson.loads(line[len("data: ") :])
            event = None


def test_the_event_stream_sends_the_metrics_then_what_is_appended(client, root):
    live = root / "live"
    shutil.copytree(root / RUN, live)
    existing = [orjson.loads(line) for line in (live / "metrics.jsonl").read_bytes().splitlines()]
    appended = {"step": 99, "loss": float("nan"), "lr": 0.5}

    def append() -> None:
        time.sleep(0.3)
        with open(live / "metrics.jsonl", "ab") as file:  # a line written in two parts, as a writer may
            file.write(b'{"step": 99, "loss": NaN,')
            file.flush()
            time.sleep(0.2)
            file.write(b' "lr": 0.5}\n')
        with open(live / "training.log", "a") as file:
            file.write("a new line of the log\n")

    writer = threading.Thread(target=append)
    try:
        metrics, logs, states = [], [], []
        with client.stream("GET", "/api/events", params={"id": "live"}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            writer.start()
            for event, data in _events(response):
                {"metric": metrics, "log": logs, "state": states}[event].append(data)
                if metrics and metrics[-1]["step"] == 99 and "a new line of the log" in logs:
                    break
        assert metrics[: len(existing)] == existing  # everything there first, in order
        assert metrics[len(existing) :] == [{**appended, "loss": None}]  # once, whole; NaN as null
        assert states and states[0]["id"] == "live" and states[0]["state"] == "finished"
        assert any("saved checkpoint" in line for line in logs)
    finally:
        writer.join()
        shutil.rmtree(live)
    assert client.get("/api/events", params={"id": "team/none"}).status_code == 404


def test_check_lists_every_problem_of_a_bad_config(client, root):
    csrf = {"X-CSRF-Token": csrf_of(client)}
    bad = {"model_family": "sd", "learning_rate": "fast", "train_batch_size": 0, "no_such_key": 1, "datasets": []}
    answer = client.post("/api/check", json={"text": orjson.dumps(bad).decode(), "filename": "bad.json"}, headers=csrf)
    assert answer.status_code == 200
    result = answer.json()
    assert result["ok"] is False and result["dialect"] == "native"
    problems = "\n".join(result["problems"])
    for field in ("learning_rate", "train_batch_size", "no_such_key", "pretrained_model_name_or_path"):
        assert field in problems, field
    launch = client.post("/api/launch", json={"text": orjson.dumps(bad).decode()}, headers=csrf)
    assert launch.status_code == 400 and launch.json()["problems"] == result["problems"]
    not_json = client.post("/api/check", json={"text": "{not json", "filename": "c.json"}, headers=csrf).json()
    assert not_json["ok"] is False and not_json["problems"]
    assert client.post("/api/check", json={"filename": "x.json"}, headers=csrf).status_code == 400


def test_launch_refuses_an_output_dir_outside_the_runs_folder(client, root):
    raw = orjson.loads((root / RUN / "config.json").read_bytes())
    raw["output_dir"] = str(root.parent / "elsewhere")
    answer = client.post(
        "/api/launch", json={"text": orjson.dumps(raw).decode()}, headers={"X-CSRF-Token": csrf_of(client)}
    )
    assert answer.status_code == 400 and "outside the runs folder" in answer.json()["problems"][0]
    assert client.get("/api/jobs").json() == {"jobs": []}


def test_the_command_prints_its_url_and_stops_on_ctrl_c(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    argv = [sys.executable, "-m", "simpletuner.cli", "ui", "--port", "0", "--runs", str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = None
        for line in proc.stdout:
            match = re.search(r"open (http://127\.0\.0\.1:\d+/\?token=\S+)", line)
            if match:
                url = match[1]
                break
        assert url, "the command prints the URL with its token"
        base = url.split("?")[0]
        assert httpx.get(base + "api/runs").status_code == 401
        with httpx.Client() as browser:
            page = browser.get(url, follow_redirects=True)
            assert page.status_code == 200 and "Runs" in page.text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (tmp_path / ".simpletuner-ui" / "jobs").is_dir()


def test_new_run_offers_examples_and_merges_a_preset_where_the_config_wins(client):
    headers = {"X-CSRF-Token": csrf_of(client)}
    offer = client.get("/api/presets").json()
    assert "gh200" in {p["name"] for p in offer["presets"]} and "flux_lora.json" in offer["examples"]
    example = client.get("/api/example", params={"name": "flux_lora.json"}).json()
    assert orjson.loads(example["text"])["model_family"] == "flux" and example["filename"] == "flux_lora.json"
    assert client.get("/api/example", params={"name": "../presets/gh200.json"}).status_code == 404
    text = orjson.dumps({"model_family": "sd", "train_batch_size": 2}).decode()
    answer = client.post(
        "/api/preset", json={"text": text, "filename": "mine.json", "preset": "gh200"}, headers=headers
    )
    assert answer.status_code == 200, answer.text
    merged = orjson.loads(answer.json()["text"])
    assert merged["train_batch_size"] == 2  # the config's own value wins
    assert merged["mixed_precision"] == "bf16" and merged["cache_config"]["vae_cache_type"] == "unified_memory"
    assert answer.json()["filename"] == "mine-gh200.json" and answer.json()["lines"][0].startswith("preset gh200")
    flux = orjson.dumps({"model_family": "flux"}).decode()
    refused = client.post("/api/preset", json={"text": flux, "preset": "gh200"}, headers=headers)
    assert refused.status_code == 400 and "was made for" in refused.json()["error"]
