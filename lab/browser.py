"""Drives the app from Debian's chromium with Playwright: a WAV file is the microphone.

Used by the end-to-end test and by `python -m lab.app_bench`. Playwright's own browser
downloads are never used: chromium is the system's (`/usr/bin/chromium`), or the one
TALKLOOP_CHROMIUM names (e.g. Debian's chromium-headless-shell unpacked on a machine
where nothing can be installed; lab/device/app_carry.sh).
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

from engine.audio import SAMPLE_RATE, write_wav
from voice.samples import speech_bounds


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


# A microphone the test plays into: getUserMedia answers with a WebAudio stream, and `window.scriptedMic.say`
# plays 16 kHz samples into it at a known moment (epoch ms). The character's voice as the page plays it is
# watched too: `window.scriptedMic.voiceLoud` holds the epoch ms of every 5 ms tick when it was loud and the video
# element playing it was not muted (heard), `voiceReceived` every tick it was loud in the stream (muted or not).
SCRIPTED_MIC = """(() => {
  const epochMs = () => performance.timeOrigin + performance.now();
  const mic = window.scriptedMic = { ctx: null, dest: null, constraints: [], voiceLoud: [], voiceReceived: [],
                                     watching: null };
  navigator.mediaDevices.getUserMedia = async (constraints) => {
    mic.constraints.push(constraints);
    if (!mic.ctx) {
      mic.ctx = new AudioContext({ sampleRate: 48000 });
      mic.dest = mic.ctx.createMediaStreamDestination();
      const hush = mic.ctx.createConstantSource();  // a source always playing: silence flows between utterances
      hush.offset.value = 0;
      hush.connect(mic.dest);
      hush.start();
    }
    return new MediaStream(mic.dest.stream.getAudioTracks().map((t) => t.clone()));
  };
  mic.say = (samples, rate, lead = 0.05) => {
    const buffer = mic.ctx.createBuffer(1, samples.length, rate);
    buffer.copyToChannel(Float32Array.from(samples), 0);
    const source = mic.ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(mic.dest);
    const at = mic.ctx.currentTime + lead;
    source.start(at);
    return epochMs() + 1000 * (at - mic.ctx.currentTime);
  };
  // Once the voice has been loud for most of the last loud_ms: say it at once (a barge-in over speech, not a pause).
  mic.sayWhileVoiceLoud = (samples, rate, loudMs) => new Promise((resolve) => {
    const timer = setInterval(() => {
      const now = epochMs(), recent = mic.voiceLoud.filter((t) => t >= now - loudMs).length;
      if (recent >= 0.8 * loudMs / 5) { clearInterval(timer); resolve(mic.say(samples, rate, 0)); }
    }, 5);
  });
  mic.watchVoice = () => {
    const stream = document.getElementById("tl-video").srcObject;
    if (!stream || !stream.getAudioTracks().length || mic.watching === stream) return mic.watching !== null;
    mic.watching = stream;
    const ctx = new AudioContext(), analyser = ctx.createAnalyser();
    analyser.fftSize = 256;
    ctx.createMediaStreamSource(stream).connect(analyser);
    const buf = new Float32Array(analyser.fftSize);
    setInterval(() => {
      analyser.getFloatTimeDomainData(buf);
      let sum = 0;
      for (const x of buf) sum += x * x;
      if (Math.sqrt(sum / buf.length) <= 0.01) return;
      mic.voiceReceived.push(epochMs());
      if (!document.getElementById("tl-video").muted) mic.voiceLoud.push(epochMs());
    }, 5);
    return true;
  };
})();"""


def say(page, speech: np.ndarray) -> float:
    """Play 16 kHz speech into the page's scripted microphone; returns when it starts (epoch ms)."""
    return page.evaluate("([samples, rate]) => window.scriptedMic.say(samples, rate)",
                         [np.asarray(speech, np.float32).round(5).tolist(), SAMPLE_RATE])


def say_while_voice_loud(page, speech: np.ndarray, loud_ms: float = 200) -> float:
    """Wait until the character's voice has played loud for most of the last loud_ms, then play speech into the
    microphone at once; returns when it starts (epoch ms)."""
    return page.evaluate("([samples, rate, loud]) => window.scriptedMic.sayWhileVoiceLoud(samples, rate, loud)",
                         [np.asarray(speech, np.float32).round(5).tolist(), SAMPLE_RATE, loud_ms])


def voice_loud_since(page, since_ms: float) -> list[float]:
    """Epoch ms of each 5 ms tick since `since_ms` when the character's voice played loud in the page."""
    return page.evaluate("(since) => window.scriptedMic.voiceLoud.filter((t) => t >= since)", since_ms)


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


def voice_received(page) -> dict[str, int] | None:
    """The browser's counts for the character's voice track (None before it has one): packets received and
    discarded, samples received and those it concealed (made up for gaps)."""
    return page.evaluate("""async () => { let found = null;
        (await window.talkloop.state.pc.getStats()).forEach((s) => {
            if (s.type === 'inbound-rtp' && s.kind === 'audio') found = s; });
        return found && { packets: found.packetsReceived, discarded: found.packetsDiscarded,
                          received: found.totalSamplesReceived, concealed: found.concealedSamples }; }""")


def page_now_ms(page) -> float:
    return page.evaluate("() => performance.timeOrigin + performance.now()")


def wait_until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def ask_and_hear_the_reply(page, live, question: np.ndarray) -> tuple[dict, float]:
    """Say a question into the scripted microphone; wait until the reply's voice has played in the page for a
    second. Returns the turn's trace record and when its voice was first loud (epoch ms)."""
    before = len(live.turn_records())
    asked = say(page, question)
    ended = asked + 1000 * question.size / SAMPLE_RATE
    heard = wait_until(lambda: voice_loud_since(page, ended), 90, "the reply's voice in the page")[0]
    wait_until(lambda: page_now_ms(page) > heard + 1000, 5, "a second of the reply")
    return next(r for r in live.turn_records()[before:] if r.get("user_text")), heard


def barge_in(page, live, question: np.ndarray, interjection: np.ndarray) -> dict[str, Any]:
    """Ask `question`, and while its reply's voice plays, say `interjection`. Measured in the page, from the first
    sample of the user's speech: to the last sample of the character's voice heard loud (the video element not
    muted) before a second of quiet (`voice_stopped_ms`), and to the last one received loud in its stream, muted or
    not (`voice_received_ms`); and on the server, when the voice loop cut the reply (`detected_ms`, the page's clock
    and the server's both read as wall time on this machine)."""
    record, _ = ask_and_hear_the_reply(page, live, question)
    spoke = say_while_voice_loud(page, interjection[speech_bounds(interjection)[0]:])
    playing = len(voice_loud_since(page, spoke - 100)) >= 10
    wait_until(lambda: page_now_ms(page) > spoke + 3000, 10, "three seconds after the barge-in")

    def last_before_quiet(ticks: list[float]) -> float:
        return next((a for a, b in zip(ticks, ticks[1:]) if b - a >= 1000), ticks[-1] if ticks else spoke)

    heard = last_before_quiet(voice_loud_since(page, spoke - 1000))
    received = last_before_quiet(page.evaluate("(since) => window.scriptedMic.voiceReceived.filter((t) => t >= since)",
                                               spoke - 1000))
    cut = next(r for r in live.turn_records() if r["turn_id"] == record["turn_id"])
    wall = time.time() - time.monotonic()
    detected = cut["stamps"].get("barge_in")
    return {"turn": cut, "voice_playing_when_user_spoke": playing, "voice_stopped_ms": round(heard - spoke, 1),
            "voice_received_ms": round(received - spoke, 1),
            "detected_ms": None if detected is None else round(1000 * (detected + wall) - spoke, 1)}
