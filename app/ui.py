"""The page: the character, the transcript, the preset picker, start/stop, the latency
panel beside the engine's health, and the recorded sessions with their latency panels."""

from __future__ import annotations

import html
from typing import Any

import gradio as gr

from app.controller import Controller
from app.engine_host import AUTO_SPECS
from app.hls import LiveSegments, mic_chunk_to_float
from app.latency import render_panel
from app.recorder import find_recording, list_recordings
from engine.character import PRESETS
from engine.config import get_spec
from voice.personas import persona_for

STAGE_HTML = """
<div id="tl-stage">
  <video id="tl-video" autoplay playsinline></video>
  <div id="tl-status">press Start and talk</div>
</div>
"""
REPLAY_CACHE_CLEANUP = (3600, 86400)  # Gradio's delete_cache: every hour, the cached files over a day old

HEAD = '<link rel="stylesheet" href="/talkloop/static/talkloop.css"><script src="/talkloop/static/talkloop.js"></script>'


INTERRUPTED = " (interrupted)"  # after a reply cut short by the user or a stop
# Copy buttons only: Gradio 6 also shows "share" (to Hugging Face Discussions) by default, and the page reaches no one outside
CHAT_BUTTONS = ["copy", "copy_all"]


def _messages(lines) -> list[dict[str, str]]:
    out = []
    for line in lines:
        if not line.text:
            continue
        role = "assistant" if line.role in ("assistant", "error") else "user"
        text = line.text if line.role != "error" else f"⚠ {line.text}"
        if line.interrupted:
            text += INTERRUPTED
        out.append({"role": role, "content": text if line.final or line.role != "user" else f"{text} …"})
    return out


def _health_html(health: dict[str, Any]) -> str:
    rows = "".join(f'<tr><th>{html.escape(k.replace("_", " "))}</th><td data-health="{k}">{html.escape(str(v))}</td></tr>'
                   for k, v in health.items())
    return f'<table id="tl-health" class="tl-table">{rows}</table>'


def _persona_text(preset: str, name: str | None) -> str:
    """Who the character is, under the picker: the name and personality the agent speaks with."""
    persona = persona_for(preset, name)
    return f"**{persona.name}**: {persona.personality}"


def _failures_html(failures: list[str]) -> str:
    return "".join(f'<p class="tl-failure">{html.escape(f)}</p>' for f in failures)


def changed_only(now: tuple, sent: tuple | None) -> tuple:
    """The panels' values, with gr.skip() for those the page already shows (`sent`: what it was last sent; None:
    nothing yet). The page then re-renders only what changed: a transcript re-rendered twice a second costs
    the browser CPU that the engine and the voice models share on a small machine."""
    if sent is None:
        return now
    return tuple(gr.skip() if value == old else value for value, old in zip(now, sent))


def build_ui(controller: Controller) -> gr.Blocks:
    config = controller.config
    webrtc = config.transport == "webrtc"
    # transport hls: the character as segments, at the served character's rate (the engine's spec after auto)
    spec = controller.host.spec if controller.host is not None else get_spec(AUTO_SPECS[0])
    segments = LiveSegments(controller, spec.fps)

    def refresh(sent: tuple | None):
        shown = controller.shown()
        failures = controller.failures()
        failed = bool(shown is not None and shown.failure)
        now = (_messages(shown.transcript if shown else []), render_panel(shown.turn_records() if shown else []),
               _health_html(controller.health()), _failures_html(failures), gr.update(visible=failed))
        return (*changed_only(now, sent), now)

    def start(preset: str, record: bool) -> str:
        try:
            live = controller.start(preset, record)
        except Exception as e:
            controller.client_error = f"could not start: {e}"
            return f"could not start: {e}"
        return f"session {live.session_id} on {preset}" + (f", recording to {live.recorder.folder}" if live.recorder else "")

    def stop() -> str:
        segments.close()
        stats = controller.stop()
        return "stopped" if stats is None else f"stopped: {stats.get('fps', 0):.1f} fps over {stats.get('seconds', 0):.0f} s"

    def restart(preset: str, record: bool) -> str:
        try:
            live = controller.restart(preset, record)
        except Exception as e:
            controller.engine_error = f"restart failed: {e}"
            return f"restart failed: {e}"
        return f"session {live.session_id} on {live.preset} (restarted)"

    def switch(preset: str, record: bool) -> str:
        """A new preset while live: a new session on it (the browser reconnects)."""
        if controller.live is None:
            return f"next session: {preset}"
        return start(preset, record)

    def feed_mic(chunk) -> None:
        live, pcm = controller.live, mic_chunk_to_float(chunk)
        if live is not None and pcm is not None:
            live.feed_mic(*pcm)

    def recordings_choices():
        return gr.update(choices=[(r.label, r.folder.name) for r in list_recordings(config.recordings_dir)])

    def replay(name: str | None):
        if not name:
            return None, "", []
        rec = find_recording(config.recordings_dir, name)
        lines = [{"role": "assistant" if row.get("role") == "assistant" else "user",
                  "content": str(row.get("text", "")) + (INTERRUPTED if row.get("interrupted") else "")}
                 for row in rec.transcript() if row.get("text")]
        return str(rec.video), render_panel(rec.trace()), lines

    # Gradio copies each replayed recording into its cache (again while the recording is still being written):
    # copies a day old go, checked hourly, so that replays over days do not fill the disk
    with gr.Blocks(title="talkloop", analytics_enabled=False, delete_cache=REPLAY_CACHE_CLEANUP) as demo:
        gr.Markdown("# talkloop: talk to the character")
        with gr.Tab("Live"):
            with gr.Row():
                with gr.Column(scale=3):
                    if webrtc:
                        gr.HTML(STAGE_HTML)
                    else:
                        stage = gr.Video(streaming=True, autoplay=True, show_label=False, elem_id="tl-hls-video")
                        mic = (gr.Audio(sources=["microphone"], streaming=True, type="numpy", label="microphone",
                                        elem_id="tl-hls-mic", buttons=[]) if config.audio_input == "browser" else None)
                    with gr.Row():
                        preset = gr.Dropdown(choices=list(PRESETS), value=config.preset, label="character", elem_id="tl-preset")
                        record = gr.Checkbox(value=config.record, label="record this session", elem_id="tl-record")
                    persona = gr.Markdown(_persona_text(config.preset, config.name), elem_id="tl-persona")
                    with gr.Row():
                        start_btn = gr.Button("Start", variant="primary", elem_id="tl-start")
                        stop_btn = gr.Button("Stop", elem_id="tl-stop")
                        restart_btn = gr.Button("Restart engine", variant="stop", visible=False, elem_id="tl-restart")
                    session_text = gr.Markdown(elem_id="tl-session")
                    failures = gr.HTML(elem_id="tl-failures")
                with gr.Column(scale=2):
                    transcript = gr.Chatbot(label="conversation", elem_id="tl-transcript", height=420, allow_tags=False,
                                            buttons=CHAT_BUTTONS)
            with gr.Row():
                with gr.Column(scale=3):
                    gr.Markdown("### Latency per turn")
                    latency = gr.HTML(render_panel([]), elem_id="tl-latency-panel")
                with gr.Column(scale=1):
                    gr.Markdown("### Engine health")
                    health = gr.HTML(elem_id="tl-health-panel")
        with gr.Tab("Recordings"):
            with gr.Row():
                choice = gr.Dropdown(label="recorded session", choices=[], elem_id="tl-recordings")
                refresh_btn = gr.Button("Refresh list", elem_id="tl-recordings-refresh")
            with gr.Row():
                video = gr.Video(label="session", elem_id="tl-replay-video")
                replay_transcript = gr.Chatbot(label="transcript", elem_id="tl-replay-transcript", allow_tags=False,
                                               buttons=CHAT_BUTTONS)
            replay_latency = gr.HTML(elem_id="tl-replay-latency")

        timer = gr.Timer(0.5)
        sent = gr.State(None)  # per page: the panels it was last sent
        timer.tick(refresh, inputs=[sent], outputs=[transcript, latency, health, failures, restart_btn, sent],
                   show_progress="hidden")
        if webrtc:
            # js runs first: Start, Restart and a switch take a ticket; once the server answered, the page connects to
            # the session it names, unless Stop or another click came in between (talkloop.js, afterStart)
            ticket = "(...args) => { window.talkloop.requested(); return args; }"
            # a js step with no outputs returns the empty list of them (Gradio reads any other value as outputs)
            connect = dict(inputs=[session_text], js="async (answer) => { await window.talkloop.afterStart(answer); return []; }")
            start_btn.click(start, inputs=[preset, record], outputs=[session_text], js=ticket).then(None, **connect)
            # the browser hangs up, then the server ends the session
            stop_btn.click(stop, outputs=[session_text], js="async () => { await window.talkloop.disconnect(); return []; }")
            restart_btn.click(restart, inputs=[preset, record], outputs=[session_text], js=ticket).then(None, **connect)
            # .select: a pick by the user, once (.change also fires when the value is set, and Gradio 6's .input again
            # when the list closes, even with no pick: each started a session); always_last: picks made while one is
            # being started are not dropped, the last one is started after it
            preset.select(switch, inputs=[preset, record], outputs=[session_text], js=ticket,
                          trigger_mode="always_last").then(None, **connect)
        else:
            start_btn.click(start, inputs=[preset, record], outputs=[session_text]).then(segments.stream, outputs=[stage])
            stop_btn.click(stop, outputs=[session_text])
            restart_btn.click(restart, inputs=[preset, record], outputs=[session_text]).then(segments.stream, outputs=[stage])
            preset.select(switch, inputs=[preset, record], outputs=[session_text],
                          trigger_mode="always_last").then(segments.stream, outputs=[stage])
            if mic is not None:
                mic.stream(feed_mic, inputs=[mic], outputs=None, stream_every=0.25)
        preset.change(lambda picked: _persona_text(picked, config.name), inputs=[preset], outputs=[persona],
                      show_progress="hidden")
        refresh_btn.click(recordings_choices, outputs=[choice])
        choice.change(replay, inputs=[choice], outputs=[video, replay_latency, replay_transcript])
        demo.load(recordings_choices, outputs=[choice])
    return demo


def page_settings() -> dict[str, Any]:
    """What Gradio 6 takes where the page is served (launch or mount_gradio_app), not in Blocks: the theme, the
    head that loads the client, and no run history (sessions are recorded by the app; that page offers an upload)."""
    # System fonts: nothing to fetch, and the page reaches no one outside (the browser test checks every request)
    theme = gr.themes.Default(font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])
    return dict(theme=theme, head=HEAD, run_history=False)
