"""One live conversation: a character, a voice loop, an optional recording, and the pump
that takes frames from the engine's playout buffer to the browser and the recording.

The voice loop's reply audio goes to the character (`EngineSink`); picture and sound then
leave the playout buffer together, one frame every 1/24 s. The pump stamps each turn's
first speaking frame when it is released; the browser reports when that speech played.
The user's microphone audio goes to the voice loop and to the character, which listens.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from app.recorder import SessionRecorder
from engine.audio import to_mono_16k
from engine.realtime import AVFrame, RealtimeCharacter
from voice.loop import LoopEvent, VoiceLoop, VoiceLoopConfig
from voice.personas import persona_for
from voice.trace import now
from voice.turn import SmartTurn

log = logging.getLogger(__name__)

FrameListener = Callable[[AVFrame, float], None]
TurnListener = Callable[[int, float], None]
InterruptListener = Callable[[int], None]


class EngineSink:
    """The voice loop's audio sink: reply speech goes to the character."""

    def __init__(self, character: RealtimeCharacter):
        self.character = character
        self.speech_from_frame: int | None = None  # the first frame the newest reply speech can land on

    def push_audio(self, pcm: np.ndarray, sample_rate: int) -> float:
        if self.speech_from_frame is None:
            self.speech_from_frame = self.character.next_frame
        return self.character.push_audio(pcm, sample_rate)

    def clear(self) -> None:
        self.speech_from_frame = None
        self.character.clear()


@dataclass
class VoiceModels:
    """Models loaded once for the app's life; each session makes its own loop over them."""

    asr: object
    tts: object
    agent: object
    loop: VoiceLoopConfig  # each session's loop settings (its trace file is the session's own)
    turn_model: SmartTurn | None = None  # the end-of-turn model, with turn_detection smart_turn
    llm_choice: str | None = None  # with llm auto: which language model was taken, and why


@dataclass
class TranscriptLine:
    turn_id: int
    role: str  # "user" or "assistant"
    text: str
    final: bool = False
    interrupted: bool = False  # an assistant reply cut short: text is what was sent to be spoken


@dataclass
class LiveSession:
    character: RealtimeCharacter
    engine: object | None  # the DistributedEngine, when the engine runs in its own processes
    preset: str
    recorder: SessionRecorder | None = None
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    voice: VoiceLoop | None = None
    transcript: list[TranscriptLine] = field(default_factory=list)
    failure: str | None = None  # why the session ended early (the engine stopped)
    stats: dict | None = None
    stop_errors: list[str] = field(default_factory=list)  # what failed while stop() closed the session
    started: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.sink = EngineSink(self.character)
        self._listeners: list[FrameListener] = []
        self._turn_listeners: list[TurnListener] = []
        self._interrupt_listeners: list[InterruptListener] = []
        self._lock = threading.Lock()
        self._pump: threading.Thread | None = None
        self.av_offsets_ms: deque[float] = deque(maxlen=30)  # the browser's video - audio playout estimates
        self.mic_peak = 0.0  # the loudest microphone sample fed (full scale 1.0): the browser's gain shows in it
        self.stopping = threading.Event()  # set when stop() begins: the voice loop is about to close
        self.closed = threading.Event()  # set once stop() has closed everything
        self.on_failure: Callable[["LiveSession"], None] | None = None

    # Set-up ---------------------------------------------------------------------------------
    def attach_voice(self, models: VoiceModels, name: str | None = None) -> None:
        """A voice loop over the shared models, the agent speaking as this session's preset (or `name`)."""
        config = replace(models.loop, output_sample_rate=16000,
                         trace_path=str(self.recorder.trace_path) if self.recorder else None)
        agent = models.agent
        if hasattr(agent, "for_persona"):
            agent = agent.for_persona(persona_for(self.preset, name))
        self.voice = VoiceLoop(self.sink, agent=agent, asr=models.asr, tts=models.tts, config=config,
                               on_event=self._on_voice_event, turn_model=models.turn_model)

    def start(self) -> None:
        self._pump = threading.Thread(target=self._run_pump, name="talkloop-pump", daemon=True)
        self._pump.start()

    # Listeners (WebRTC peers) ------------------------------------------------------------------
    def add_listener(self, frames: FrameListener, turns: TurnListener,
                     interrupts: InterruptListener | None = None) -> None:
        """frames: every released frame; turns: a turn's first speaking frame; interrupts: the voice loop cut a
        reply short because the user spoke over it (the page silences what it still has buffered)."""
        with self._lock:
            self._listeners.append(frames)
            self._turn_listeners.append(turns)
            if interrupts is not None:
                self._interrupt_listeners.append(interrupts)

    def remove_listener(self, frames: FrameListener, turns: TurnListener,
                        interrupts: InterruptListener | None = None) -> None:
        with self._lock:
            if frames in self._listeners:
                self._listeners.remove(frames)
            if turns in self._turn_listeners:
                self._turn_listeners.remove(turns)
            if interrupts in self._interrupt_listeners:
                self._interrupt_listeners.remove(interrupts)

    # Audio in -----------------------------------------------------------------------------------
    def feed_mic(self, pcm: np.ndarray, sample_rate: int) -> None:
        """To the voice loop, and (as 16 kHz mono) to the character, which listens. The browser streams on to a
        session being stopped (a preset switch, a restart) until it reconnects: from then on its chunks are
        dropped. A malformed chunk is a ValueError, as from the loop."""
        if self.failure is not None or self.stopping.is_set():
            return
        if self.voice is not None:
            try:
                self.voice.feed(pcm, sample_rate)
            except RuntimeError:  # "VoiceLoop is closed": stop() closed it after the check above
                if not self.stopping.is_set():
                    raise
                return
            self.mic_peak = max(self.mic_peak, float(np.max(np.abs(pcm))))  # the loop took it: not empty, finite
        self.character.listen(to_mono_16k(pcm, sample_rate))

    def mark_turn(self, turn_id: int, name: str, t: float) -> None:
        """A stamp from outside the server (the browser's delivery report), on this session's clock."""
        if self.voice is None:
            return
        try:
            self.voice.trace.mark(turn_id, name, t)
        except KeyError:
            log.warning("stamp %s for unknown turn %s", name, turn_id)

    # The pump -----------------------------------------------------------------------------------
    def _run_pump(self) -> None:
        try:
            for frame in self.character.frames(timeout=1.0):
                t = now()
                self._stamp_speaking(frame, t)
                with self._lock:
                    listeners = list(self._listeners)
                for listener in listeners:
                    listener(frame, t)
                if self.recorder is not None:
                    self.recorder.write_frame(frame.rgb, frame.pcm)
        except Exception as e:  # the engine loop or a worker process died
            self.failure = f"engine stopped: {e}"
            log.error("%s", self.failure)
            if self.on_failure is not None:
                self.on_failure(self)

    def _stamp_speaking(self, frame: AVFrame, t: float) -> None:
        start = self.sink.speech_from_frame
        if start is None or not frame.speaking or frame.index < start or self.voice is None:
            return
        self.sink.speech_from_frame = None
        turn = next((tt for tt in reversed(list(self.voice.trace.turns)) if "tts_first_audio" in tt.stamps), None)
        if turn is None or "first_speaking_frame" in turn.stamps:
            return
        self.voice.trace.mark(turn.turn_id, "first_speaking_frame", t)
        with self._lock:
            listeners = list(self._turn_listeners)
        for listener in listeners:
            listener(turn.turn_id, t)

    # Transcript -----------------------------------------------------------------------------------
    def _on_voice_event(self, event: LoopEvent) -> None:
        if event.kind == "barge_in":
            with self._lock:
                listeners = list(self._interrupt_listeners)
            for listener in listeners:
                listener(event.turn_id)
            return
        with self._lock:
            if event.kind in ("user_partial", "user_final"):
                line = self._line(event.turn_id, "user")
                line.text, line.final = event.text, event.kind == "user_final"
                if line.final and self.recorder is not None and event.text:
                    self.recorder.add_line("user", event.turn_id, event.text)
                if line.final and not event.text:
                    self.transcript.remove(line)
            elif event.kind == "agent_text":
                self._line(event.turn_id, "assistant").text += event.text
            elif event.kind == "agent_done":
                line = self._line(event.turn_id, "assistant")
                line.text, line.final = event.text, True
                if self.recorder is not None:
                    self.recorder.add_line("assistant", event.turn_id, event.text)
            elif event.kind == "agent_interrupted":  # may follow the turn's agent_done: its line is cut back
                line = self._line(event.turn_id, "assistant")
                line.text, line.final, line.interrupted = event.text, True, True
                if not event.text:  # none of it was heard
                    self.transcript.remove(line)
                if self.recorder is not None:  # the last line of a turn's reply wins on replay
                    self.recorder.add_line("assistant", event.turn_id, event.text, interrupted=True)
            elif event.kind == "error":
                self.transcript.append(TranscriptLine(event.turn_id, "error", event.text, True))

    def _line(self, turn_id: int, role: str) -> TranscriptLine:
        for line in reversed(self.transcript):
            if line.turn_id == turn_id and line.role == role:
                return line
        line = TranscriptLine(turn_id, role, "")
        self.transcript.append(line)
        return line

    def turn_records(self) -> list[dict]:
        return [t.to_record() for t in list(self.voice.trace.turns)] if self.voice is not None else []

    # Stop ---------------------------------------------------------------------------------------
    def stop(self, session_log: str | None) -> dict:
        """Stop voice, engine and pump; the engine's figures go to the session log; the recording is closed.
        Each step runs whatever the one before it raised: what failed is kept in `stop_errors`, never raised."""
        if self.stats is not None:
            return self.stats
        self.stopping.set()
        try:
            if self.voice is not None:
                self._stop_step("closing the voice loop", self.voice.close)
            try:
                self.stats = self.character.stop(session_log=session_log)
            except Exception as e:  # the session log must not stop the shutdown
                log.exception("stopping the character failed")
                self.stop_errors.append(f"stopping the character failed: {e}")
                self.stats = {"error": str(e)}
            if self._pump is not None:
                self._stop_step("waiting for the frame pump", lambda: self._pump.join(timeout=5))
            if self.engine is not None:
                self._stop_step("closing the engine", self.engine.close)
            if self.recorder is not None:
                failure = "; ".join(f for f in (self.failure, *self.stop_errors) if f) or None
                self._stop_step("closing the recording", lambda: self.recorder.close(self.stats, failure))
        finally:
            self.closed.set()  # the HLS stream waits on it
        return self.stats

    def _stop_step(self, what: str, step: Callable[[], object]) -> None:
        try:
            step()
        except Exception as e:  # the steps after this one still run
            log.exception("%s failed", what)
            self.stop_errors.append(f"{what} failed: {e}")
