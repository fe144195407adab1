"""The app's state: the engine host, the voice models, the live session, and what failed.

One person talks to one character at a time: Start makes a new live session (a fresh
character on the chosen preset and a fresh voice loop over the shared models), Stop
ends it. Failures are kept as text for the page to show, never swallowed.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from app.config import AppConfig
from app.engine_host import AUTO_SPECS, EngineHost
from app.live import LiveSession, VoiceModels
from app.recorder import SessionRecorder
from engine.session_log import default_log

log = logging.getLogger(__name__)

RECENT_SYNC_REPORTS = 5  # the browser's sync reports (one a second) that health's figure is the median of


SMALL_MACHINE_CORES = 2  # llm auto: at most this many cores, the lighter model (docs/app.md, "Sharing the CPU")


def llm_device(config: AppConfig) -> str:
    """Where the language model is asked to run: the CPU with the engine's --device cpu, else llm_device."""
    return "cpu" if config.device == "cpu" else config.llm_device


def choose_llm(config: AppConfig, cores: int | None = None) -> tuple[str, str]:
    """llm auto: the 1.5B, except where its replies would come late and the 0.5B is installed: on a machine of
    SMALL_MACHINE_CORES cores or fewer, with the model on the CPU, the engine, speech and the browser leave it
    too little to answer in time (docs/app.md, "Sharing the CPU"). Returns the model and why."""
    from voice.llm import DEFAULT_MODEL, MODELS, installed, runs_on_gpu

    if config.llm != "auto":
        return config.llm, "chosen"
    cores = cores or os.cpu_count() or 1
    if runs_on_gpu(llm_device(config)) or cores > SMALL_MACHINE_CORES:
        return DEFAULT_MODEL, f"auto: {cores} cores"
    light = "qwen2.5-0.5b"
    if installed(light):
        return light, f"auto: {cores} CPU cores, where the 1.5B's replies come later (--llm qwen2.5-1.5b for it)"
    return DEFAULT_MODEL, (f"auto: {cores} CPU cores; the lighter {light} answers sooner here: {MODELS[light].install}")


def load_voice_models(config: AppConfig) -> VoiceModels:
    """ASR, TTS and the agent; ValueError naming what is missing."""
    from voice.agent import OpenAIChatAgent
    from voice.asr import WhisperASR
    from voice.llm import LocalLLM, LocalLLMAgent
    from voice.personas import persona_for
    from voice.loop import VoiceLoopConfig
    from voice.tts import PiperTTS
    from voice.turn import SmartTurn
    from voice.vad import VADConfig

    # The engine's --device cuda need not hold for the voice models (their CUDA builds are separate).
    device = "cpu" if config.device == "cpu" else "auto"
    try:
        asr = WhisperASR(model=config.asr_model, device=device)
    except Exception as e:
        raise ValueError(f"speech recognition model missing or unreadable: {e}") from e
    try:
        tts = PiperTTS(model_path=config.voice, use_cuda=False if device == "cpu" else None)
    except Exception as e:
        raise ValueError(f"text-to-speech voice missing or unreadable: {e}") from e
    persona = persona_for(config.preset, config.name)
    why = None
    if config.agent == "openai":
        agent = OpenAIChatAgent(base_url=config.base_url, model=config.model, system_prompt=config.system_prompt,
                                persona=persona)
    else:
        model, why = choose_llm(config)
        log.info("language model: %s (%s)", model, why)
        try:
            llm = LocalLLM(model, threads=config.llm_threads, device=llm_device(config))
        except (ValueError, OSError) as e:
            raise ValueError(f"language model missing or unreadable: {e}") from e
        agent = LocalLLMAgent(llm, persona, prompt_template=config.system_prompt)
    loop = VoiceLoopConfig(
        vad=VADConfig(threshold=config.vad_threshold, min_silence_ms=config.min_silence_ms, speech_pad_ms=config.preroll_ms),
        turn_detection=config.turn_detection, min_endpointing_delay=config.min_endpointing_delay,
        max_endpointing_delay=config.max_endpointing_delay, statement_endpointing_delay=config.statement_endpointing_delay,
        check_words=config.check_words,
        preemptive_generation=config.preemptive_generation)
    try:
        turn_model = SmartTurn() if loop.turn_detection == "smart_turn" else None
    except Exception as e:
        raise ValueError(f"end-of-turn model missing or unreadable: {e}") from e
    asr.warm_up()
    tts.warm_up()
    prepare = getattr(agent, "prepare", None)
    if prepare is not None:  # the system prompt read into the model's cache once, not at the first question
        prepare([])
    return VoiceModels(asr, tts, agent, loop, turn_model, llm_choice=why if config.llm == "auto" else None)


class Controller:
    def __init__(self, config: AppConfig):
        self.config = config
        self.session_log = config.session_log or str(default_log())
        self.engine_error: str | None = None
        self.voice_error: str | None = None
        self.client_error: str | None = None
        self.mic_error: str | None = None
        self.live: LiveSession | None = None
        self.last: LiveSession | None = None  # the session before, kept for its transcript and latency
        self._lock = threading.RLock()
        self.host: EngineHost | None = None
        try:
            self.host = EngineHost(config)
        except Exception as e:
            log.exception("engine failed to start")
            self.engine_error = f"engine failed to start: {e}"
        try:
            self.voice = load_voice_models(config)
        except ValueError as e:
            log.error("%s", e)
            self.voice, self.voice_error = None, str(e)
        self.local_mic = None

    # Sessions -----------------------------------------------------------------------------------
    def start(self, preset: str | None = None, record: bool | None = None) -> LiveSession:
        with self._lock:
            if self.host is None:
                raise RuntimeError(self.engine_error or "the engine is not running")
            self.stop()
            preset = preset or self.config.preset
            record = self.config.record if record is None else record
            character, engine = self.host.new_character(preset)  # started: stopped below if the rest fails
            live = LiveSession(character, engine, preset)
            try:
                if record:
                    live.recorder = SessionRecorder(self.config.recordings_dir, live.session_id, self.host.spec.fps,
                                                    self.host.spec.image_size,
                                                    {"preset": preset, "spec": self.host.spec.name, "device": str(self.host.device),
                                                     "trained_weights": self.host.trained})
                if self.voice is not None:
                    live.attach_voice(self.voice, self.config.name)
                live.on_failure = self._on_failure
                live.start()
            except BaseException:  # e.g. a recordings folder that cannot be made: no engine left running behind
                live.stop(session_log=None)
                raise
            # a session running clears what an earlier start or restart failed with (the page would show it forever)
            self.live, self.client_error, self.engine_error = live, None, None
            if self.config.audio_input == "local":
                self._start_local_mic(live)
            return live

    def stop(self) -> dict | None:
        with self._lock:
            live, self.live = self.live, None
            if self.local_mic is not None:
                mic, self.local_mic = self.local_mic, None
                try:
                    mic.close()
                except Exception as e:  # a sound device unplugged: the session is stopped all the same
                    log.exception("closing the local microphone failed")
                    self.mic_error = f"closing the local microphone failed: {e}"
            if live is None:
                return None
            self.last = live  # shown (stopping, stopped or failed) from now on
            return live.stop(self.session_log)

    def restart(self, preset: str | None = None, record: bool | None = None) -> LiveSession:
        """After an engine failure: the failed session is closed (its log and recording kept), a new one starts."""
        with self._lock:
            failed = self.live or self.last
            preset = preset or (failed.preset if failed else None)
            if self.host is None:
                self.engine_error = None
                self.host = EngineHost(self.config)
            return self.start(preset, record)

    def _on_failure(self, live: LiveSession) -> None:
        # Called from the pump thread: close what is left so the session log and recording are written now.
        def close() -> None:
            with self._lock:
                if self.live is live:
                    self.stop()
        threading.Thread(target=close, name="talkloop-failed-session", daemon=True).start()

    def _start_local_mic(self, live: LiveSession) -> None:
        from app.local_mic import LocalMicrophone

        try:
            self.local_mic = LocalMicrophone(live.feed_mic)
            self.mic_error = None
        except RuntimeError as e:
            self.mic_error = str(e)

    # What the page shows ------------------------------------------------------------------------
    def shown(self) -> LiveSession | None:
        return self.live or self.last

    def failures(self) -> list[str]:
        shown = self.shown()
        found = [self.engine_error, self.voice_error, self.mic_error, self.client_error,
                 shown.failure if shown else None, *(shown.stop_errors if shown else ()),
                 shown.recorder.error if shown and shown.recorder else None,
                 shown.voice.trace.error if shown and shown.voice else None]
        return [f for f in found if f]

    def health(self) -> dict[str, Any]:
        host = self.host
        out: dict[str, Any] = {"spec": host.spec.name if host is not None else self.config.spec}
        if host is not None and host.choice is not None:
            out["spec_choice"] = f"auto: {host.choice}"
        if self.voice is not None and hasattr(self.voice.agent, "describe"):
            out["replies"] = self.voice.agent.describe()
            if self.voice.llm_choice is not None:
                out["replies_choice"] = self.voice.llm_choice
        if host is not None:
            out.update(device=str(host.device), placement=host.placement_text,
                       weights="trained" if host.trained else "random (no trained weights shipped yet)")
        shown = self.shown()
        if shown is not None:
            stats = shown.stats if shown.stats is not None else shown.character.stats()
            out.update(state="live" if shown is self.live else ("failed" if shown.failure else "stopped"),
                       step_ms_p50=round(stats.get("step_ms_p50", 0.0), 1), step_ms_p95=round(stats.get("step_ms_p95", 0.0), 1),
                       fps=round(stats.get("fps", 0.0), 1), fps_recent=round(stats.get("fps_recent", 0.0), 1),
                       buffer_depth=stats.get("buffer_depth"), lead=stats.get("lead"),
                       underruns=stats.get("underruns"), steps=stats.get("steps"))
            # Frames the engine was too late to make go out as the picture before them (hold_when_late): the
            # sound keeps time, and the share of new pictures says how far below real time the engine is.
            video_fps = round(stats.get("video_fps_recent", stats.get("fps_recent", 0.0)), 1)
            if stats.get("frames_held"):
                out.update(video_fps_recent=video_fps, frames_held=stats["frames_held"])
            # The browser reports once a second: the latest reports span the playout's recent window (5 s).
            fps = shown.character.spec.fps
            if shown is self.live and (stats.get("steps") or 0) >= 12 and video_fps < 0.95 * fps:  # past 2 s
                smallest = AUTO_SPECS[-1]
                advice = (f"a busy machine, or a character too large for it (--spec {smallest})" if out["spec"] != smallest
                          else "a busy machine: the engine shares its cores with the browser and the voice models")
                kept = "; the voice keeps time, the picture holds between them" if stats.get("frames_held") else ""
                out["real_time"] = f"NO: the engine makes {video_fps} of {fps} frames a second here{kept}; {advice}"
            elif shown is self.live:
                out["real_time"] = "yes"
            offsets = sorted(list(shown.av_offsets_ms)[-RECENT_SYNC_REPORTS:])
            if offsets and out["fps_recent"] < 0.95 * shown.character.spec.fps:
                # Below real time the stream stalls between bursts and the browser's playout
                # estimates for the two tracks stop being comparable: no figure beats a wrong one.
                out["av_offset_ms"] = "n/a (engine below real time)"
            else:
                out["av_offset_ms"] = round(offsets[len(offsets) // 2]) if offsets else None
        else:
            out["state"] = "idle"
        return out

    def close(self) -> None:
        try:
            self.stop()
        finally:  # the engine's processes end with the app whatever stopping the session raised
            if self.host is not None:
                self.host.close()
