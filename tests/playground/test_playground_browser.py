"""The playground in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright
through its `executable_path`; no browser is downloaded) opens the page served on 127.0.0.1 with the
shipped demo folder, types tools and a query, presses Run, and reads the rendered call; it must be
the call `needle_hf.Needle(...).complete(query)` returns for the same inputs. A screenshot is saved
in the test's tmp folder and, when NEEDLE_SCREENSHOT_DIR is set, there too (docs/images/playground.png
is one).

Without Chromium or Playwright the test skips and says so; README ("Playground") has the manual check.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest

import needle_hf
from demo_support import PLAY_MUSIC, SET_ALARM, demo_folder  # noqa: F401  (demo_folder: fixture)

gradio = pytest.importorskip("gradio", reason="gradio is not installed (pip install 'needle-hf[playground]')")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra has it)")

from needle_hf.playground import build_app, demo_preset, launch  # noqa: E402

CHROMIUM_CANDIDATES = ("/usr/lib/chromium/chromium", "/usr/bin/chromium")
PAGE_TIMEOUT_MS = 120_000  # the first Run loads the model on a shared CPU
TOOLS = [SET_ALARM, PLAY_MUSIC]
QUERY = "Set an alarm for 6:45."

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def chromium_executable() -> str:
    for path in (*CHROMIUM_CANDIDATES, shutil.which("chromium") or ""):
        if path and os.access(path, os.X_OK):
            return path
    pytest.skip("Chromium is not installed (apt-get install -y chromium chromium-driver, or scripts/setup.sh); "
                "README, 'Playground', describes the manual check")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def served_playground(demo_folder):
    """The playground on the demo folder, served on 127.0.0.1 at a free port: (url, folder)."""
    app = build_app([str(demo_folder)], presets=[demo_preset()])
    port = free_port()
    launch(app, host="127.0.0.1", port=port, block=False)
    yield f"http://127.0.0.1:{port}/", str(demo_folder)
    app.close()


def test_the_page_renders_the_call_needle_returns(served_playground, tmp_path):
    url, folder = served_playground
    expected = needle_hf.Needle(folder, tools=TOOLS).complete(QUERY)
    assert [call["name"] for call in expected["function_calls"]] == ["set_alarm"]

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_executable(), headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url, timeout=PAGE_TIMEOUT_MS)
            page.locator("#tools textarea").fill(json.dumps(TOOLS, indent=2))
            page.locator("#system textarea").fill("")
            page.locator("#query textarea").fill(QUERY)
            page.locator("#run").click()
            page.wait_for_function("() => document.querySelector('#status textarea').value.length > 0",
                                   timeout=PAGE_TIMEOUT_MS)
            status = page.locator("#status textarea").input_value()
            rendered = json.loads(page.locator("#calls textarea").input_value())
            confidence = page.locator("#confidence textarea").input_value()
            speed = page.locator("#speed textarea").input_value()
            page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
        finally:
            browser.close()

    assert status == f"{len(expected['function_calls'])} call(s)"
    assert rendered == expected["function_calls"]
    assert float(confidence) == pytest.approx(expected["confidence"], abs=1e-3)
    assert speed.startswith("prefill ") and "decode " in speed
    assert (tmp_path / "playground.png").stat().st_size > 0
    if os.environ.get("NEEDLE_SCREENSHOT_DIR"):
        target = Path(os.environ["NEEDLE_SCREENSHOT_DIR"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / "playground.png", target / "playground.png")
