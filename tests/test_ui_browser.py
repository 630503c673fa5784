"""The web UI end to end in a real headless Chromium (the distribution's package, driven by Playwright): the demo
started from /new trains on the tiny model while the run page shows its steps, loss curve and validation grid; Stop
leaves a checkpoint, Resume runs it to the end; a wrong config shows its problems inline; a request without the
token is refused. Screenshots of the run page and the compare page go to a tmp folder, or to the folder named by
SIMPLETUNER_UI_SCREENSHOTS (`SIMPLETUNER_UI_SCREENSHOTS=documentation/images pytest tests/test_ui_browser.py`
refreshes documentation/UI.md's pictures)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import orjson
import pytest

from simpletuner.testing.demo_data import write_demo
from simpletuner.ui.app import create_app
from simpletuner.ui.jobs import JobQueue

CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and os.path.exists(p)), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (Debian: apt-get install chromium)")
TOKEN = "browser-test-token-" + "y" * 12
#: Milliseconds a page waits for the trainer (a subprocess starting torch on a busy 2-core box).
SLOW = 180_000
# Pages are opened with bypass_csp: the page's Content-Security-Policy forbids eval, which Playwright's
# wait_for_function uses; tests/test_ui_server.py checks the header.


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """The real server on a free 127.0.0.1 port over an empty runs folder, with its queue; and a second, finished
    run (``baseline``) trained in-process on the demo's data with another learning rate, for Compare."""
    from simpletuner.cli import main
    from simpletuner.cli.ui import ServerThread

    base = tmp_path_factory.mktemp("ui_browser")
    runs_root = base / "runs"
    config = write_demo(base / "baseline_demo", max_train_steps=10)
    raw = orjson.loads(config.read_bytes())
    raw.update(output_dir=str(runs_root / "baseline"), learning_rate=1e-3, logging_steps=1, validation_steps=5)
    raw.update(checkpointing_steps=5, validation_num_inference_steps=2)
    config.write_bytes(orjson.dumps(raw))
    assert main(["train", "--config", str(config)]) == 0
    queue = JobQueue(base / "workdir", runs_root, processes=1)
    with ServerThread(create_app(runs_root, TOKEN, queue, poll_s=0.2)) as server:
        yield server.url, runs_root
    for job in queue.jobs():  # nothing left running after the test
        if job.state == "running":
            queue.stop(job.output_dir)
    queue.shutdown()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = os.environ.get("SIMPLETUNER_UI_SCREENSHOTS")
    return Path(folder) if folder else tmp_path_factory.mktemp("ui_screenshots")


def number(page, selector: str) -> float:
    return float(page.text_content(selector) or "nan")


def test_a_request_without_the_token_is_refused(ui, browser):
    url, _ = ui
    page = browser.new_page(bypass_csp=True)
    assert page.goto(url).status == 401
    assert page.goto(url + "runs/demo").status == 401
    assert page.goto(url + "?token=wrong").status == 401
    assert page.goto(url + f"?token={TOKEN}").status == 200  # then the cookie
    assert page.goto(url + "new").status == 200
    page.close()


def test_a_wrong_config_shows_its_problems_inline(ui, browser):
    url, _ = ui
    page = browser.new_page(bypass_csp=True)
    page.goto(url + f"new?token={TOKEN}")
    bad = {"model_family": "sd", "learning_rate": "fast", "no_such_key": 1, "datasets": []}
    page.fill("#config", orjson.dumps(bad, option=orjson.OPT_INDENT_2).decode())
    page.click("#check")
    page.wait_for_selector("ul.problems li")
    problems = page.locator("ul.problems li").all_text_contents()
    assert len(problems) >= 3
    joined = "\n".join(problems)
    assert "learning_rate" in joined and "no_such_key" in joined
    page.click("#launch")  # refused the same way, nothing queued
    page.wait_for_selector("p.bad")
    assert page.url.endswith("/new")
    # an example fills the editor; a preset merges into it, the config's own values kept
    page.wait_for_selector('#example option[value="sd15_lora.json"]', state="attached")
    page.select_option("#example", "sd15_lora.json")
    page.wait_for_function("document.querySelector('#filename').value === 'sd15_lora.json'")
    own = orjson.loads(page.input_value("#config"))
    page.select_option("#preset", "gh200")
    page.wait_for_function("document.querySelector('#filename').value === 'sd15_lora-gh200.json'")
    merged = orjson.loads(page.input_value("#config"))
    assert merged["train_batch_size"] == own["train_batch_size"] and merged["mixed_precision"] == "bf16"
    page.close()


def test_the_demo_from_the_page_trains_stops_resumes_and_finishes(ui, browser, shots):
    url, runs_root = ui
    page = browser.new_page(viewport={"width": 1280, "height": 1000}, bypass_csp=True)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(url + f"new?token={TOKEN}")
    page.click("#demo")
    page.wait_for_function("document.getElementById('config').value.includes('output_dir')")
    page.click("#launch")
    page.wait_for_url("**/runs/demo", timeout=30_000)

    # live: the step counter advances, the loss chart gets points, the first validation grid appears
    page.wait_for_function("Number(document.getElementById('step').textContent) >= 2", timeout=SLOW)
    page.wait_for_function(
        "(document.querySelector('.chart[data-metric=loss]') || {dataset: {}}).dataset.points >= 2", timeout=SLOW
    )
    page.wait_for_function(
        "[...document.querySelectorAll('#validation img')].some((img) => img.complete && img.naturalWidth > 0)",
        timeout=SLOW,
    )
    page.wait_for_selector("#stop:not([disabled])", timeout=SLOW)
    page.click("#stop")
    page.wait_for_selector("#state.state-stopped", timeout=SLOW)
    stopped_at = number(page, "#step")
    page.wait_for_selector("details.checkpoint", timeout=30_000)
    assert stopped_at < 30, "the stop came before the end"
    checkpoints = page.locator("details.checkpoint summary").all_text_contents()
    assert any(f"step {int(stopped_at)}" in text for text in checkpoints), (checkpoints, stopped_at)

    page.wait_for_selector("#resume:not([disabled])")
    page.click("#resume")
    page.wait_for_selector("#state.state-finished", timeout=SLOW)
    page.wait_for_function("document.getElementById('step').textContent === '30'")
    page.wait_for_selector("#checkpoints h3")  # the final weights listed
    assert (runs_root / "demo" / "pytorch_lora_weights.safetensors").is_file()
    page.wait_for_timeout(500)  # the last chart frame
    page.screenshot(path=str(shots / "ui_run.png"), full_page=True)

    page.goto(url + "compare?runs=demo,baseline")
    page.wait_for_selector(".chart[data-metric=loss]")
    page.wait_for_function("document.querySelectorAll('.compare-cell img').length >= 1")
    series = page.evaluate("document.querySelectorAll('.chart[data-metric=loss] .u-legend .u-series').length")
    assert series == 3  # the step and the two runs
    page.screenshot(path=str(shots / "ui_compare.png"), full_page=True)

    page.goto(url)
    page.wait_for_selector("tr[data-run='demo']")
    assert "finished" in (page.text_content("tr[data-run='demo']") or "")
    assert not errors, errors
    page.close()
