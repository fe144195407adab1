"""The voice turn loop: VAD -> ASR -> agent -> TTS -> sink, with barge-in and traces.

Threads: the caller's thread runs `feed()` (conversion + VAD, ~0.1 ms per 32 ms
window). Two ASR workers decode the growing turn: cheap previews for the partial
transcript while the user talks, full-quality decodes for the final one. A
reply worker streams agent text into TTS sentence by sentence and pushes audio
into the sink. Workers sleep on a condition or a queue, never poll.

Latency hinges on what happens during the min_silence_ms wait that decides
the end of the turn. As soon as VAD sees a silence begin, a worker transcribes
everything fed so far; with that transcript the reply starts at once
(preemptive generation, as LiveKit Agents calls it): generated and synthesized,
but its text, stamps and audio held until the turn ends with the same words.
If the user goes on, or the final transcript differs, it is dropped and the
reply is made again from the final words.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import numpy as np

from engine.audio import SAMPLE_RATE, StreamResampler, resample, to_mono_float32

from .agent import ReplyAgent
from .asr import WhisperASR
from .personas import in_character
from .spoken import spoken_stream
from .trace import SessionTrace, TurnTrace, now
from .tts import PiperTTS, SentenceSplitter
from .turn import SmartTurn, asks_something, unfinished_words
from .vad import WINDOW, StreamingVAD, VADConfig

log = logging.getLogger(__name__)

# Exchanges kept for the agent, which carries a window of the latest: the list only grows within a session (a few
# kB an exchange), so an agent can place its window by the count and keep its prompt prefix for several turns.
MAX_CONVERSATION = 2000


_PREPARE = object()  # on the reply queue: let the agent read the latest partial transcript


@runtime_checkable
class AudioSink(Protocol):
    """Where reply speech goes (the engine, a WebRTC track, a file)."""

    def push_audio(self, pcm: np.ndarray, sample_rate: int) -> float | None:
        """Queue float32 mono reply audio for playback; must return quickly and not
        call back into the loop (it is called with the loop's lock held). Returns when the
        audio is expected to start playing (time.monotonic), where the sink knows (a playout
        buffer's lead); None means as soon as the audio queued before it ends."""
        ...

    def clear(self) -> None:
        """Drop all queued reply audio at once (barge-in)."""
        ...


class RecordingSink:
    """A sink that keeps what it is given: for the CLI, the benchmark and tests."""

    def __init__(self) -> None:
        self.pushes: list[tuple[float, np.ndarray, int]] = []  # (monotonic time, pcm, rate)
        self.clears: list[float] = []
        self._lock = threading.Lock()

    def push_audio(self, pcm: np.ndarray, sample_rate: int) -> None:
        with self._lock:
            self.pushes.append((now(), pcm, sample_rate))

    def clear(self) -> None:
        with self._lock:
            self.clears.append(now())

    def audio(self, since: float = 0.0) -> np.ndarray:
        with self._lock:
            parts = [pcm for t, pcm, _ in self.pushes if t >= since]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


@dataclass(frozen=True)
class LoopEvent:
    """kind: speech_start, user_partial, user_final, agent_text (a chunk), agent_done (the full reply),
    agent_interrupted (a reply cut short: what of it was heard; after its agent_done when it was all
    synthesized already), barge_in, turn_ignored, error."""

    kind: str
    turn_id: int
    text: str = ""


TURN_DETECTION = ("smart_turn", "silence")


@dataclass(frozen=True)
class VoiceLoopConfig:
    vad: VADConfig = field(default_factory=VADConfig)
    # End of turn (LiveKit's names). "smart_turn": once the user has been silent for min_endpointing_delay, the
    # Smart Turn model judges their audio; a complete turn ends as soon as it answers, an incomplete one is judged
    # again every `turn_recheck_s` of silence and ends at max_endpointing_delay at the latest. "silence":
    # vad.min_silence_ms of silence alone ends a turn.
    turn_detection: str = "smart_turn"
    min_endpointing_delay: float = 0.2
    max_endpointing_delay: float = 1.6
    turn_recheck_s: float = 0.3
    # The model was trained on turns that end in ~0.2 s of silence: a shorter silence is shown padded to this.
    turn_model_silence_s: float = 0.2
    # Asked this long before min_endpointing_delay (on the audio so padded), so that its verdict, which takes
    # 0.05-0.3 s on a CPU, is in when the silence reaches min_endpointing_delay; a complete turn ends then.
    turn_model_lead_s: float = 0.1
    turn_threshold: float = 0.5  # Smart Turn's probability of a complete turn at or above which it ends
    # With check_words: a complete turn whose words are not a question ends only at this much silence, as a
    # statement may open a question ("My favourite colour is green, what is yours?"); the reply begun at the
    # pause is made meanwhile, so little of the wait is heard.
    statement_endpointing_delay: float = 0.8
    # A complete verdict waits while the newest transcript of the turn cannot end it (voice/turn.py, unfinished_words).
    check_words: bool = True
    partial_interval_s: float = 0.7  # re-transcribe the growing turn this often while the user talks
    output_sample_rate: int = 16000  # the engine takes 16 kHz; WebRTC wants 48 kHz
    barge_in: bool = True
    first_clause_min_words: int = 1  # the reply's first clause is spoken at a comma once it has this many words
    # until this many words have gone, each clause goes at first_clause_min_words (1: the first clause only)
    reply_lead_words: int = 8
    # Start the reply at the user's pause, before the end of the turn is confirmed; speak it once it is.
    preemptive_generation: bool = True
    # An agent that can (a local model) reads the user's words while they speak, so its reply starts sooner.
    read_ahead: bool = True
    max_chunk_s: float = 60.0  # longest single feed() call
    trace_path: str | None = None  # JSON-lines file of turn traces

    def __post_init__(self) -> None:
        if self.turn_detection not in TURN_DETECTION:
            raise ValueError(f"turn_detection must be one of {', '.join(TURN_DETECTION)}, got {self.turn_detection!r}")
        if not 0 < self.min_endpointing_delay < self.max_endpointing_delay:
            raise ValueError("need 0 < min_endpointing_delay < max_endpointing_delay, got "
                             f"{self.min_endpointing_delay}, {self.max_endpointing_delay}")
        if not self.turn_recheck_s > 0:
            raise ValueError(f"turn_recheck_s must be > 0, got {self.turn_recheck_s}")
        if not 0 <= self.turn_model_lead_s < self.min_endpointing_delay:
            raise ValueError(f"turn_model_lead_s must be >= 0 and below min_endpointing_delay ({self.min_endpointing_delay}), "
                             f"got {self.turn_model_lead_s}")
        if not self.min_endpointing_delay <= self.statement_endpointing_delay < self.max_endpointing_delay:
            raise ValueError("need min_endpointing_delay <= statement_endpointing_delay < max_endpointing_delay, got "
                             f"{self.min_endpointing_delay}, {self.statement_endpointing_delay}, {self.max_endpointing_delay}")
        if not 0 < self.turn_threshold < 1:
            raise ValueError(f"turn_threshold must be between 0 and 1, got {self.turn_threshold}")

    def vad_for_turns(self) -> VADConfig:
        """The VAD as the loop runs it: with smart_turn, its own silence rule is the max_endpointing_delay."""
        if self.turn_detection == "silence":
            return self.vad
        return replace(self.vad, min_silence_ms=round(self.max_endpointing_delay * 1000))


class _AudioHistory:
    """Ring of the most recent input samples, addressed by absolute sample index."""

    def __init__(self, capacity: int) -> None:
        self._buf = np.zeros(capacity, dtype=np.float32)
        self.total = 0

    @property
    def first(self) -> int:
        return max(0, self.total - self._buf.shape[0])

    def append(self, samples: np.ndarray) -> None:
        cap = self._buf.shape[0]
        if samples.shape[0] > cap:  # only the newest cap samples can be kept
            self.total += samples.shape[0] - cap
            samples = samples[-cap:]
        n = samples.shape[0]
        pos = self.total % cap
        head = min(n, cap - pos)
        self._buf[pos : pos + head] = samples[:head]
        self._buf[: n - head] = samples[head:]
        self.total += n

    def slice(self, start: int, end: int) -> np.ndarray:
        start, end = max(start, self.first), min(end, self.total)
        if end <= start:
            return np.zeros(0, dtype=np.float32)
        cap = self._buf.shape[0]
        idx = np.arange(start, end) % cap
        return self._buf[idx]


@dataclass
class _Attempt:
    """A reply begun on the transcript made at the user's pause, before the end of the turn is confirmed. It runs
    like any reply, but its events and stamps are held, and its audio waits, until the turn ends with the same words
    (confirmed); when the user goes on or the final words differ, it is dropped and `stop` ends it."""

    turn: "_Turn"
    text: str
    stop: threading.Event = field(default_factory=threading.Event)
    confirmed: bool = False
    held_events: list[LoopEvent] = field(default_factory=list)
    held_stamps: dict[str, float] = field(default_factory=dict)


@dataclass
class _Turn:
    trace: TurnTrace
    start: int  # first sample of the turn's audio (pre-roll included)
    end: int = -1  # last sample, once VAD ended the turn
    voiced_end: int = -1  # end of the last voiced window
    pause_at: int = -1  # where a silence began while the user was still in the turn
    judge_at: int = -1  # smart_turn: the next sample of silence at which the end-of-turn model is asked
    complete_at: int = -1  # smart_turn: judged complete; the turn ends once the silence reaches this sample
    words_awaited: int = -1  # smart_turn: judged complete, the verdict waits for a decode of the words up to here
    last_voiced_t: float = 0.0
    ended: bool = False
    transcripts: list[tuple[int, str, float]] = field(default_factory=list)  # (covered up to sample, text, decode start)
    words: tuple[int, str] = (0, "")  # the newest decode of any kind: (covered up to sample, text)
    inflight: list[tuple[int, str]] = field(default_factory=list)  # (covered up to sample, kind) of running decodes
    last_job_t: float = -1e9
    last_job_until: int = 0
    final_text: str | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    audio_pushed: bool = False
    spoken: list[str] = field(default_factory=list)  # reply sentences whose audio reached the sink
    spoken_at: list[float] = field(default_factory=list)  # when each of them starts to play (the loop's estimate)
    spoken_s: list[float] = field(default_factory=list)  # and how long each plays
    barge_in_t: float | None = None  # when the user cut the reply short
    finished: bool = False
    attempt: _Attempt | None = None  # a reply begun at the user's pause

    def cancel(self) -> None:
        """End the turn's reply, or the one begun early, at the agent's next token."""
        self.cancelled.set()
        if self.attempt is not None:
            self.attempt.stop.set()

    def heard_audio_s(self, reply_audio_s: float) -> float:
        """Seconds of the reply's audio the user heard: all of it, or with a cut, what played before it (each
        sentence's share played by then: the pauses between sentences are not audio)."""
        if self.barge_in_t is None or not self.spoken_at:
            return reply_audio_s
        cut = self.barge_in_t
        played = sum(min(seconds, max(0.0, cut - at)) for at, seconds in zip(self.spoken_at, self.spoken_s))
        return min(reply_audio_s, played)

    def heard_span_s(self) -> float:
        """From the start of the reply's first sentence to the end of what played before the cut (the pauses
        between sentences included): how long the voice ran, as a recording shows it."""
        if not self.spoken_at:
            return 0.0
        cut = self.barge_in_t if self.barge_in_t is not None else float("inf")
        ends = [min(at + seconds, cut) for at, seconds in zip(self.spoken_at, self.spoken_s) if at < cut]
        return max(ends, default=self.spoken_at[0]) - self.spoken_at[0]

    def heard(self) -> str:
        """The reply as far as the user heard it: every sentence sent to be spoken, or with a cut (a barge-in, a
        Stop), the sentences played by then and the words of the one playing in the share of its audio played
        (synthesis runs ahead of playback, so a reply can be whole in the sink and cut short at the ear)."""
        cut = self.barge_in_t
        said: list[str] = []
        for sentence, at, seconds in zip(self.spoken, self.spoken_at, self.spoken_s):
            if cut is None or at + seconds <= cut:
                said.append(sentence)
                continue
            words = sentence.split()
            played = int(len(words) * max(0.0, cut - at) / seconds) if seconds > 0 else 0
            if played:
                said.append(" ".join(words[:played]))
            break
        return " ".join(said)

    @property
    def turn_id(self) -> int:
        return self.trace.turn_id


class VoiceLoop:
    """Feed 16 kHz mono PCM (other rates/channels are converted); replies go to `sink`.

    `on_event` receives LoopEvent objects from worker threads (keep it quick).
    Models load once per process; pass `asr`, `tts` or `agent` to share or replace them.
    """

    def __init__(
        self,
        sink: AudioSink,
        agent: ReplyAgent | None = None,
        asr: WhisperASR | None = None,
        tts: PiperTTS | None = None,
        config: VoiceLoopConfig | None = None,
        on_event: Callable[[LoopEvent], None] | None = None,
        trace: SessionTrace | None = None,
        turn_model: SmartTurn | None = None,
    ) -> None:
        self.config = config or VoiceLoopConfig()
        self.sink = sink
        if agent is None:
            from .llm import default_agent

            agent = default_agent()
        self.agent = agent
        self.asr = asr if asr is not None else WhisperASR()
        self.tts = tts if tts is not None else PiperTTS()
        self.on_event = on_event
        self.trace = trace if trace is not None else SessionTrace(self.config.trace_path)
        self.vad = StreamingVAD(self.config.vad_for_turns())
        smart = self.config.turn_detection == "smart_turn"
        self.turn_model = (turn_model or SmartTurn()) if smart else None
        self._judging: tuple[_Turn, int, int] | None = None  # (turn, audio up to, its voiced end) for the turn model
        self._end_vad_segment = False  # the turn model ended the turn: the VAD's segment closes at the next feed
        seconds = self.config.vad.max_speech_s + 15.0
        self._history = _AudioHistory(int(seconds * SAMPLE_RATE))
        self._resampler: StreamResampler | None = None
        self._lock = threading.Lock()
        self._asr_wake = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._confirmations = threading.Condition(self._lock)  # an attempt confirmed or dropped
        self._turn: _Turn | None = None  # the turn being listened to / transcribed
        # ended turns still waiting for their final transcript while a newer one is listened to, oldest first
        self._settling: list[_Turn] = []
        self._speaking: _Turn | None = None  # the turn whose reply is being produced
        self._last_spoken: _Turn | None = None  # the last turn that pushed audio (may still be playing)
        # What was said so far, as the agent should remember it: a reply cut off by
        # barge-in counts only up to the last sentence that reached the sink.
        self.conversation: list[tuple[str, str]] = []
        self._busy = 0  # turns between end of speech and end of reply
        self._playout_until = 0.0
        self._closed = False
        # turns to answer, replies begun early, _PREPARE; None: stop
        self._replies: queue.Queue[_Turn | _Attempt | object | None] = queue.Queue()
        self._prepare_text: str | None = None  # the words of the turn being spoken, for the agent to read ahead
        self._threads = [
            threading.Thread(target=self._asr_worker, name="voice-asr-1", daemon=True),
            threading.Thread(target=self._asr_worker, name="voice-asr-2", daemon=True),
            threading.Thread(target=self._reply_worker, name="voice-reply", daemon=True),
        ]
        if self.turn_model is not None:
            self._threads.append(threading.Thread(target=self._turn_worker, name="voice-turn", daemon=True))
        for thread in self._threads:
            thread.start()

    # --- public API ---------------------------------------------------------------------------

    def feed(self, pcm: np.ndarray, sample_rate: int = SAMPLE_RATE) -> None:
        """Process one chunk of microphone audio (any length up to max_chunk_s).

        Raises ValueError for empty, NaN/inf or over-long chunks; the loop's state is
        untouched by a rejected chunk, so the stream can go on.
        """
        if self._closed:
            raise RuntimeError("VoiceLoop is closed")
        audio = to_mono_float32(pcm, sample_rate, target_rate=sample_rate, max_seconds=self.config.max_chunk_s)
        if sample_rate != SAMPLE_RATE:
            resampler = self._resampler  # close() may drop it from another thread meanwhile
            if resampler is None or resampler.from_rate != sample_rate:
                resampler = self._resampler = StreamResampler(sample_rate, SAMPLE_RATE)
            audio = resampler.process(audio)
            if audio.size == 0:
                return
        t = now()
        if self._end_vad_segment:  # set under the lock by the turn worker; the VAD is this thread's alone
            self._end_vad_segment = False
            self.vad.end_segment()
        voiced_before = self.vad.last_voiced
        vad_events = self.vad.process(audio)
        events: list[LoopEvent] = []
        with self._lock:
            self._history.append(audio)
            for ev in vad_events:
                if ev.kind == "start":
                    self._on_speech_start(ev.start, t, events)
                elif ev.kind == "end" and self._turn is not None and not self._turn.ended:
                    self._on_speech_end(ev.end, ev.last_voiced, ev.reason, t)
            turn = self._turn
            if turn is not None and not turn.ended:
                if self.vad.last_voiced > voiced_before:
                    turn.last_voiced_t = t
                    turn.voiced_end = self.vad.last_voiced
                    self._drop_attempt(turn)  # the user went on: a reply begun at their pause is stale
                    turn.complete_at = turn.words_awaited = -1  # and a verdict on that pause no longer holds
                silence = self.vad.silence_start
                turn.pause_at = silence if silence else -1
                if 0 <= turn.complete_at <= self._history.total:
                    self._end_judged_turn(turn, t)
                else:
                    self._ask_judge(turn)
            self._asr_wake.notify_all()
        self._emit(events)

    @property
    def is_speaking(self) -> bool:
        """True while a reply is being produced or its audio is still playing out."""
        with self._lock:
            return self._speaking is not None or now() < self._playout_until

    def mark(self, name: str, turn_id: int | None = None, t: float | None = None) -> float | None:
        """Stamp a named moment (e.g. first_speaking_frame, client_delivered) on a turn;
        by default the turn whose reply is speaking or spoke last."""
        if turn_id is None:
            with self._lock:
                target = self._speaking or self._last_spoken
            if target is None:
                return None
            turn_id = target.turn_id
        return self.trace.mark(turn_id, name, t)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until every ended turn has been answered (or dropped), and a pending end-of-turn judgement is in;
        False on timeout."""
        deadline = now() + timeout
        with self._idle:
            while self._busy > 0 or self._judging is not None:
                left = deadline - now()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        """Stop the workers and cut any reply where it is (a Stop): a reply being made, or one still playing, is kept
        as far as it was heard and marked interrupted, as a barge-in would leave it; safe to call twice."""
        events: list[LoopEvent] = []
        with self._lock:
            if self._closed:
                return
            self._closed = True
            t = now()
            playing = t < self._playout_until
            if self._speaking is not None or playing:
                self.sink.clear()
                self._playout_until = t
            if self._speaking is not None:
                self._speaking.barge_in_t = t  # heard() keeps what had begun to play by now
                self._speaking.trace.mark("stopped", t)
                self._speaking.trace.info.setdefault("status", "interrupted")
                self._speaking.cancel()  # the reply worker reports it and writes its trace
            elif playing and self._last_spoken is not None and self._last_spoken.barge_in_t is None:
                self._last_spoken.barge_in_t = t
                self._cut_short_after_the_fact(self._last_spoken, t, events, stamp="stopped")
            for waiting in self._settling:  # ended, their transcripts never to come now
                self._cancel(waiting, "closed")
            if self._turn is not None:
                if self._turn.ended:
                    self._cancel(self._turn, "closed")
                self._turn.cancel()
            self._asr_wake.notify_all()
            self._confirmations.notify_all()
        self._emit(events)
        self._replies.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        # feed() refuses from here on: let the resampler (a libsoxr object) go now rather than with the loop,
        # which an app thread may hold until the interpreter's exit (nanobind then reports it leaked)
        self._resampler = None

    def __enter__(self) -> "VoiceLoop":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- VAD events (called with the lock held) ------------------------------------------------

    def _on_speech_start(self, start: int, t: float, events: list[LoopEvent]) -> None:
        previous = self._turn
        speaking = self._speaking
        merged = (
            previous is not None
            and previous.ended
            and not previous.finished
            and not previous.audio_pushed
            and previous.start >= self._history.first
            and previous.trace.info.get("end_reason") != "max_speech_s"
            and start - previous.start <= self.config.vad.max_speech_s * SAMPLE_RATE / 2
        )
        if merged:
            # The user went on talking before any reply audio left: one turn, not two. Not past a cut at max_speech_s,
            # nor onto a turn already half that long: a monologue is answered in bounded turns, each one's audio
            # still in the history (which holds max_speech_s + 15 s).
            self._cancel(previous, "continued")
            start = previous.start
        elif previous is not None and previous.ended and previous.final_text is None and not previous.cancelled.is_set():
            self._settling.append(previous)  # its final transcript, and its reply, are still to come
        if not merged and self.config.barge_in and (speaking is not None or t < self._playout_until):
            if speaking is not None:
                self._cancel(speaking, "interrupted")
            self.sink.clear()
            self._playout_until = t
            interrupted = speaking or self._last_spoken
            if interrupted is not None:
                interrupted.barge_in_t = t
                events.append(LoopEvent("barge_in", interrupted.turn_id))
                if interrupted.finished:  # its reply was all in the sink, still playing: its books are closed already
                    self._cut_short_after_the_fact(interrupted, t, events)
                else:  # the reply worker closes its books
                    interrupted.trace.mark("barge_in", t)
        turn = _Turn(trace=self.trace.new_turn(), start=start, last_voiced_t=t)
        turn.trace.mark("speech_start", t)
        if merged:
            turn.trace.info["continues_turn"] = previous.turn_id
        self._turn = turn
        events.append(LoopEvent("speech_start", turn.turn_id))

    def _ask_judge(self, turn: _Turn) -> None:
        """smart_turn: wake the turn worker once the silence after the last voiced audio is long enough (lock held)."""
        if (self.turn_model is None or turn.pause_at < 0 or self._judging is not None or turn.complete_at >= 0
                or turn.words_awaited >= 0):
            return
        first = self.config.min_endpointing_delay - self.config.turn_model_lead_s
        delay = first if turn.judge_at < turn.voiced_end else 0.0
        due = max(turn.judge_at, turn.voiced_end + int(delay * SAMPLE_RATE))
        if self._history.total >= due:
            self._judging = (turn, self._history.total, turn.voiced_end)
            self._asr_wake.notify_all()

    def _turn_worker(self) -> None:
        """smart_turn: ask the model whether the turn is complete; a complete one ends once the silence reaches
        min_endpointing_delay (now, if it has), an incomplete one is asked again after turn_recheck_s more silence."""
        assert self.turn_model is not None
        while True:
            with self._lock:
                while self._judging is None and not self._closed:
                    self._asr_wake.wait()
                if self._closed:
                    return
                turn, until, voiced_end = self._judging
                audio = self._history.slice(max(turn.start, until - 8 * SAMPLE_RATE), until)
            padding = int(self.config.turn_model_silence_s * SAMPLE_RATE) - (until - voiced_end)
            if padding > 0:
                audio = np.concatenate([audio, np.zeros(padding, np.float32)])
            started = now()
            try:
                probability = self.turn_model.complete_probability(audio)
            except Exception as err:  # the silence rule still ends the turn
                log.exception("end-of-turn model failed")
                probability = None
                self._emit([LoopEvent("error", turn.turn_id, f"end-of-turn model failed: {err}")])
            with self._lock:
                self._judging = None
                self._idle.notify_all()
                if turn is not self._turn or turn.ended or turn.voiced_end != voiced_end or probability is None:
                    continue  # the user went on (their next pause is judged afresh) or the turn is over
                judged = turn.trace.info.setdefault("turn_judgements", [])
                judged.append({"silence_s": round((until - voiced_end) / SAMPLE_RATE, 3),
                               "probability": round(probability, 3), "model_s": round(now() - started, 3)})
                if probability < self.config.turn_threshold:
                    turn.judge_at = until + int(self.config.turn_recheck_s * SAMPLE_RATE)
                elif self.config.check_words and turn.words[0] < voiced_end and any(
                        covered >= voiced_end for covered, _ in turn.inflight):
                    turn.words_awaited = voiced_end  # the decode of all the words is under way: they decide
                    judged[-1]["awaited_words"] = True
                else:
                    self._judge_words(turn, until)

    def _judge_words(self, turn: _Turn, until: int) -> None:
        """A turn the model found complete (lock held): it ends once the silence reaches min_endpointing_delay
        (statement_endpointing_delay where its words, all in, ask nothing: `asks_something`), unless its newest words cannot
        end it ("When you have a moment."); then it is judged again later."""
        words = turn.words[1]
        if self.config.check_words and unfinished_words(words):
            turn.trace.info["turn_judgements"][-1]["unfinished_words"] = words
            turn.judge_at = until + int(self.config.turn_recheck_s * SAMPLE_RATE)
            self._ask_judge(turn)
            return
        delay = self.config.min_endpointing_delay
        asks = turn.words[0] >= turn.voiced_end and asks_something(words)
        if asks:
            self._note_question(turn)
        if self.config.check_words and not asks:
            # they ask nothing, or are not all in: a question's words, once in, end it sooner (_shorten_for_question)
            delay = self.config.statement_endpointing_delay
            turn.trace.info["turn_judgements"][-1]["statement" if turn.words[0] >= turn.voiced_end else "words_pending"] = True
        turn.complete_at = turn.voiced_end + int(delay * SAMPLE_RATE)
        if self._history.total >= turn.complete_at:
            self._end_judged_turn(turn, now())

    def _shorten_for_question(self, turn: _Turn) -> None:
        """A turn judged complete before its words were in waits as a statement would; once they are in and ask
        a question or a request, it ends at min_endpointing_delay (now, if the silence is that long already). Lock held."""
        if turn is not self._turn or turn.ended or turn.complete_at < 0:
            return
        self._note_question(turn)
        turn.complete_at = min(turn.complete_at, turn.voiced_end + int(self.config.min_endpointing_delay * SAMPLE_RATE))
        if self._history.total >= turn.complete_at:
            self._end_judged_turn(turn, now())

    def _note_question(self, turn: _Turn) -> None:
        """Keep, in the trace, how long the silence was when the turn's words were first all in and a question."""
        turn.trace.info.setdefault("question_heard_s", round((self._history.total - turn.voiced_end) / SAMPLE_RATE, 3))

    def _end_judged_turn(self, turn: _Turn, t: float) -> None:
        """End a turn the model judged complete (lock held); its VAD segment closes at the next feed."""
        pad = self.config.vad.speech_pad_ms * SAMPLE_RATE // 1000
        self._on_speech_end(min(turn.voiced_end + pad, self._history.total), turn.voiced_end, "smart_turn", t)
        self._end_vad_segment = True
        self._asr_wake.notify_all()

    def _on_speech_end(self, end: int, last_voiced: int, reason: str, t: float) -> None:
        turn = self._turn
        assert turn is not None
        turn.ended = True
        turn.end = end
        turn.voiced_end = last_voiced
        turn.trace.mark("last_voiced_audio", turn.last_voiced_t)
        turn.trace.mark("speech_end", t)
        turn.trace.info.update(end_reason=reason, audio_s=round((end - turn.start) / SAMPLE_RATE, 3))
        self._busy += 1

    def _cut_short_after_the_fact(self, turn: _Turn, t: float, events: list[LoopEvent], stamp: str = "barge_in") -> None:
        """A barge-in on a reply already written (lock held): its record is rewritten as interrupted, what the agent
        remembers of it is cut to what was heard, and the cut-short reply is reported."""
        said = " ".join(turn.spoken)
        for i in range(len(self.conversation) - 1, -1, -1):
            if self.conversation[i] == (turn.final_text, said):
                self.conversation[i] = (turn.final_text, turn.heard())
                break
        turn.trace.info["status"] = "interrupted"
        self._note_heard(turn)
        self.trace.mark(turn.turn_id, stamp, t)  # appends the updated record
        events.append(LoopEvent("agent_interrupted", turn.turn_id, turn.heard()))

    @staticmethod
    def _note_heard(turn: _Turn) -> None:
        """Record the text and seconds of the reply that were heard, beside what was made (lock held)."""
        if turn.audio_pushed:
            info = turn.trace.info
            info["heard_audio_s"] = round(turn.heard_audio_s(info.get("reply_audio_s", 0.0)), 3)
            if turn.barge_in_t is not None:
                info["heard_text"] = turn.heard()
                info["heard_span_s"] = round(turn.heard_span_s(), 3)

    def _cancel(self, turn: _Turn, status: str) -> None:
        turn.cancel()
        self._confirmations.notify_all()
        turn.trace.info.setdefault("status", status)
        if not turn.finished and turn is not self._speaking:
            # Nobody else will close this turn's books.
            self._finish(turn)

    def _finish(self, turn: _Turn) -> None:
        """Write the turn's trace and release wait_idle (lock held)."""
        if turn.finished:
            return
        turn.finished = True
        turn.trace.info.setdefault("status", "completed")
        self._note_heard(turn)
        if turn.spoken and turn.final_text:
            self.conversation.append((turn.final_text, turn.heard()))
            del self.conversation[:-MAX_CONVERSATION]
        self.trace.write(turn.trace)
        if turn.ended:
            self._busy -= 1
            self._idle.notify_all()

    # --- ASR worker -----------------------------------------------------------------------------

    def _asr_worker(self) -> None:
        """Two of these run, matching the ASR model's two workers. Each takes the most
        urgent job: a full decode when a silence began or the turn ended and nothing
        decoded or decoding covers the voiced audio; else, while the user talks and
        nothing else is decoding, a cheaper preview for the partial transcript. A
        decode made stale by the user talking on never makes the next one wait."""
        while True:
            events: list[LoopEvent] = []
            with self._lock:
                job = None
                while not self._closed:
                    self._settle_final(events)
                    if events:
                        break
                    job, wait = self._next_asr_job()
                    if job is not None:
                        break
                    self._asr_wake.wait(wait)
                if self._closed:
                    return
                if job is not None:
                    turn, until, kind = job
                    audio = self._history.slice(turn.start, until)
                    started = turn.last_job_t = now()
                    turn.last_job_until = max(turn.last_job_until, until)
                    turn.inflight.append((until, kind))
            self._emit(events)
            if job is None:
                continue
            try:
                text = self.asr.transcribe(audio)
            except Exception as err:  # a failed decode must not kill the loop
                log.exception("transcription failed")
                self._emit([LoopEvent("error", turn.turn_id, f"speech recognition failed: {err}")])
                text = ""
            with self._lock:
                turn.inflight.remove((until, kind))
                self._asr_wake.notify_all()
                if turn.cancelled.is_set():
                    continue
                if kind == "final":
                    turn.transcripts.append((until, text, started))
                if until >= turn.words[0]:
                    turn.words = (until, text)
                if 0 <= turn.words_awaited <= until and turn is self._turn and not turn.ended:
                    turn.words_awaited = -1
                    self._judge_words(turn, self._history.total)
                elif until >= turn.voiced_end and asks_something(text):
                    self._shorten_for_question(turn)
                turn.trace.info[f"asr_{kind}_decodes"] = turn.trace.info.get(f"asr_{kind}_decodes", 0) + 1
                partial = not turn.ended
            if partial and text:
                self._emit([LoopEvent("user_partial", turn.turn_id, text)])
                # A final decode of a turn not ended: a silence began, most likely these are all their words.
                if not (kind == "final" and self._begin_early(turn, until, text)):
                    self._ask_prepare(text)

    def _next_asr_job(self) -> tuple[tuple[_Turn, int, str] | None, float | None]:
        """(turn, decode up to sample, 'final' or 'preview'), or how long to sleep (lock held)."""
        for waiting in self._settling:  # older turns' final transcripts first
            if not waiting.cancelled.is_set() and waiting.final_text is None and not self._final_covered(waiting):
                return (waiting, waiting.end, "final"), None
        turn = self._turn
        if turn is None or turn.cancelled.is_set() or turn.final_text is not None:
            return None, None
        covered = self._final_covered(turn)
        if not covered:
            if turn.ended:
                return (turn, turn.end, "final"), None
            if turn.pause_at >= 0:
                return (turn, self._history.total, "final"), None  # a silence began: get ahead of the end of turn
        if turn.ended or turn.inflight:
            return None, None
        if self._history.total - turn.last_job_until < 4 * WINDOW:
            return None, None  # too little new audio to be worth a decode
        due = turn.last_job_t + self.config.partial_interval_s - now()
        if due <= 0:
            return (turn, self._history.total, "preview"), None
        return None, due

    def _final_covered(self, turn: _Turn) -> bool:
        """A final transcript of the turn's voiced audio is in, or on its way (lock held)."""
        needed = self._needed(turn)
        return any(entry[0] >= needed for entry in turn.transcripts) or any(
            until >= needed for until, kind in turn.inflight if kind == "final")

    @staticmethod
    def _needed(turn: _Turn) -> int:
        """A transcript is final once it covers the last voiced window plus one more."""
        needed = turn.voiced_end + WINDOW
        return min(turn.end, needed) if turn.ended else needed

    def _settle_final(self, events: list[LoopEvent]) -> None:
        """Ended turns, oldest first, take a transcript that covers all their voiced audio; one still waiting for
        its transcript holds back the newer ones, so that replies come in the order the turns were spoken (lock held)."""
        self._settling = [t for t in self._settling if t.final_text is None and not t.cancelled.is_set()]
        for turn in [*self._settling, self._turn]:
            if turn is None or not self._settle(turn, events):
                break
        self._settling = [t for t in self._settling if t.final_text is None and not t.cancelled.is_set()]

    def _settle(self, turn: _Turn, events: list[LoopEvent]) -> bool:
        """The turn's final transcript taken, its reply queued (or the turn ignored); False while it waits (lock held)."""
        if turn.final_text is not None or turn.cancelled.is_set():
            return True
        if not turn.ended:
            return False
        needed = self._needed(turn)
        covering = [entry for entry in turn.transcripts if entry[0] >= needed]
        if not covering:
            return False
        until, turn.final_text, started = max(covering)
        # Positive: the final decode began during the silence wait, ahead of the end of turn.
        turn.trace.info["final_decode_lead_s"] = round(turn.trace.stamps["speech_end"] - started, 3)
        turn.trace.mark("asr_done")
        turn.trace.info["user_text"] = turn.final_text
        heard = LoopEvent("user_final", turn.turn_id, turn.final_text)
        attempt = turn.attempt
        if attempt is not None and not attempt.stop.is_set() and attempt.text == turn.final_text:
            # The reply begun at the pause answers these words: it goes on, and is let out. Its held events go out
            # from the reply worker, after this one, so a page sees the user's words before the reply's.
            attempt.confirmed = True
            attempt.held_events.insert(0, heard)
            for name, t in attempt.held_stamps.items():
                turn.trace.mark(name, t)
            turn.trace.info["preemptive"] = True
            self._speaking = turn
            self._confirmations.notify_all()
            return True
        self._drop_attempt(turn)
        events.append(heard)
        if not turn.final_text:
            # Noise or a cough that VAD let through: no words, no reply.
            turn.trace.info["status"] = "ignored"
            events.append(LoopEvent("turn_ignored", turn.turn_id))
            self._finish(turn)
            return True
        self._replies.put(turn)
        return True

    def _begin_early(self, turn: _Turn, until: int, text: str) -> bool:
        """From an ASR worker, with the transcript made at the user's pause: begin the reply to it now, while the
        end of the turn is still being decided. False where it cannot begin (the setting is off, the turn ended or
        went on meanwhile, or another reply is being made)."""
        if not self.config.preemptive_generation:
            return False
        with self._lock:
            if (self._closed or turn is not self._turn or turn.ended or turn.cancelled.is_set() or turn.pause_at < 0
                    or until < self._needed(turn) or self._speaking is not None or self._reply_waiting()):
                return False
            if turn.attempt is not None and not turn.attempt.stop.is_set():
                if turn.attempt.text == text:
                    return True  # already begun on these words
                self._drop_attempt(turn)
            turn.attempt = _Attempt(turn, text)
            self._replies.put(turn.attempt)
        return True

    def _reply_waiting(self) -> bool:
        """A turn or a reply begun early is queued for the reply worker (a read-ahead request does not count)."""
        with self._replies.mutex:
            return any(item is not _PREPARE for item in self._replies.queue)

    def _drop_attempt(self, turn: _Turn) -> None:
        """The reply begun at the pause answers words that are not the turn's (lock held): end it unheard."""
        attempt = turn.attempt
        if attempt is None or attempt.confirmed:
            return
        attempt.stop.set()
        turn.attempt = None
        turn.trace.info["replies_dropped"] = turn.trace.info.get("replies_dropped", 0) + 1
        self._confirmations.notify_all()

    # --- reply worker ---------------------------------------------------------------------------

    def _prepare_agent(self, user_text: str | None = None) -> None:
        """Let an agent that can (a local model) evaluate the next turn's prompt now, while nobody waits for it: the
        conversation so far, and with user_text the words of the turn heard so far. It stops as soon as a reply is
        asked for (what it read stays in the model's cache for the reply to reuse)."""
        prepare = getattr(self.agent, "prepare", None)
        if prepare is None or self._closed:
            return
        with self._lock:
            history = list(self.conversation)
        try:
            prepare(history, user_text, stop=lambda: self._closed or not self._replies.empty())
        except Exception:  # a reply will still be made, only later
            log.exception("agent prepare failed")

    def _ask_prepare(self, user_text: str) -> None:
        """From an ASR worker: the reply worker reads the user's words so far into the agent, if it is idle."""
        if not self.config.read_ahead or getattr(self.agent, "prepare", None) is None:
            return
        with self._lock:
            if self._speaking is not None:
                return
            self._prepare_text = user_text
        self._replies.put(_PREPARE)

    def _reply_worker(self) -> None:
        self._prepare_agent()
        while True:
            item = self._replies.get()
            if item is None:
                return
            if item is _PREPARE:
                with self._lock:
                    text, self._prepare_text = self._prepare_text, None
                if text is not None and self._replies.empty():  # no reply waits behind it
                    self._prepare_agent(text)
                continue
            attempt = item if isinstance(item, _Attempt) else None
            turn = attempt.turn if attempt is not None else item
            with self._lock:
                if attempt is not None and not attempt.confirmed and attempt.stop.is_set():
                    continue  # dropped before it began: the turn is still being spoken, or answered afresh
                if turn.cancelled.is_set() or self._closed:
                    if self._speaking is turn:
                        self._speaking = None
                    self._finish(turn)
                    continue
                if attempt is None:
                    self._speaking = turn
            try:
                self._reply(turn, attempt)
            except Exception as err:  # an agent or TTS failure ends this reply, not the loop
                log.exception("reply failed")
                with self._lock:
                    if attempt is not None and not attempt.confirmed:
                        self._drop_attempt(turn)  # the turn's own reply is made at its end
                if attempt is None or attempt.confirmed:
                    turn.trace.info["status"] = "error"
                    turn.trace.info["error"] = str(err)
                    self._emit([LoopEvent("error", turn.turn_id, f"reply failed: {err}")])
                    self._emit_interrupted(turn)
            finally:
                with self._lock:
                    if attempt is None or attempt.confirmed:
                        if self._speaking is turn:
                            self._speaking = None
                        if turn.audio_pushed:
                            self._last_spoken = turn
                        self._finish(turn)
            if self._replies.empty():
                self._prepare_agent()

    def _reply(self, turn: _Turn, attempt: _Attempt | None = None) -> None:
        """Stream the agent's reply through TTS into the sink. A reply begun at the pause (attempt) holds its
        events and audio until confirmed, and ends unheard when dropped."""
        user_text = attempt.text if attempt is not None else turn.final_text
        stop = attempt.stop if attempt is not None else turn.cancelled
        assert user_text is not None
        with self._lock:
            history = list(self.conversation)
        self._stamp(turn, attempt, "reply_start")
        written = self.agent.stream_reply(user_text, history, cancelled=stop)
        stream = spoken_stream(written)  # as it will be said: no lists, markup or figures
        splitter = SentenceSplitter(first_clause_min_words=self.config.first_clause_min_words,
                                    lead_words=self.config.reply_lead_words)
        reply: list[str] = []
        try:
            for chunk in stream:
                if stop.is_set():
                    break
                if not chunk:
                    continue
                self._stamp(turn, attempt, "reply_first_text")
                reply.append(chunk)
                self._publish(attempt, [LoopEvent("agent_text", turn.turn_id, chunk)])
                if not all(self._speak(turn, attempt, sentence) for sentence in self._in_character(turn, splitter.push(chunk))):
                    break
            else:
                for sentence in self._in_character(turn, splitter.flush()):
                    if not self._speak(turn, attempt, sentence):
                        break
        finally:
            stream.close()
            close = getattr(written, "close", None)
            if close is not None:
                close()  # ends generation now: a local model's, or the HTTP stream of an endpoint
        if attempt is not None and not self._await_confirmation(attempt):
            return  # dropped: nothing of it was shown or heard
        text = "".join(reply).strip()
        if turn.trace.info.get("out_of_character"):  # what was said, without the sentences left unsaid
            text = " ".join(turn.spoken)
        turn.trace.info["reply_text"] = text
        if turn.cancelled.is_set():
            self._emit_interrupted(turn)
        else:
            self._emit([LoopEvent("agent_done", turn.turn_id, text)])

    @staticmethod
    def _in_character(turn: _Turn, sentences: list[str]) -> list[str]:
        """The sentences to say: one in which the model speaks of itself as a program is left out, and kept in the
        trace (`out_of_character`)."""
        kept = [s for s in sentences if in_character(s)]
        if len(kept) < len(sentences):
            turn.trace.info.setdefault("out_of_character", []).extend(s for s in sentences if not in_character(s))
        return kept

    def _stamp(self, turn: _Turn, attempt: _Attempt | None, name: str) -> None:
        """Stamp the turn's trace now, or hold the stamp with a reply not yet confirmed."""
        with self._lock:
            if attempt is not None and not attempt.confirmed:
                attempt.held_stamps.setdefault(name, now())
            else:
                turn.trace.mark(name)

    def _publish(self, attempt: _Attempt | None, events: list[LoopEvent]) -> None:
        """Emit events, or hold them with a reply not yet confirmed (what it held goes first once it is)."""
        with self._lock:
            if attempt is not None:
                if not attempt.confirmed:
                    attempt.held_events.extend(events)
                    return
                events, attempt.held_events = [*attempt.held_events, *events], []
        self._emit(events)

    def _await_confirmation(self, attempt: _Attempt) -> bool:
        """Wait until the reply begun at the pause is confirmed (True; its held events are emitted) or dropped."""
        with self._lock:
            while not attempt.confirmed and not attempt.stop.is_set():
                self._confirmations.wait(0.5)
        if attempt.confirmed:
            self._publish(attempt, [])
        return attempt.confirmed

    def _emit_interrupted(self, turn: _Turn) -> None:
        """A reply that ended early (a barge-in, a stop, a failure): what of it was heard."""
        with self._lock:
            heard = turn.heard()
        self._emit([LoopEvent("agent_interrupted", turn.turn_id, heard)])

    def _speak(self, turn: _Turn, attempt: _Attempt | None, sentence: str) -> bool:
        """Synthesize one sentence into the sink, once the reply is confirmed; False once it was cancelled."""
        rate = self.config.output_sample_rate
        stop = attempt.stop if attempt is not None else turn.cancelled
        recorded = False
        for audio in self.tts.synthesize(sentence):
            if stop.is_set():
                return False
            if attempt is not None and not self._await_confirmation(attempt):
                return False
            pcm = resample(audio, self.tts.sample_rate, rate)
            with self._lock:
                # Checked under the lock that barge-in holds while it clears the sink,
                # so no audio can slip in after clear().
                if stop.is_set():
                    return False
                t = now()
                starts = self.sink.push_audio(pcm, rate)
                turn.trace.mark("tts_first_audio", t)
                continues = turn.audio_pushed
                turn.audio_pushed = True
                # the sink's estimate counts the frames waiting ahead of this audio (the engine's playout lead); the
                # reply's next audio goes after its last, so it plays no sooner than that ends, whatever the estimate
                # (each is read off the playout clock when it is pushed, and two readings can differ by a few ms)
                plays_from = max(self._playout_until, t) if starts is None else max(starts, t)
                if continues:
                    plays_from = max(plays_from, self._playout_until)
                if continues and plays_from > self._playout_until:
                    # the reply's voice falls silent here: its next words were not ready when the last ran out
                    waited = plays_from - self._playout_until
                    turn.trace.info["reply_gap_s"] = round(max(turn.trace.info.get("reply_gap_s", 0.0), waited), 3)
                self._playout_until = plays_from + pcm.shape[0] / rate
                turn.trace.info["reply_audio_s"] = round(turn.trace.info.get("reply_audio_s", 0.0) + pcm.shape[0] / rate, 3)
                if not recorded:
                    turn.spoken.append(sentence)
                    turn.spoken_at.append(plays_from)
                    turn.spoken_s.append(0.0)
                    recorded = True
                turn.spoken_s[-1] += pcm.shape[0] / rate
        return not stop.is_set()

    def _emit(self, events: list[LoopEvent]) -> None:
        if self.on_event is None:
            return
        for event in events:
            try:
                self.on_event(event)
            except Exception:  # a broken UI callback must not stop the voice loop
                log.exception("on_event callback failed")


def feed_audio(loop: VoiceLoop, audio: np.ndarray, chunk_ms: int = 32, real_time: bool = True, clock: float | None = None) -> float:
    """Feed 16 kHz audio in chunk_ms pieces. With real_time, each chunk is fed when
    its last sample would have been captured by a microphone (wall-clock pace);
    otherwise as fast as the loop takes it. Returns the capture clock, to continue
    a stream seamlessly with another call."""
    step = SAMPLE_RATE * chunk_ms // 1000
    clock = now() if clock is None else clock
    for offset in range(0, audio.shape[0], step):
        chunk = audio[offset : offset + step]
        clock += chunk.shape[0] / SAMPLE_RATE
        if real_time:
            delay = clock - now()
            if delay > 0:
                time.sleep(delay)
        loop.feed(chunk)
    return clock
