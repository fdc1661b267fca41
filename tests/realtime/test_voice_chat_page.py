"""The voice-chat page at `/` in headless Chromium (Debian's package, driven by Playwright)
against the demo server: it loads with no console errors, sends a text turn, shows the reply
and plays its audio (read from the page's own state), and takes a screenshot: into the test's
temporary folder, or into docs/images/voice-chat.png with UPDATE_DOCS_SCREENSHOTS=1 (a normal
run leaves the tracked files as they are)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "voice-chat.png"
# Headless, offline (no background connections to Google), audio without a click, a fake microphone.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required",
         "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (.ci/run installs Debian's)")


@pytest.fixture
def page(demo):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            pg = browser.new_page(viewport={"width": 1000, "height": 620})
            pg.console_errors = []
            pg.on("console", lambda m: pg.console_errors.append(m.text) if m.type == "error" else None)
            pg.on("pageerror", lambda e: pg.console_errors.append(str(e)))
            pg.goto(demo.url + "/")
            yield pg
        finally:
            browser.close()


def state(pg, key):
    return pg.evaluate(f"window.voiceChat.state.{key}")


def test_the_page_talks_and_plays_the_reply(page, tmp_path):
    page.wait_for_function("window.voiceChat.state.status === 'connected'", timeout=30_000)
    assert state(page, "voices") == ["Chelsie", "Ethan"]
    assert page.locator("#voice option").all_inner_texts() == ["model default", "Chelsie", "Ethan"]
    page.select_option("#voice", "Ethan")
    page.fill("#text", "Hello! How are you today?")
    page.click("#send")
    page.wait_for_function("window.voiceChat.state.responses >= 1", timeout=90_000)
    page.wait_for_function("window.voiceChat.state.chunksPlayed >= window.voiceChat.state.audioDeltas", timeout=30_000)
    assert state(page, "lastResponseStatus") in ("completed", "incomplete")  # incomplete: the 24-token cap
    assert state(page, "audioDeltas") >= 1 and state(page, "samplesPlayed") == state(page, "samplesReceived") > 0
    reply = state(page, "lastReply")
    assert reply and page.locator(".msg.assistant").last.inner_text().startswith(reply)
    assert page.locator(".msg.user").last.inner_text() == "Hello! How are you today?"
    assert state(page, "errors") == [] and page.console_errors == []
    screenshot = DOCS_SCREENSHOT if os.environ.get("UPDATE_DOCS_SCREENSHOTS") == "1" else tmp_path / "voice-chat.png"
    page.screenshot(path=str(screenshot))
    assert screenshot.stat().st_size > 0


def test_push_to_talk_with_a_microphone(page):
    """Chromium's fake microphone (a beeping tone at the device's rate, which the session
    declares and the server resamples): hold the button, release, and a reply comes."""
    page.wait_for_function("window.voiceChat.state.status === 'connected'", timeout=30_000)
    mic = page.locator("#mic")
    mic.hover()
    page.mouse.down()
    page.wait_for_timeout(700)
    page.mouse.up()
    page.wait_for_function("window.voiceChat.state.responses >= 1", timeout=90_000)
    assert page.locator(".msg.user").last.inner_text() == "(spoken message)"
    assert state(page, "errors") == [] and page.console_errors == []
