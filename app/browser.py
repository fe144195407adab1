"""Drives the app from Debian's chromium with Playwright: a WAV file is the microphone.

Used by the end-to-end test and by `python -m app.bench`. Playwright's own browser
downloads are never used: chromium is the system's (`/usr/bin/chromium`), or the one
TALKLOOP_CHROMIUM names (e.g. Debian's chromium-headless-shell unpacked on a machine
where nothing can be installed; tools/app_carry.sh).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from voice.audio import SAMPLE_RATE, write_wav


CHROMIUM_ENV = "TALKLOOP_CHROMIUM"


def chromium_path() -> str:
    chosen = os.environ.get(CHROMIUM_ENV)
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise RuntimeError(f"{CHROMIUM_ENV}={chosen} is not an executable file")
        return chosen
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise RuntimeError(f"chromium not found (Debian: apt-get install chromium, or set {CHROMIUM_ENV})")
    return path


def conversation_wav(path: str | Path, utterances: list[np.ndarray], lead_s: float = 1.5, gap_s: float = 8.0,
                     noise_rms: float = 0.0) -> Path:
    """16 kHz utterances, each after lead_s of silence and followed by gap_s for the reply; with noise_rms, white
    noise of that level under all of it (the same noise each time)."""
    silence = lambda s: np.zeros(int(s * SAMPLE_RATE), np.float32)  # noqa: E731
    parts = []
    for speech in utterances:
        parts += [silence(lead_s), speech.astype(np.float32), silence(gap_s)]
    audio = np.concatenate(parts)
    if noise_rms > 0:
        audio += np.random.default_rng(0).normal(0.0, noise_rms, audio.shape).astype(np.float32)
    return write_wav(path, audio, SAMPLE_RATE)


def start_server(controller) -> tuple[object, threading.Thread]:
    """The app's web server in a thread of this process (tests, bench); stop with stop_server."""
    import uvicorn

    from app.server import build_app

    app = build_app(controller)
    server = uvicorn.Server(uvicorn.Config(app, host=controller.config.host, port=controller.config.port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="talkloop-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the app's web server did not start")
        time.sleep(0.05)
    return server, thread


def stop_server(server, thread: threading.Thread) -> None:
    server.should_exit = True
    thread.join(timeout=10)


def launch_chromium(playwright, wav: str | Path | None, *, deny_microphone: bool = False):
    """Headless chromium whose microphone plays `wav` (looped)."""
    args = ["--use-fake-device-for-media-stream", "--autoplay-policy=no-user-gesture-required", "--no-sandbox"]
    if wav is not None:
        args.append(f"--use-file-for-fake-audio-capture={wav}")
    if deny_microphone:
        args.append("--deny-permission-prompts")
    else:
        args.append("--use-fake-ui-for-media-stream")
    return playwright.chromium.launch(executable_path=chromium_path(), headless=True, args=args)


def start_in_browser(playwright, wav: str | Path | None, port: int, *, deny_microphone: bool = False,
                     before_load: Callable[[Any], None] | None = None):
    """(browser, page): chromium with `wav` as its microphone on the app at `port`, Start pressed.
    `before_load(page)` runs before the page is opened (listeners, init scripts)."""
    browser = launch_chromium(playwright, wav, deny_microphone=deny_microphone)
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    if before_load is not None:
        before_load(page)
    page.goto(f"http://127.0.0.1:{port}/")
    page.click("#tl-start")
    return browser, page
