"""The progress widget in a real browser: JupyterLab + Debian's chromium driven by Playwright.

JupyterLab runs on a free localhost port with a token, in a temporary directory with its own
config/settings/workspace dirs (nothing of the user's is read or written). Chromium opens a
notebook whose `%%distributed -n 2` cell trains and reports; the test watches the widget render
while the cell runs, reach its end (bar full, done, rank 0's last loss, both ranks done), saves
the notebook with its widget state, and checks that a reloaded page shows the final state from
that saved state with the kernel gone. Screenshots go to test-output/ (gitignored).
It skips, saying why, where /usr/bin/chromium or Playwright is missing.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import nbformat
import pytest

from nbharness import ROOT, notebook

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update"]
OUTPUT_DIR = ROOT / "test-output"

pytestmark = [
    pytest.mark.timeout(480),
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is not installed "
                       "(apt-get install chromium chromium-driver)"),
]
playwright_sync = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

TRAIN = """\
%%distributed -n 2
import time
import nbdist
from nbdist.rank.report import detect_rank
rank = detect_rank()
for step in range(1, 81):
    time.sleep(0.05 if rank == 0 else 0.06)
    nbdist.report(step=step, total=80, loss=1.0 / step, acc=step / 80)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(base: str, token: str, path: str, method: str = "GET"):
    req = urllib.request.Request(f"{base}{path}", method=method,
                                 headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        body = resp.read()
    return json.loads(body) if body else None


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on a free port, isolated in tmp_path; stopped with its kernels after."""
    root = tmp_path / "nb"
    root.mkdir()
    nb = notebook("%load_ext nbdist", TRAIN, "%dist_stop")
    nbformat.write(nb, root / "progress.ipynb")
    settings = tmp_path / "settings"
    # Save widget state with the notebook (JupyterLab's "Save Widget State Automatically").
    plugin = settings / "@jupyter-widgets" / "jupyterlab-manager" / "plugin.jupyterlab-settings"
    plugin.parent.mkdir(parents=True)
    plugin.write_text(json.dumps({"saveState": True}))
    news = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ,
               JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("NBDIST_WIDGETS", None)
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--ServerApp.port_retries=0", "--LabApp.news_url=", "--LabApp.check_for_updates_class="
         "jupyterlab.NeverCheckForUpdate", *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                api(base, token, "/api/status")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail("JupyterLab did not start:\n" + (tmp_path / "jupyterlab.log").read_text()[-4000:])
                time.sleep(0.5)
        yield {"base": base, "token": token, "root": root, "log": tmp_path / "jupyterlab.log"}
    finally:
        try:  # shut the kernels down first: their engines stop with them
            for kernel in api(base, token, "/api/kernels") or []:
                api(base, token, f"/api/kernels/{kernel['id']}", method="DELETE")
        except OSError:
            pass
        stop_group(proc)
        log.close()


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL it if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue


def accept_kernel(page) -> None:
    """Click "Select" if JupyterLab asks which kernel to start (it does for a fresh file)."""
    try:
        page.locator(".jp-Dialog .jp-mod-accept").click(timeout=15_000)
    except playwright_sync.TimeoutError:
        pass  # no dialog: the notebook's kernelspec was started directly


def run_all(page) -> None:
    """Run > Run All Cells, from JupyterLab's menu bar."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()


def test_progress_widget_renders_and_reaches_its_end_in_jupyterlab(lab, tmp_path):
    OUTPUT_DIR.mkdir(exist_ok=True)
    with playwright_sync.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(60_000)
            try:
                check_in_browser(page, lab, tmp_path)
            except Exception:
                page.screenshot(path=str(OUTPUT_DIR / "progress-browser-failure.png"), full_page=True)
                raise
        finally:
            browser.close()


def check_in_browser(page, lab, tmp_path) -> None:
    if True:
        if True:
            page.goto(f"{lab['base']}/lab/tree/progress.ipynb?token={lab['token']}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            accept_kernel(page)
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                                   timeout=120_000)
            run_all(page)

            widget = page.locator(".nbdist-progress").first
            # While the cell runs: the widget is drawn, moving, with a live rank row.
            page.wait_for_selector('.nbdist-progress .nbdist-state[data-state="running"]',
                                   timeout=90_000)
            page.wait_for_function(
                """() => { const s = document.querySelector('.nbdist-progress .nbdist-steps');
                           return s && /^([1-9]\\d*)\\/80/.test(s.textContent); }""", timeout=60_000)
            widget.screenshot(path=str(OUTPUT_DIR / "progress-browser-running.png"))
            running_rows = page.locator(".nbdist-progress .nbdist-rank").count()
            assert running_rows == 2

            # The end: done, bar full, rank 0's last values, both ranks done.
            page.wait_for_selector('.nbdist-progress .nbdist-state[data-state="done"]', timeout=120_000)
            assert widget.locator(".nbdist-steps").inner_text() == "80/80 (100%)"
            value_of = {m: widget.locator(f'.nbdist-metric[data-metric="{m}"] .nbdist-value').inner_text()
                        for m in ("loss", "acc")}
            assert value_of == {"loss": "0.0125", "acc": "1"}
            assert widget.locator("svg.nbdist-spark polyline").count() == 2
            assert [widget.locator(".nbdist-rank").nth(i).get_attribute("data-state")
                    for i in range(2)] == ["done", "done"]
            # ipywidgets draws the bar as div.progress-bar with its width in percent
            bar = widget.locator(".nbdist-bar .progress-bar")
            assert bar.evaluate("b => b.style.width") == "100%"
            assert "progress-bar-success" in bar.get_attribute("class")
            widget.screenshot(path=str(OUTPUT_DIR / "progress-browser-done.png"))
            page.screenshot(path=str(OUTPUT_DIR / "progress-browser-page.png"), full_page=True)
            shutil.copy(OUTPUT_DIR / "progress-browser-done.png", tmp_path / "progress-browser-done.png")

            # Wait for %dist_stop, save, and check the widget state went into the file.
            page.wait_for_function(
                """() => [...document.querySelectorAll('.jp-OutputArea-output')]
                         .some(e => e.textContent.includes('stopped the cluster'))""", timeout=120_000)
            page.keyboard.press("Control+s")
            saved = None
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                saved = nbformat.read(lab["root"] / "progress.ipynb", as_version=4)
                if saved.metadata.get("widgets"):
                    break
                time.sleep(0.5)
            states = saved.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
            bars = [m["state"] for m in states.values() if m["model_name"] == "IntProgressModel"]
            assert bars and bars[-1]["value"] == bars[-1]["max"] == 80
            assert bars[-1]["bar_style"] == "success"

            # Re-open with no kernel behind it: the saved state alone draws the final widget.
            for kernel in api(lab["base"], lab["token"], "/api/kernels") or []:
                api(lab["base"], lab["token"], f"/api/kernels/{kernel['id']}", method="DELETE")
            page.reload()
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            accept_kernel(page)
            page.wait_for_selector('.nbdist-progress .nbdist-state[data-state="done"]', timeout=60_000)
            page.locator(".nbdist-progress").first.screenshot(
                path=str(OUTPUT_DIR / "progress-browser-reopened.png"))
