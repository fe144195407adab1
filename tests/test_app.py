"""The app without a browser: settings, the latency panel, recording, failures shown."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from app.config import AppConfig, build_config, load_yaml
from app.latency import STAGES, render_panel, session_summary, turn_stages
from app.recorder import SessionRecorder, find_recording, list_recordings


# Settings ------------------------------------------------------------------------------------------
def test_yaml_then_flags_override_defaults(tmp_path):
    path = tmp_path / "talkloop.yaml"
    path.write_text("spec: tiny\npreset: kofi\nmin-silence-ms: 500\nrecord: true\nport: 9000\n")
    config = build_config(path, {"port": 9001, "preset": None})
    assert (config.spec, config.preset, config.min_silence_ms, config.record) == ("tiny", "kofi", 500, True)
    assert config.port == 9001  # a flag given beats the file; a flag not given (None) does not
    assert AppConfig().host == "127.0.0.1" and AppConfig().spec == "auto"


@pytest.mark.parametrize("text, message", [
    ("spek: tiny\n", "unknown setting 'spek'"),
    ("port: seven\n", "'port' must be int"),
    ("record: yes please\n", "'record' must be true or false"),
    ("- just\n- a list\n", "must hold a mapping"),
    ("preset: nobody\n", "unknown preset 'nobody'"),
    ("spec: huge\n", "unknown spec 'huge'"),
    ("prebuffer: 9\nmax_lead: 7\n", "prebuffer <= max_lead"),
])
def test_bad_settings_are_named(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        build_config(path)


@pytest.mark.parametrize("text, key", [("port:\n", "port"), ("vad_threshold: ~\n", "vad_threshold"),
                                       ("adaptive_lead: ~\n", "adaptive_lead"), ("llm:\n", "llm")])
def test_an_empty_value_is_named_unless_the_setting_may_be_left_to_the_app(tmp_path, text, key):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"config key '{key}' needs a value"):
        build_config(path)
    path.write_text("weights: ~\nsession_log:\n")  # None is these settings' default: the app picks
    assert build_config(path).weights is None


def test_every_setting_has_a_flag_and_a_flag_turns_a_yaml_true_off(tmp_path):
    from dataclasses import fields

    from app.__main__ import parse_args

    config_path, flags = parse_args([])
    assert config_path is None and set(flags) == {f.name for f in fields(AppConfig)}
    assert all(value is None for value in flags.values())  # a flag not given leaves the YAML value
    usage = subprocess.run([sys.executable, "-m", "app", "--help"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and "--no-record" in usage.stdout and "--min-silence-ms" in usage.stdout
    path = tmp_path / "talkloop.yaml"
    path.write_text("record: true\nmin_silence_ms: 500\n")
    config = build_config(*parse_args(["--config", str(path), "--no-record", "--vad-threshold", "0.3"]))
    assert (config.record, config.min_silence_ms, config.vad_threshold) == (False, 500, 0.3)
    config = build_config(*parse_args(["--config", str(path), "--decoder-gpu", "3", "--no-cuda-graph"]))
    assert (config.record, config.decoder_gpu, config.cuda_graph, config.adaptive_lead) == (True, "3", False, True)


def test_a_leading_tilde_in_a_path_setting_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = tmp_path / "talkloop.yaml"
    path.write_text("session_log: ~/talkloop/sessions.jsonl\nweights: ~/ckpt.pt\n")
    config = build_config(path, {"recordings_dir": "~/rec"})
    home = tmp_path / "home"
    assert (config.session_log, config.weights, config.recordings_dir) == (
        str(home / "talkloop" / "sessions.jsonl"), str(home / "ckpt.pt"), str(home / "rec"))


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="config file not found"):
        load_yaml(tmp_path / "nope.yaml")


def test_cli_rejects_bad_input_with_a_clear_message(tmp_path):
    out = subprocess.run([sys.executable, "-m", "app", "--config", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "config file not found" in out.stderr
    out = subprocess.run([sys.executable, "-m", "app", "--preset", "nobody"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown preset 'nobody'" in out.stderr


def test_a_port_in_use_is_named_before_the_models_load(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "app", "--spec", "tiny", "--device", "cpu", "--port", str(port),
                              "--recordings-dir", str(tmp_path / "rec")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and f"port {port} on 127.0.0.1 is already in use" in out.stderr, out.stderr[-2000:]
    assert "talkloop: http" not in out.stderr  # no Controller was built


def test_a_recordings_dir_that_cannot_be_a_folder_is_named_before_the_models_load(tmp_path):
    import socket

    from app.server import recordings_folder

    (tmp_path / "rec").write_text("a file where the recordings should go")
    with socket.socket() as probe:  # a port free now, so that the port check passes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "app", "--spec", "tiny", "--device", "cpu", "--port", str(port),
                          "--recordings-dir", str(tmp_path / "rec")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and f"recordings_dir '{tmp_path / 'rec'}' is a file, not a folder" in out.stderr, out.stderr[-2000:]
    assert "talkloop: http" not in out.stderr  # no Controller was built
    with pytest.raises(ValueError, match="recordings_dir .*/rec/sessions' cannot be made"):  # a file where a parent should be
        recordings_folder(str(tmp_path / "rec" / "sessions"))
    assert recordings_folder(str(tmp_path / "new" / "rec")).is_dir()


def test_serve_closes_the_engine_and_voice_loop_when_the_page_cannot_be_built(monkeypatch):
    from app import server

    closed = []

    class Controller:
        def close(self):
            closed.append(True)

    def no_page(controller):
        raise RuntimeError("gradio failed")

    monkeypatch.setattr(server, "build_app", no_page)
    monkeypatch.setattr(server.signal, "signal", lambda *a: None)  # leave this process's SIGTERM handler alone
    with pytest.raises(RuntimeError, match="gradio failed"):
        server.serve(Controller())
    assert closed == [True]


# Latency panel -------------------------------------------------------------------------------------
def _record(turn_id: int, base: float, gaps: list[float], text: str = "hello") -> dict:
    names = ["last_voiced_audio", "speech_end", "asr_done", "reply_first_text", "tts_first_audio",
             "first_speaking_frame", "client_delivered"]
    stamps, t = {}, base
    for name, gap in zip(names, [0.0, *gaps]):
        t += gap
        stamps[name] = t
    return {"turn_id": turn_id, "user_text": text, "stamps": stamps}


def test_stages_add_up_and_summarise():
    records = [_record(1, 100.0, [0.3, 0.4, 0.01, 0.1, 0.2, 0.05]),
               _record(2, 200.0, [0.3, 0.6, 0.01, 0.1, 0.3, 0.07]),
               _record(3, 300.0, [0.3, 0.5, 0.01, 0.1, 0.25, 0.06]),
               {"turn_id": 4, "stamps": {"speech_start": 1.0, "speech_end": 2.0}}]  # ignored noise: no reply
    stages = turn_stages(records[0])
    assert stages["asr"] == pytest.approx(0.4) and stages["delivered"] == pytest.approx(0.05)
    assert sum(stages[k] for k, *_ in STAGES) == pytest.approx(stages["total"])
    summary = session_summary(records)
    assert summary["total"]["n"] == 3
    assert summary["asr"]["median"] == pytest.approx(0.5) and summary["asr"]["p95"] == pytest.approx(0.6)
    html = render_panel(records)
    assert html.count('class="tl-turn"') == 3 and 'data-stat="median"' in html and 'data-stat="p95"' in html
    assert html.count('class="tl-bar-row"') == 3
    assert '<td data-stage="asr">400</td>' in html


def test_a_reply_begun_at_the_pause_counts_no_time_for_text_ready_before_the_turn_ended():
    record = _record(1, 10.0, [0.3, 0.4, 0.01, 0.1, 0.2, 0.05])
    record["stamps"]["reply_first_text"] = record["stamps"]["speech_end"] - 0.2  # made during the silence, held
    stages = turn_stages(record)
    assert stages["reply_text"] == 0.0 and stages["tts_audio"] == pytest.approx(0.01 + 0.1)  # from asr_done
    assert all(v >= 0 for v in stages.values())
    assert sum(stages[k] for k, *_ in STAGES) == pytest.approx(stages["total"])


def test_a_turn_still_in_flight_shows_its_missing_stages_as_dashes():
    record = _record(1, 10.0, [0.3, 0.4, 0.01, 0.1])  # no frame released yet
    html = render_panel([record])
    assert '<td data-stage="speaking_frame">–</td>' in html and '<td data-stage="total">–</td>' in html


@pytest.mark.parametrize("asked, device, placement, backend, replays", [
    (True, "cuda", None, "triton", True),  # one GPU, this process
    (True, "cuda", (0,), "triton", True),  # diffusion on GPU 0, decoder on GPU 1
    (True, "cuda", (0, 1), "triton", False),  # tensor-parallel ranks step eagerly
    (True, "cuda", None, "torch", False),  # no Triton: no graph
    (True, "cpu", None, "torch", False),
    (False, "cuda", None, "triton", False)])
def test_the_engine_step_replays_as_a_cuda_graph_only_where_it_can(monkeypatch, asked, device, placement, backend, replays):
    from types import SimpleNamespace

    import torch

    import app.engine_host as host
    from engine.config import get_spec
    from engine.distributed import Placement

    monkeypatch.setattr(host, "pick_backend", lambda *args: backend)
    fake = SimpleNamespace(config=AppConfig(cuda_graph=asked), device=torch.device(device), spec=get_spec("demo"),
                           placement=None if placement is None else Placement(diffusion=placement, decoders=(2,)))
    assert host.EngineHost._graph_replay(fake) is replays


def test_the_bench_lists_the_turns_it_did_not_time_with_their_status():
    from lab.app_bench import undelivered_turns

    records = [{"turn_id": 1, "user_text": "What is your name?", "status": "completed", "stamps": {"client_delivered": 1.0}},
               {"turn_id": 2, "user_text": "My favourite colour is green", "status": "interrupted", "stamps": {}},
               {"turn_id": 3, "user_text": "what is yours?", "stamps": {"client_delivered": 2.0}},
               {"turn_id": 4, "user_text": "Do you", "stamps": {}}]
    delivered = [records[0], records[2]]
    assert undelivered_turns(records, delivered) == [
        {"turn": 2, "transcript": "My favourite colour is green", "status": "interrupted"},
        {"turn": 4, "transcript": "Do you", "status": "unfinished"}]


def test_the_bench_scores_each_question_by_the_transcript_that_heard_most_of_it():
    from lab.app_bench import word_recall

    questions = ["What is your name?", "Do you like music?"]
    assert word_recall(questions, ["What is your name?", "", "do you like music"]) == 1.0
    # the first word lost from one question, the last from the other; a question heard twice counts its best
    assert word_recall(questions, ["is your name", "Do you like", "Do you like music"]) == pytest.approx((0.75 + 1.0) / 2)
    assert word_recall(questions, ["is your name", "Do you like"]) == pytest.approx((0.75 + 0.75) / 2)
    assert word_recall(questions, []) == 0.0


def test_the_bench_leaves_no_temporary_folder_behind(tmp_path, monkeypatch, capsys):
    import tempfile

    import app.controller
    import voice.samples
    from lab.app_bench import main

    class EngineThatFails:
        def __init__(self, config) -> None:
            pass

        def failures(self) -> list[str]:
            return ["engine failed to start: no memory"]

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(voice.samples, "sample_speech", lambda text: np.zeros(1600, np.float32))
    monkeypatch.setattr(app.controller, "Controller", EngineThatFails)
    assert main(["--spec", "tiny", "--utterances", "1"]) == 2
    assert "no memory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # the questions' WAV and the session log went with their folder


# Recording -----------------------------------------------------------------------------------------
def test_recording_survives_and_lists(tmp_path):
    rec = SessionRecorder(tmp_path, "abc", fps=24, size=(32, 32), meta={"preset": "mika"})
    for i in range(48):
        rec.write_frame(np.full((32, 32, 3), i * 5, np.uint8), np.zeros(667 if i % 3 else 666, np.float32))
    rec.add_line("user", 1, "hi there")
    rec.add_line("assistant", 1, "hello")
    with open(rec.trace_path, "a") as f:
        f.write(json.dumps({"session_id": "abc", "turn_id": 1, "stamps": {"speech_end": 1.0}}) + "\n")
    # Before close (as after a crash) the transcript and trace are already on disk.
    found = list_recordings(tmp_path)
    assert len(found) == 1 and [line["text"] for line in found[0].transcript()] == ["hi there", "hello"]
    rec.close({"fps": 24.0})
    rec2 = find_recording(tmp_path, found[0].folder.name)
    assert rec2.meta["preset"] == "mika" and rec2.meta["engine"]["fps"] == 24.0
    assert rec2.trace()[0]["turn_id"] == 1 and "mika" in rec2.label
    with open(rec.trace_path, "a") as f:  # a last line cut short by a crash or a full disk
        f.write('{"session_id": "abc", "turn_id": 2, "sta')
    assert [r["turn_id"] for r in rec2.trace()] == [1]
    with pytest.raises(ValueError, match="no recorded session named 'nope'"):
        find_recording(tmp_path, "nope")
    assert not list(rec2.folder.glob("*.tmp"))  # session.json is replaced whole, not rewritten in place
    rec.add_line("assistant", 1, "hel", interrupted=True)  # cut back after a barge-in: the last line of a reply wins
    rec.add_line("user", 2, "hi there")
    assert [(r["role"], r["text"], r.get("interrupted")) for r in rec2.transcript()] == [
        ("user", "hi there", None), ("assistant", "hel", True), ("user", "hi there", None)]
    for damaged in ('["not", "an", "object"]', '{"preset": "sol", "started": "noon", "ended": 5}'):
        (rec2.folder / "session.json").write_text(damaged)  # the list still shows it, without its length
        [again] = list_recordings(tmp_path)
        assert again.label.endswith(", unfinished)")


def test_a_reply_cut_short_is_in_the_transcript_and_its_recording(tmp_path):
    from app.live import LiveSession, VoiceModels
    from app.ui import _messages
    from tests.test_voice_loop import LONG_REPLY, ScriptedAgent, question, wait_for
    from voice.asr import WhisperASR
    from voice.loop import feed_audio
    from voice.tts import PiperTTS
    from voice.loop import VoiceLoopConfig

    class Character:  # takes the speech; the session's video is not the point here
        next_frame = 0
        pushed = clears = 0

        def push_audio(self, pcm, rate):
            self.pushed += 1

        def clear(self):
            self.clears += 1

        def stop(self, session_log=None):
            return {}

    character = Character()
    live = LiveSession(character, None, "ada")
    live.recorder = SessionRecorder(tmp_path, live.session_id, 24, (32, 32), {"preset": "ada"})
    live.attach_voice(VoiceModels(WhisperASR(device="cpu"), PiperTTS(use_cuda=False),
                                  ScriptedAgent(LONG_REPLY, ["Sure, I'm listening."]),
                                  # espeak-ng's questions, fed at once; each scripted reply made once, at the end of its turn
                                  VoiceLoopConfig(turn_detection="silence", preemptive_generation=False)))
    feed_audio(live.voice, question("Tell me a long story."), real_time=False)
    assert wait_for(lambda: character.pushed >= 1)
    time.sleep(1.5)  # into the first sentence (about 4 s of speech)
    feed_audio(live.voice, question("Stop, please wait."), real_time=False)
    assert wait_for(lambda: character.clears == 1) and live.voice.wait_idle(30)
    assert wait_for(lambda: not live.voice.is_speaking)  # the answer heard out: a Stop before that would cut it too
    live.stop(None)
    [cut] = [line for line in live.transcript if line.interrupted]
    # what was spoken, word by word, not all it wrote
    assert cut.text and cut.text.split() == LONG_REPLY[0].split()[: len(cut.text.split())]
    assert any(m["content"] == cut.text + " (interrupted)" for m in _messages(live.transcript))
    rows = [json.loads(line) for line in (live.recorder.folder / "transcript.jsonl").read_text().splitlines()]
    # the cut line is written when the reply's books close, which on a loaded machine can follow the next question;
    # a reply all written before the cut (still playing) has its whole line first: the turn's last line wins
    users = [r for r in rows if r["role"] == "user"]
    replies = list({r["turn_id"]: r for r in rows if r["role"] == "assistant"}.values())
    assert len(users) == 2 and len(replies) == 2
    assert replies[0]["text"] == cut.text and replies[0]["interrupted"] is True
    assert replies[1]["text"] == "Sure, I'm listening." and "interrupted" not in replies[1]


def test_a_voice_loop_that_fails_to_close_does_not_keep_the_rest_open(tmp_path):
    from app.live import LiveSession

    stopped = []

    class Character:
        def stop(self, session_log=None):
            stopped.append(True)
            return {"fps": 24.0}

    class Voice:
        def close(self):
            raise OSError(28, "No space left on device")

    live = LiveSession(Character(), None, "ada")
    live.recorder = SessionRecorder(tmp_path, live.session_id, 24, (32, 32), {"preset": "ada"})
    live.voice = Voice()
    assert live.stop(None) == {"fps": 24.0} and stopped and live.closed.is_set()
    assert json.loads((live.recorder.folder / "session.json").read_text())["ended"] > 0  # the recording was closed


def test_microphone_audio_for_a_session_being_replaced_is_dropped_not_fatal():
    """A preset switch or a restart closes the old session's voice loop while the browser still streams its
    microphone to the old peer: the peer's reader reads on, dropping the audio, instead of dying on the closed loop."""
    import asyncio
    from types import SimpleNamespace

    import av
    from aiortc.mediastreams import MediaStreamError

    from app.live import LiveSession, VoiceModels
    from app.rtc import Peer
    from voice.loop import VoiceLoopConfig

    class Character:
        def __init__(self):
            self.heard = []

        def listen(self, pcm):
            self.heard.append(pcm)

        def stop(self, session_log=None):
            return {}

    class Microphone:  # the browser's track: 20 ms frames at 48 kHz, then the connection closes
        def __init__(self, frames: int) -> None:
            self.left, self.read = frames, 0

        async def recv(self) -> av.AudioFrame:
            if self.left == 0:
                raise MediaStreamError
            self.left -= 1
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 960), np.int16), format="s16", layout="mono")
            frame.sample_rate, frame.pts = 48000, 960 * self.read
            self.read += 1
            return frame

    live = LiveSession(Character(), None, "ada")
    live.attach_voice(VoiceModels(asr=object(), tts=object(), agent=object(),
                                  loop=VoiceLoopConfig(turn_detection="silence")))  # no speech: unused
    live.feed_mic(np.full(320, -0.5, np.float32), 16000)
    with pytest.raises(ValueError):  # while the session runs, the loop's refusals still reach the caller
        live.feed_mic(np.full(320, np.nan, np.float32), 16000)
    assert live.mic_peak == 0.5  # the loudest sample the loop took (lab.app_bench reports it); the refused chunk is not one
    assert len(live.character.heard) == 1  # the character listened to the chunk the loop took
    live.stop(None)
    microphone = Microphone(frames=5)
    asyncio.run(asyncio.wait_for(Peer._read_mic(SimpleNamespace(live=live), microphone), 10))
    assert microphone.read == 5  # read to the end of the stream


# Failures are shown --------------------------------------------------------------------------------
def _config(tmp_path, **changes) -> AppConfig:
    return build_config(None, dict(spec="tiny", device="cpu", recordings_dir=str(tmp_path / "rec"),
                                   session_log=str(tmp_path / "sessions.jsonl"), **changes))


def test_missing_voice_models_are_shown_and_the_engine_still_runs(tmp_path):
    from app.controller import Controller

    controller = Controller(_config(tmp_path, asr_model=str(tmp_path / "no-such-model")))
    try:
        assert any("speech recognition model missing" in f and "no-such-model" in f for f in controller.failures())
        live = controller.start("sol")
        deadline = time.monotonic() + 20
        while live.character.playout.stats.released < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live.character.playout.stats.released >= 10 and live.voice is None
    finally:
        controller.close()


def test_a_failed_restart_is_no_longer_shown_once_a_session_runs(tmp_path):
    from app.controller import Controller

    controller = Controller(_config(tmp_path, asr_model=str(tmp_path / "no-such-model")))
    try:
        controller.engine_error = "restart failed: talkloop-diffusion-0 died"  # as the page's Restart sets it
        controller.start("ada")
        assert not any("restart failed" in f for f in controller.failures())
    finally:
        controller.close()


def test_the_spare_engine_is_replaced_when_it_lost_a_process_and_closed_with_the_app(tmp_path):
    import multiprocessing

    from app.controller import Controller

    controller = Controller(_config(tmp_path, tp=1, asr_model=str(tmp_path / "no-such-model")))
    host = controller.host
    try:
        controller.start("ada")  # takes the spare made at start-up; a new spare is made behind it
        deadline = time.monotonic() + 60
        while host._spare is None and time.monotonic() < deadline:
            time.sleep(0.1)
        spare = host._spare
        assert spare is not None
        spare.kill_process("talkloop-diffusion-0")  # lost while idle, unseen
        time.sleep(0.5)
        live = controller.start("kofi")  # before: failed once with "talkloop-diffusion-0 died"
        assert live.engine is not spare and spare.closed
        while live.character.playout.stats.released < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live.character.playout.stats.released >= 8
    finally:
        controller.close()
    deadline = time.monotonic() + 60  # a spare still being made when the app closed is closed once it is ready
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert host._spare is None and not multiprocessing.active_children()


def test_a_recording_that_cannot_start_leaves_no_engine_running(tmp_path):
    import threading

    from app.controller import Controller

    engines = lambda: sum(t.name == "talkloop-engine" and t.is_alive() for t in threading.enumerate())
    (tmp_path / "rec").write_text("a file where the recordings folder should be")
    controller = Controller(_config(tmp_path, asr_model=str(tmp_path / "no-such-model")))
    try:
        before = engines()
        with pytest.raises(OSError, match="rec"):
            controller.start("ada", record=True)
        assert controller.live is None and engines() == before
    finally:
        controller.close()


def test_local_microphone_without_a_sound_device_is_a_message_not_a_crash(tmp_path):
    from app.controller import Controller

    controller = Controller(_config(tmp_path, audio_input="local"))
    try:
        controller.start()
        if controller.local_mic is not None:
            pytest.skip("this machine has a working input device")
        assert any("local microphone unavailable" in f for f in controller.failures())
        assert controller.live is not None
    finally:
        controller.close()


def test_engine_worker_death_is_shown_the_log_kept_and_restart_works(tmp_path):
    from app.controller import Controller

    controller = Controller(_config(tmp_path, tp=1, record=True))
    try:
        live = controller.start("kofi")
        deadline = time.monotonic() + 60
        while live.character.playout.stats.released < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert live.character.playout.stats.released >= 8
        live.engine.kill_process("talkloop-diffusion-0")  # the rank dies mid-session
        assert live.closed.wait(60)  # the failed session closes itself
        assert controller.live is None and controller.health()["state"] == "failed"
        assert any("engine stopped" in f and "died" in f for f in controller.failures())
        logged = [json.loads(line) for line in (tmp_path / "sessions.jsonl").read_text().splitlines()]
        assert len(logged) == 1 and logged[0]["steps"] >= 2
        assert list_recordings(tmp_path / "rec")[0].meta["ended"] > 0  # the recording was closed, not lost

        again = controller.restart()
        assert again.preset == "kofi" and controller.failures() == []
        deadline = time.monotonic() + 60
        while again.character.playout.stats.released < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert again.character.playout.stats.released >= 8
    finally:
        controller.close()


def test_the_app_serves_and_shuts_down_cleanly_on_interrupt(tmp_path):
    import signal
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "app", "--spec", "tiny", "--device", "cpu", "--port", str(port),
                             "--recordings-dir", str(tmp_path / "rec")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, body = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/talkloop/client-config", timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        assert json.loads(body)["audio_input"] == "browser"
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10).read().decode()
        assert "talkloop" in page
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert f"talkloop: http://127.0.0.1:{port}" in err


def test_av_offset_is_withheld_while_the_engine_is_below_real_time(tmp_path):
    from app.controller import Controller

    controller = Controller(_config(tmp_path))
    try:
        controller.start()
        controller.stop()
        shown = controller.shown()
        # A stalled stream's estimates are not comparable; the figure is the median of the latest five reports.
        shown.av_offsets_ms.extend([-201325.0, 900.0, 900.0, 900.0, 5.0, 7.0, 6.0, 8.0, 9.0])
        shown.stats = {**(shown.stats or {}), "fps": 24.0, "fps_recent": 2.1}  # stalling now
        assert controller.health()["av_offset_ms"] == "n/a (engine below real time)"
        shown.stats.update(fps=20.0, fps_recent=24.0)  # a slow start, real time now
        assert controller.health()["av_offset_ms"] == 7
    finally:
        controller.close()


def test_the_page_says_when_the_live_engine_falls_below_real_time(tmp_path, monkeypatch):
    from app.controller import Controller

    controller = Controller(_config(tmp_path))
    try:
        live = controller.start()
        # the live engine's own figures, as a busy machine would make them (live.stats is set only once stopped)
        monkeypatch.setattr(live.character, "stats", lambda: {"fps": 20.0, "fps_recent": 10.3, "steps": 60})
        said = controller.health()["real_time"]
        assert said.startswith("NO") and "10.3 of 24" in said and "--spec demo-cpu" in said  # tiny: a smaller one exists
        # frames held for the voice's sake: released at 24 a second, 11.5 of them new pictures
        monkeypatch.setattr(live.character, "stats", lambda: {"fps": 24.0, "fps_recent": 24.0, "video_fps_recent": 11.5,
                                                                "frames_held": 300, "steps": 60})
        health = controller.health()
        assert health["real_time"].startswith("NO") and "11.5 of 24" in health["real_time"]
        assert "the voice keeps time" in health["real_time"] and health["frames_held"] == 300
        monkeypatch.setattr(live.character, "stats", lambda: {"fps": 24.0, "fps_recent": 24.0, "steps": 60})
        assert controller.health()["real_time"] == "yes"
    finally:
        monkeypatch.undo()
        controller.close()


# The HLS fallback ----------------------------------------------------------------------------------
def test_hls_fallback_streams_the_live_session_as_playable_segments(tmp_path):
    """transport: hls — a live session's released frames become 1-second H.264 + AAC segments whose
    timestamps run on from one segment to the next; the page builds with the streaming video."""
    import av

    from app.controller import Controller
    from app.hls import LiveSegments
    from app.ui import build_ui

    controller = Controller(_config(tmp_path, transport="hls"))
    try:
        demo = build_ui(controller)
        assert demo.delete_cache == (3600, 86400)  # replayed recordings' cached copies do not pile up
        controller.start("ada", False)
        segments = LiveSegments(controller, 24, root=tmp_path / "hls")
        stream = segments.stream()
        paths = [next(stream) for _ in range(2)]
        segments.close()
    finally:
        controller.close()
    starts = []
    for path in paths:
        with av.open(path) as container:
            kinds = sorted(s.type for s in container.streams)
            assert kinds == ["audio", "video"] and container.streams.video[0].codec_context.name == "h264"
            frames = [f for f in container.decode(video=0)]
            assert len(frames) == 24
            starts.append(float(frames[0].time))
    assert abs(starts[1] - starts[0] - 1.0) < 0.01  # the second segment picks up where the first ended


class FakeLive:
    """A live session as the HLS stream sees it: listeners, and whether it has ended."""

    def __init__(self) -> None:
        import threading

        self.closed = threading.Event()

    def add_listener(self, *listeners) -> None:
        pass

    def remove_listener(self, *listeners) -> None:
        pass


def test_hls_stream_waits_for_a_slow_first_step_and_ends_with_the_session(tmp_path):
    """A first step that compiles kernels or captures a CUDA graph may take longer than any fixed wait: the stream
    waits while the session runs, and ends when it has ended."""
    import threading

    from app.hls import SegmentStream
    from engine.audio import SAMPLE_RATE
    from engine.realtime import AVFrame

    live = FakeLive()
    stream = SegmentStream(live, tmp_path, 24, seconds=0.5)
    segments = stream.segments(0.05)  # looks for the session's end every 50 ms
    first: list[str | None] = []
    waiting = threading.Thread(target=lambda: first.append(next(segments, None)))
    waiting.start()
    time.sleep(0.5)  # ten looks and no frame yet
    for i in range(13):  # a segment's 12, and the next frame, which tells the segment is not the last
        stream._on_frame(AVFrame(i, np.zeros((32, 32, 3), np.uint8), np.zeros(SAMPLE_RATE // 24, np.float32), False), 0.0)
    waiting.join(10)
    assert first and first[0] is not None and first[0].endswith("segment_00000.ts")
    live.closed.set()
    rest = list(segments)  # the session ended: its last frame makes the last segment, and the stream ends
    assert len(rest) == 1 and rest[0].endswith("segment_00001.ts")
    stream.close()


def test_hls_segments_audio_joins_without_overlap_or_gap(tmp_path):
    """Each segment's audio starts where the previous one's ended (one AAC encoder across segments): a new encoder
    per segment would start each with its priming, 64 ms early, and neighbours would overlap."""
    import av

    from app.hls import SegmentStream
    from engine.audio import SAMPLE_RATE
    from engine.realtime import AVFrame

    stream = SegmentStream(FakeLive(), tmp_path, 24, seconds=0.5)
    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(SAMPLE_RATE * 2) / SAMPLE_RATE).astype(np.float32)
    per_frame = SAMPLE_RATE // 24
    for i in range(48):
        stream._on_frame(AVFrame(i, np.zeros((32, 32, 3), np.uint8), tone[i * per_frame:(i + 1) * per_frame], True), 0.0)
    segments = stream.segments(0.1)
    paths = [next(segments) for _ in range(3)]
    stream.close()
    spans = []
    for path in paths:
        with av.open(path) as container:
            packets = [p for p in container.demux(audio=0) if p.pts is not None]
            spans.append((packets[0].pts, packets[-1].pts + packets[-1].duration))
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start == end  # in 1/90000 s


def test_the_last_hls_segment_carries_the_audio_to_the_end(tmp_path):
    """The shared AAC encoder holds its last ~1024 samples until flushed: the session's last segment gets them, so
    its audio runs as long as its video."""
    import av

    from app.hls import SegmentStream
    from engine.audio import SAMPLE_RATE
    from engine.realtime import AVFrame

    live = FakeLive()
    stream = SegmentStream(live, tmp_path, 24, seconds=0.5)
    per_frame = SAMPLE_RATE // 24
    for i in range(24):
        stream._on_frame(AVFrame(i, np.zeros((32, 32, 3), np.uint8), np.full(per_frame, 0.1, np.float32), True), 0.0)
    live.closed.set()  # the session ended after its 24th frame
    paths = list(stream.segments(0.1))
    assert len(paths) == 2
    with av.open(paths[-1]) as container:
        video = [p for p in container.demux(video=0) if p.pts is not None]
    with av.open(paths[-1]) as container:
        audio = [p for p in container.demux(audio=0) if p.pts is not None]
    video_end = max(p.pts + p.duration for p in video) * float(video[0].time_base)
    audio_end = max(p.pts + p.duration for p in audio) * float(audio[0].time_base)
    assert audio_end >= video_end - 0.01, (audio_end, video_end)


def test_the_voice_track_sends_one_opus_packet_per_frame_on_the_frames_clock():
    """aiortc's sender gives every packet of one recv() the same RTP timestamp, so each audio frame the track sends
    must be one 20 ms Opus packet; its timestamps follow the video frames' (a gap where a slow peer lost frames)."""
    import asyncio

    from aiortc.codecs.opus import OpusEncoder

    from app.rtc import PACKET_SAMPLES, FrameQueue, PlayoutAudioTrack
    from engine.audio import SAMPLE_RATE, frame_sample
    from engine.realtime import AVFrame

    async def run() -> list:
        queue = FrameQueue(asyncio.get_running_loop())
        track = PlayoutAudioTrack(24, queue)
        indices = [*range(10, 16), *range(40, 64)]  # frames 16-39 lost on the way
        for i in indices:
            pcm = np.full(frame_sample(i + 1) - frame_sample(i), 0.1, np.float32)
            queue._put(AVFrame(i, np.zeros((4, 4, 3), np.uint8), pcm, True))
        return [await asyncio.wait_for(track.recv(), 10) for _ in range(30)]

    frames = asyncio.run(run())
    assert all(f.samples == PACKET_SAMPLES and f.sample_rate == SAMPLE_RATE for f in frames)
    gap_at = frame_sample(40) - frame_sample(10)
    pts = [f.pts for f in frames]
    before = [p for p in pts if p < gap_at]
    assert before == [k * PACKET_SAMPLES for k in range(len(before))]
    assert 10 <= len(before) < 30 and pts[len(before)] == gap_at and all(b - a == PACKET_SAMPLES for a, b in zip(pts[len(before):], pts[len(before) + 1:]))
    encoder = OpusEncoder()
    packets = [len(encoder.encode(f)[0]) for f in frames]
    assert max(packets) == 1, packets


def test_the_page_builds_without_gradio_warnings(tmp_path):
    """The page and its server, for either transport, use no Gradio setting that is deprecated or has moved (theme and
    head go where the page is served in Gradio 6, not to Blocks)."""
    import warnings

    from app.controller import Controller
    from app.server import build_app

    for transport in ("webrtc", "hls"):
        controller = Controller(_config(tmp_path, transport=transport))
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                build_app(controller)
        finally:
            controller.close()
        notices = [f"{w.category.__name__}: {w.message}" for w in caught
                   if issubclass(w.category, (DeprecationWarning, FutureWarning, UserWarning))]
        assert not notices, (transport, notices)


def test_the_browser_microphone_settings_reach_the_page():
    """The page asks for the microphone with the constraints the settings give: the browser's gain control off by
    default (it cut first and last words), echo cancellation on; each a flag. So does the page's own barge-in."""
    import types

    from fastapi.testclient import TestClient

    from app.__main__ import parse_args
    from app.server import build_api

    def page_config(config: AppConfig) -> dict:
        with TestClient(build_api(types.SimpleNamespace(config=config))) as client:
            return client.get("/talkloop/client-config").json()

    assert page_config(AppConfig()) == {"audio_input": "browser", "microphone": {
        "echoCancellation": True, "autoGainControl": False, "noiseSuppression": False}, "interruption_ms": 80}
    flags = build_config(*parse_args(["--mic-auto-gain", "--mic-noise-suppression", "--no-mic-echo-cancellation",
                                      "--client-interruption-ms", "0"]))
    assert page_config(flags)["microphone"] == {"echoCancellation": False, "autoGainControl": True, "noiseSuppression": True}
    assert page_config(flags)["interruption_ms"] == 0


def test_hls_microphone_chunks_become_mono_float():
    from app.hls import mic_chunk_to_float

    stereo = np.array([[32767, -32767], [0, 0], [16384, 16384]], dtype=np.int16)
    pcm, rate = mic_chunk_to_float((48000, stereo))
    assert rate == 48000 and pcm.dtype == np.float32 and np.allclose(pcm, [0.0, 0.0, 0.5], atol=1e-4)
    assert mic_chunk_to_float(None) is None and mic_chunk_to_float((16000, np.zeros(0, np.int16))) is None


def test_unknown_transport_is_named(tmp_path):
    with pytest.raises(ValueError, match="transport must be webrtc or hls"):
        build_config(None, {"transport": "carrier-pigeon"})


# Signalling routes ---------------------------------------------------------------------------------
def test_offers_replace_the_previous_viewer_and_shutdown_closes_the_last(monkeypatch):
    import types

    from fastapi.testclient import TestClient

    import app.rtc
    from app.server import build_api

    made = []

    class FakePeer:
        def __init__(self, controller, live, loop):
            self.closed = False
            made.append(self)

        async def answer(self, sdp, kind):
            if sdp == "garbage":  # what aiortc raises for an offer that is not SDP
                raise ValueError("None is not in list")
            return types.SimpleNamespace(sdp="answer to " + sdp, type="answer")

        async def close(self):
            self.closed = True

    monkeypatch.setattr(app.rtc, "Peer", FakePeer)
    controller = types.SimpleNamespace(config=AppConfig(), live=None, client_error=None)
    with TestClient(build_api(controller)) as client:
        assert client.post("/talkloop/offer", json={"sdp": "x", "type": "offer"}).status_code == 409  # not started
        assert client.post("/talkloop/offer", json={"sdp": 1}).status_code == 400
        controller.live = object()
        assert client.post("/talkloop/offer", json={"sdp": "v=0", "type": "offer"}).json() == {"sdp": "answer to v=0", "type": "answer"}
        client.post("/talkloop/offer", json={"sdp": "v=1", "type": "offer"})
        assert [p.closed for p in made] == [True, False]  # one viewer at a time
        refused = client.post("/talkloop/offer", json={"sdp": "garbage", "type": "offer"})
        assert refused.status_code == 400 and "could not answer the offer" in refused.json()["error"]
        assert [p.closed for p in made] == [True, True, True]  # the half-made peer is closed at once
    assert [p.closed for p in made] == [True, True, True]


def test_an_offer_aiortc_cannot_answer_gets_a_clear_400_and_no_peer_is_left(monkeypatch):
    import types

    from fastapi.testclient import TestClient

    import app.rtc
    from app.server import build_api

    pytest.importorskip("aiortc")
    made = []

    class RealConnectionPeer(app.rtc.Peer):  # the real answer(), on a real RTCPeerConnection
        def __init__(self, controller, live, loop):
            super().__init__(controller, live, loop)
            made.append(self)

    monkeypatch.setattr(app.rtc, "Peer", RealConnectionPeer)
    live = types.SimpleNamespace(add_listener=lambda *a: None, remove_listener=lambda *a: None, session_id="s",
                                 character=types.SimpleNamespace(spec=types.SimpleNamespace(fps=24)))
    controller = types.SimpleNamespace(config=AppConfig(), live=live, client_error=None)
    with TestClient(build_api(controller)) as client:
        refused = client.post("/talkloop/offer", json={"sdp": "not sdp at all", "type": "offer"})
    assert refused.status_code == 400 and refused.json()["error"].startswith("could not answer the offer")
    assert made and all(p.closed for p in made)


def test_a_chosen_chromium_is_used_or_named_when_it_is_not_there(tmp_path, monkeypatch):
    from lab.browser import CHROMIUM_ENV, chromium_path

    monkeypatch.setenv(CHROMIUM_ENV, str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match=f"{CHROMIUM_ENV}=.*missing is not an executable file"):
        chromium_path()
    shell = tmp_path / "chromium-headless-shell"
    shell.write_text("#!/bin/sh\n")
    shell.chmod(0o755)
    monkeypatch.setenv(CHROMIUM_ENV, str(shell))
    assert chromium_path() == str(shell)
