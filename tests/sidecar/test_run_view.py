"""The live run view (/runs) of a `tinkerrpc serve --sidecar-port` with a sidecar API key, in a real
headless Chromium (Debian's `chromium`, installed by scripts/setup.sh) driven over the DevTools protocol:
the page renders the run's charts, a Train made while it is open appears on them without a reload, and a
screenshot is kept (its path is printed). Plain HTTP checks pin the view's access rules."""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.sync.client import ClientConnection, connect

import tinkerrpc
from tinkerrpc.contract.limits import MISMATCH_RATIO_MAX, MISMATCH_RATIO_MIN
from tinkerrpc_server.local.stack import LocalStack

pytestmark = pytest.mark.ecosystem

SIDECAR_KEY = "run-view-test-key"
MODEL = "run-view"
PROMPT = [{"role": "user", "content": "Is the sky blue? Answer yes, no or maybe."}]
BROWSER_START_TIMEOUT = 60.0
PAGE_TIMEOUT = 60.0
# Where the screenshot is kept: $TINKERRPC_TEST_ARTIFACTS, else a folder in the system temp dir.
ARTIFACTS = Path(
    os.environ.get("TINKERRPC_TEST_ARTIFACTS", Path(tempfile.gettempdir()) / "tinkerrpc-artifacts")
)


def _train(model: tinkerrpc.Model, seed: int) -> int:
    samples = model.sample(PROMPT, n=4, max_tokens=6, seed=seed)
    rewards = [1.0, 0.0, 0.5, 0.25]
    group = [tinkerrpc.Trajectory.from_sample(PROMPT, s, r) for s, r in zip(samples, rewards, strict=True)]
    return model.train([group], learning_rate=1e-2).policy_version


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    work = tmp_path_factory.mktemp("run-view")
    env = {**os.environ, "TINKERRPC_SIDECAR_API_KEY": ""}
    with LocalStack(
        work / "data",
        work / "serve.log",
        ("--model-dir", str(work / "models"), "--sidecar-api-key", SIDECAR_KEY),
        startup_timeout=180,
        env=env,
        with_sidecar=True,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def model(stack: LocalStack) -> Iterator[tinkerrpc.Model]:
    with tinkerrpc.Client(stack.target) as client:
        handle = client.create_model(MODEL, "tinkerrpc/tiny-chat", lora_rank=8, seed=3)
        for seed in (1, 2):
            _train(handle, seed)
        yield handle


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: Any, **kwargs: Any) -> None:
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()


def test_the_view_needs_the_sidecars_key(stack: LocalStack, model: tinkerrpc.Model) -> None:
    base = stack.sidecar_url
    for path in ("/runs", f"/runs/{MODEL}", f"/runs/{MODEL}/state", f"/runs/{MODEL}/events"):
        assert _get(f"{base}{path}")[0] == 401, path
        assert _get(f"{base}{path}", {"Authorization": "Bearer wrong"})[0] == 401, path
    # ?key= once: the key goes into an HttpOnly cookie for /runs and the browser leaves the keyed address.
    status, headers, _ = _get(f"{base}/runs?key={SIDECAR_KEY}")
    assert (status, headers["location"]) == (303, "/runs")
    cookie = headers["set-cookie"]
    assert "tinkerrpc_runs_key=" in cookie and "HttpOnly" in cookie and "Path=/runs" in cookie
    assert "samesite=strict" in cookie.lower()
    status, _, page = _get(f"{base}/runs", {"Cookie": f"tinkerrpc_runs_key={SIDECAR_KEY}"})
    assert status == 200 and f'href="/runs/{MODEL}"' in page
    status, _, body = _get(f"{base}/runs/{MODEL}/state", {"Authorization": f"Bearer {SIDECAR_KEY}"})
    state = json.loads(body)
    assert status == 200 and [s["v"] for s in state["steps"]] == [1, 2]
    assert state["model"]["sampleable_versions"] == [0, 1, 2]
    assert state["steps"][0]["lr"] == pytest.approx(1e-2) and state["steps"][0]["used"] == 4
    assert state["mismatch_ratio_bounds"] == [MISMATCH_RATIO_MIN, MISMATCH_RATIO_MAX]
    # The page's code (the vendored uPlot included) is public and served from the package.
    for name in ("uPlot.iife.min.js", "uPlot.min.css", "run.js", "runs.css"):
        status, headers, _ = _get(f"{base}/runs/static/{name}")
        # Revalidated on every load, so a browser never runs a script cached from an older tinkerrpc.
        assert status == 200 and headers.get("cache-control") == "no-cache", (name, headers)
    assert _get(f"{base}/runs/static/..%2Froutes.py")[0] == 404
    assert _get(f"{base}/runs/no-such-model", {"Authorization": f"Bearer {SIDECAR_KEY}"})[0] == 404


class Browser:
    """Headless Chromium with the DevTools protocol on a port it picks itself, and one page to drive."""

    def __init__(self, profile: Path, log_path: Path) -> None:
        binary = shutil.which("chromium")
        if binary is None:
            pytest.fail("chromium is not on PATH: scripts/setup.sh installs Debian's chromium package")
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={profile}",
                # Port 0: chromium binds a free port and names it in its "DevTools listening" line.
                "--remote-debugging-port=0",
                "--window-size=1280,1400",
                "about:blank",
            ],
            stdout=self._log,
            stderr=subprocess.PIPE,
        )
        self._browser_url: queue.Queue[str | None] = queue.Queue()
        # Copies chromium's log to the file (a full pipe would block it) and hands over the DevTools address.
        self._log_copier = threading.Thread(target=self._copy_log, daemon=True)
        self._log_copier.start()
        self.page = self._open_page()
        self._next_id = 0

    def _copy_log(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._log.write(line)
            if line.startswith(b"DevTools listening on "):
                self._browser_url.put(line.split(b" on ", 1)[1].strip().decode())
        self._browser_url.put(None)  # chromium's stderr closed: it exited

    def _open_page(self) -> ClientConnection:
        try:
            browser_url = self._browser_url.get(timeout=BROWSER_START_TIMEOUT)
        except queue.Empty:
            browser_url = None
        if browser_url is None:
            raise RuntimeError(f"chromium did not start its DevTools endpoint (exit {self.process.poll()})")
        # A page made over the browser's own endpoint exists once the answer comes: nothing to wait for.
        with connect(browser_url) as browser:
            browser.send(
                json.dumps({"id": 1, "method": "Target.createTarget", "params": {"url": "about:blank"}})
            )
            while (message := json.loads(browser.recv(timeout=PAGE_TIMEOUT))).get("id") != 1:
                pass
        target_id = message["result"]["targetId"]
        port = urllib.parse.urlsplit(browser_url).port
        return connect(f"ws://127.0.0.1:{port}/devtools/page/{target_id}", max_size=64 * 1024 * 1024)

    def _receive_until(self, done: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        while True:
            message: dict[str, Any] = json.loads(self.page.recv(timeout=timeout))
            if done(message):
                return message

    def _send(self, method: str, params: dict[str, Any]) -> int:
        self._next_id += 1
        self.page.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        return self._next_id

    def call(self, method: str, timeout: float = PAGE_TIMEOUT, **params: Any) -> dict[str, Any]:
        sent = self._send(method, params)
        message = self._receive_until(lambda m: m.get("id") == sent, timeout)
        if "error" in message:
            raise RuntimeError(f"{method}: {message['error']}")
        result: dict[str, Any] = message["result"]
        return result

    def navigate(self, url: str) -> None:
        """Open `url` and return once its load event has fired (Page.enable first)."""
        sent = self._send("Page.navigate", {"url": url})
        seen: set[str] = set()

        def loaded(message: dict[str, Any]) -> bool:
            if message.get("id") == sent:
                if "error" in message or message["result"].get("errorText"):
                    raise RuntimeError(f"Page.navigate {url}: {message}")
                seen.add("navigated")
            elif message.get("method") == "Page.loadEventFired":
                seen.add("loaded")
            return seen == {"navigated", "loaded"}

        self._receive_until(loaded, PAGE_TIMEOUT)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str) -> Any:
        """The first truthy value of `expression`, evaluated in the page now and after each change of its
        DOM (each condition here is read from the DOM), within PAGE_TIMEOUT."""
        script = (
            "new Promise((resolve, reject) => {"
            " const check = () => { let value = null; try { value = (" + expression + "); } catch (e) {}"
            "  if (value) { observer.disconnect(); clearTimeout(timer); resolve(value); } };"
            " const observer = new MutationObserver(check);"
            " const timer = setTimeout(() => { observer.disconnect(); reject(new Error('timed out')); },"
            f" {PAGE_TIMEOUT * 1000:.0f});"
            " observer.observe(document, {subtree: true, childList: true, attributes: true, characterData: true});"
            " check(); })"
        )
        result = self.call(
            "Runtime.evaluate", PAGE_TIMEOUT + 30, expression=script, awaitPromise=True, returnByValue=True
        )
        if "exceptionDetails" in result:
            raise AssertionError(
                f"the page never showed {what}: {self.evaluate('document.body.innerText')!r}"
            )
        return result["result"].get("value")

    def close(self) -> None:
        self.page.close()
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log_copier.join()
        self._log.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    opened = Browser(tmp_path / "profile", tmp_path / "chromium.log")
    yield opened
    opened.close()


def _run_state(browser: Browser) -> dict[str, Any]:
    state: dict[str, Any] = browser.evaluate(
        "(() => { const r = document.getElementById('run'); return r && {"
        "version: r.dataset.latestVersion, points: Number(r.dataset.points), stream: r.dataset.stream,"
        "canvases: document.querySelectorAll('.charts canvas').length,"
        "sampleable: document.getElementById('sampleable').textContent,"
        "checkpoints: document.querySelectorAll('#checkpoints tbody tr').length}; })()"
    )
    return state


def test_the_run_view_draws_the_run_and_follows_a_train_live(
    stack: LocalStack, model: tinkerrpc.Model, browser: Browser
) -> None:
    browser.call("Page.enable")
    # The keyed address, as `tinkerrpc demo` prints it: the cookie is set and the page loads without the key.
    browser.navigate(f"{stack.sidecar_url}/runs/{MODEL}?key={SIDECAR_KEY}")
    browser.wait_for(
        "(() => { const r = document.getElementById('run');"
        " return r && r.dataset.latestVersion === '2' && r.dataset.stream === 'open'; })()",
        "version 2 with the live stream open",
    )
    before = _run_state(browser)
    assert before["points"] == 2 and before["canvases"] >= 5, before
    assert before["sampleable"] == "0, 1, 2"
    assert browser.evaluate("location.search") == ""  # the key left the address bar
    browser.evaluate("window.loadedOnce = true")  # gone if the page reloads

    assert _train(model, 3) == 3
    browser.wait_for(
        "document.getElementById('run').dataset.latestVersion === '3'", "version 3 without a reload"
    )
    browser.wait_for(
        "document.getElementById('sampleable').textContent.endsWith('3')", "version 3 sampleable"
    )
    after = _run_state(browser)
    assert after["points"] == 3 and browser.evaluate("window.loadedOnce") is True, after
    # Every RL step has a point on the mismatch chart: its KL (k3), never negative.
    kl = browser.evaluate("window.runCharts.mismatch.data[1]")
    assert len(kl) == 3 and all(value is not None and value >= 0 for value in kl), kl
    # The ratio series is named with the contract's bounds, not their constants' names.
    label = browser.evaluate("window.runCharts.mismatch.series[2].label")
    assert label == f"fraction of ratios outside [{MISMATCH_RATIO_MIN:g}, {MISMATCH_RATIO_MAX:g}]", label
    # Version 3's point is on the reward chart's data, which uPlot draws.
    assert browser.evaluate("document.getElementById('summary').textContent").startswith("version 3:")

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "run_view.png"
    shot.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"]))
    assert shot.stat().st_size > 10_000
    print(f"run view screenshot: {shot}")

    # Every value axis is as wide as its widest tick label: with 10,000 tokens/s and more the throughput
    # axis kept uPlot's 50 px and showed "0,000".
    browser.evaluate("window.runCharts.throughput.setData([[1, 2, 3], [9500, 10000, 123456]])")
    fits = browser.evaluate(
        "(() => { const u = window.runCharts.throughput;"
        " const axis = u.axes[1]; u.ctx.font = axis.font[0];"
        " const widths = axis._values.map((v) => u.ctx.measureText(String(v)).width / uPlot.pxRatio);"
        " return {labels: axis._values, size: axis._size,"
        " needed: Math.max(...widths) + axis.ticks.size + axis.gap}; })()"
    )
    assert "100,000" in fits["labels"], fits
    assert fits["size"] >= fits["needed"] > 50, fits
    # Tick labels are as precise as their spacing: KLs of a few 1e-5 (and 1e-14) were "0" on every tick.
    for kls, written in (
        ("0.25, 0.5, 1.25", "0.5"),
        ("1e-5, 3e-5, 5e-5", "e-5"),
        ("1e-14, 3e-14, 6e-14", "e-14"),
    ):
        browser.evaluate(f"window.runCharts.mismatch.setData([[1, 2, 3], [{kls}], [0, 0, 0]])")
        axis = browser.evaluate(
            "(({_splits, _values}) => ({_splits, _values}))(window.runCharts.mismatch.axes[1])"
        )
        assert len(axis["_values"]) > 2 and any(written in label for label in axis["_values"]), axis
        assert [float(label) for label in axis["_values"]] == pytest.approx(axis["_splits"], rel=1e-9), axis


SFT_MODEL = "run-view-minibatches"
CONVERSATIONS = [
    [{"role": "user", "content": f"Say {word}."}, {"role": "assistant", "content": word}]
    for word in ("yes", "no", "maybe", "never")
]


def _loss_chart(browser: Browser) -> list[list[float | None]]:
    data: list[list[float | None]] = browser.evaluate("window.runCharts.loss.data.map((s) => Array.from(s))")
    return data


def test_the_loss_chart_draws_each_minibatch_inside_its_version(stack: LocalStack, browser: Browser) -> None:
    with tinkerrpc.Client(stack.target) as client:
        sft = client.create_model(SFT_MODEL, "tinkerrpc/tiny-chat", lora_rank=8, seed=5)
        # A warm-up as one Train: 4 minibatches of one conversation, each at its own learning rate.
        warm_up = sft.train_supervised(
            CONVERSATIONS, minibatch_size=1, minibatch_learning_rates=[2e-2, 1e-2, 5e-3, 2e-3]
        ).metrics
        plain = sft.train_supervised(CONVERSATIONS[:2], learning_rate=1e-2).metrics
        assert len(warm_up.minibatch_losses) == 4 and plain.minibatch_losses == ()

        browser.call("Page.enable")
        browser.navigate(f"{stack.sidecar_url}/runs/{SFT_MODEL}?key={SIDECAR_KEY}")
        browser.wait_for(
            "(() => { const r = document.getElementById('run');"
            " return r && r.dataset.latestVersion === '2' && r.dataset.stream === 'open'; })()",
            "version 2 with the live stream open",
        )
        assert _run_state(browser)["points"] == 2  # one per version, minibatches or not
        # Version 1's minibatches at 0.25, 0.5, 0.75 and 1 (the last on the version); the line shows
        # each version's loss per optimizer step: version 1's sum over 4 minibatches, divided by 4.
        xs, per_step, minibatches = _loss_chart(browser)
        assert xs == pytest.approx([0.25, 0.5, 0.75, 1.0, 2.0])
        assert minibatches == [*(pytest.approx(loss) for loss in warm_up.minibatch_losses), None]
        assert per_step == [None, None, None, pytest.approx(warm_up.loss / 4), pytest.approx(plain.loss)]
        assert warm_up.loss == pytest.approx(sum(warm_up.minibatch_losses))
        # Hovering a minibatch names it.
        hovered = browser.evaluate(
            "(() => { const u = window.runCharts.loss;"
            " u.setCursor({left: u.valToPos(0.5, 'x'), top: u.valToPos(0, 'y')});"
            " return u.root.querySelector('.u-legend .u-value').textContent; })()"
        )
        assert hovered == "version 1, minibatch 2 of 4"
        legend = browser.evaluate(
            "Array.from(window.runCharts.loss.root.querySelectorAll('.u-legend .u-value'), (e) => e.textContent)"
        )
        assert legend[:2] == ["version 1, minibatch 2 of 4", "--"], legend  # no line point inside a version
        assert float(legend[2]) == pytest.approx(warm_up.minibatch_losses[1], rel=1e-3), legend
        # Every chart's x axis starts at 0, where version 1's minibatches begin.
        assert browser.evaluate("Object.values(window.runCharts).map((u) => u.scales.x.min)") == [0] * 5

        # A minibatched Train made while the page is open: 2 minibatches, at 2.5 and 3.
        live = sft.train_supervised(CONVERSATIONS, minibatch_size=2, learning_rate=1e-2).metrics
        browser.wait_for("document.getElementById('run').dataset.latestVersion === '3'", "version 3 live")
        xs, per_step, minibatches = _loss_chart(browser)
        assert xs[5:] == pytest.approx([2.5, 3.0])
        assert minibatches[5:] == pytest.approx(list(live.minibatch_losses))
        assert per_step[5:] == [None, pytest.approx(live.loss / 2)]
        summary = browser.evaluate("document.getElementById('summary').textContent")
        assert summary.startswith("version 3: 2 minibatches, minibatch loss "), summary
        assert "(their sum)" in summary

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "run_view_minibatches.png"
    shot.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"]))
    print(f"run view screenshot (minibatches): {shot}")
