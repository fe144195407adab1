import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # any hub access would fail loudly

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from engine.audio import SAMPLE_RATE, resample
from tests.helpers import run_script
from voice.asr import WhisperASR
from voice.loop import AudioSink, LoopEvent, VoiceLoop, VoiceLoopConfig, _AudioHistory, feed_audio
from voice.samples import sample_speech, with_silence
from voice.spoken import integer_words
from voice.trace import read_jsonl
from voice.tts import PiperTTS
from voice.vad import VADConfig


def is_word_prefix(heard: str, text: str) -> bool:
    """heard is text's first words."""
    return heard.split() == text.split()[: len(heard.split())]


class FakeEngineSink:
    """Stands in for the engine: records every call, checks what it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []  # ("push", t, pcm, rate) or ("clear", t)
        self._lock = threading.Lock()

    def push_audio(self, pcm: np.ndarray, sample_rate: int) -> None:
        assert isinstance(pcm, np.ndarray) and pcm.dtype == np.float32 and pcm.ndim == 1
        with self._lock:
            self.calls.append(("push", time.monotonic(), pcm, sample_rate))

    def clear(self) -> None:
        with self._lock:
            self.calls.append(("clear", time.monotonic()))

    def pushes(self) -> list[tuple]:
        with self._lock:
            return [c for c in self.calls if c[0] == "push"]

    def clears(self) -> list[tuple]:
        with self._lock:
            return [c for c in self.calls if c[0] == "clear"]


class ScriptedAgent:
    """Replies from a script, one entry per turn (then `default`); an Exception entry is raised."""

    def __init__(self, *replies, default=("Okay.",)) -> None:
        self.replies = list(replies)
        self.default = list(default)
        self.heard: list[str] = []
        self.histories: list[list[tuple[str, str]]] = []
        self.cancel_events: list = []

    def stream_reply(self, user_text: str, history=(), cancelled=None) -> Iterator[str]:
        self.heard.append(user_text)
        self.histories.append(list(history))
        self.cancel_events.append(cancelled)
        reply = self.replies.pop(0) if self.replies else self.default
        if isinstance(reply, Exception):
            raise reply
        for sentence in reply:
            yield sentence + " "


LONG_REPLY = [f"This is sentence number {integer_words(n)} of a long story about a lighthouse by the sea." for n in range(1, 13)]


@pytest.fixture(scope="module")
def models():
    return WhisperASR(device="cpu"), PiperTTS(use_cuda=False)


class HeardOutLoop(VoiceLoop):
    """Leaving its `with` block lets the last reply play out before closing: a close while it plays is a Stop, which
    cuts the reply (tests that mean a Stop call close() themselves)."""

    def __exit__(self, *exc: object) -> None:
        deadline = time.monotonic() + 30
        while self.is_speaking and time.monotonic() < deadline:
            time.sleep(0.02)
        self.close()


def make_loop(models, sink, agent=None, events=None, **config) -> VoiceLoop:
    """A loop on the shared models. Turns end on silence alone unless a test asks for smart_turn: espeak-ng's voice
    (sample_speech) is not speech the end-of-turn model was trained on."""
    config.setdefault("turn_detection", "silence")
    asr, tts = models
    on_event = events.append if events is not None else None
    agent = agent or ScriptedAgent(default=["I'm Joe.", "I'm an animated character running right here on your computer."])
    return HeardOutLoop(sink, agent=agent, asr=asr, tts=tts, config=VoiceLoopConfig(**config), on_event=on_event)


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def kinds(events: list[LoopEvent]) -> list[str]:
    return [e.kind for e in events]


def text_of(events: list[LoopEvent], kind: str) -> list[str]:
    return [e.text for e in events if e.kind == kind]


def question(text: str, after_s: float = 1.0) -> np.ndarray:
    return with_silence(sample_speech(text), before_s=0.4, after_s=after_s)


class SlowReader(ScriptedAgent):
    """An agent whose reading ahead of the user's words takes 5 s unless it is stopped."""

    def __init__(self) -> None:
        super().__init__(default=["I'm Joe."])
        self.stopped_early: list[bool] = []

    def prepare(self, history=(), user_text=None, stop=None) -> None:
        if user_text is None:
            return
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if stop is not None and stop():
                self.stopped_early.append(True)
                return
            time.sleep(0.01)
        self.stopped_early.append(False)


def test_reading_ahead_stops_once_a_reply_is_asked_for(models):
    agent = SlowReader()
    with make_loop(models, FakeEngineSink(), agent=agent, preemptive_generation=False) as loop:
        feed_audio(loop, question("Could you tell me a little about the weather where you live?", after_s=1.5),
                   real_time=True)
        assert loop.wait_idle(30)
    [turn] = [t for t in loop.trace.turns if "reply_first_text" in t.stamps]
    assert agent.stopped_early and agent.stopped_early[-1], agent.stopped_early  # the user's words were read ahead
    assert turn.stamps["reply_start"] - turn.stamps["asr_done"] < 1.0  # not after the reader's 5 s


@pytest.mark.parametrize("output_rate", [16000, 48000])
def test_full_turn_through_a_fake_engine_sink(models, tmp_path, output_rate):
    sink, events = FakeEngineSink(), []
    trace_path = tmp_path / "turns.jsonl"
    with make_loop(models, sink, events=events, output_sample_rate=output_rate, trace_path=str(trace_path)) as loop:
        # A browser microphone: 48 kHz stereo int16 in 20 ms chunks.
        mono48 = resample(question("What is your name?"), SAMPLE_RATE, 48000)
        stereo = (np.stack([mono48, mono48], axis=1) * 32767).astype(np.int16)
        for offset in range(0, stereo.shape[0], 960):
            loop.feed(stereo[offset : offset + 960], 48000)
        assert loop.wait_idle(30)
        loop.mark("first_speaking_frame")  # what the engine does when the mouth starts moving

    assert "name" in text_of(events, "user_final")[0].lower()
    assert "Joe" in text_of(events, "agent_done")[0]
    assert kinds(events).index("speech_start") < kinds(events).index("user_final") < kinds(events).index("agent_text")
    pushes = sink.pushes()
    assert pushes and all(rate == output_rate for *_, rate in pushes)
    seconds = sum(p[2].size for p in pushes) / output_rate
    assert 3.0 < seconds < 12.0  # "I'm Joe." plus one more sentence
    assert sink.clears() == []

    [record] = read_jsonl(trace_path)
    stamps = record["stamps"]
    order = ["speech_start", "last_voiced_audio", "speech_end", "asr_done", "reply_start", "reply_first_text", "tts_first_audio", "first_speaking_frame"]
    assert list(stamps)[: len(order)] == order
    assert all(stamps[a] <= stamps[b] for a, b in zip(order, order[1:]))
    assert set(record["durations_s"]) >= {"end_of_turn_delay", "stt", "llm_ttft", "tts_ttfb", "e2e_latency", "e2e_latency_to_first_frame"}
    assert record["status"] == "completed" and record["reply_audio_s"] == pytest.approx(seconds, abs=0.01)


def test_partial_transcripts_arrive_while_the_user_talks(models):
    sink, events = FakeEngineSink(), []
    with make_loop(models, sink, events=events, partial_interval_s=0.5) as loop:
        feed_audio(loop, question("Please turn on the lights in the kitchen, and then close the door.", after_s=0.8), real_time=True)
        assert loop.wait_idle(30)
    names = kinds(events)
    assert "user_partial" in names and names.index("user_partial") < names.index("user_final")
    assert "kitchen" in text_of(events, "user_final")[0].lower()
    durations = loop.trace.turns[0].durations()
    assert {"end_of_turn_delay", "stt", "e2e_latency"} <= set(durations)


def test_barge_in_stops_playback_and_the_loop_listens(models):
    sink, events = FakeEngineSink(), []
    agent = ScriptedAgent(LONG_REPLY, ["Sure, I'm listening."])
    with make_loop(models, sink, agent=agent, events=events) as loop:
        feed_audio(loop, question("Tell me a long story."), real_time=False)
        assert wait_for(lambda: len(sink.pushes()) >= 1)
        feed_audio(loop, question("Stop, please wait."), real_time=False)
        assert wait_for(lambda: len(sink.clears()) == 1)
        assert loop.wait_idle(30)
        first, second = [t for t in loop.trace.turns if t.info.get("user_text")]

    clear_t = sink.clears()[0][1]
    story_pushes = [p for p in sink.pushes() if p[1] < clear_t]
    later_pushes = [p for p in sink.pushes() if p[1] >= clear_t]
    assert 1 <= len(story_pushes) < len(LONG_REPLY)  # the story was cut short
    # After clear(), the only audio is the reply to the new question.
    assert later_pushes and all(p[1] >= second.stamps["tts_first_audio"] for p in later_pushes)
    assert first.info["status"] == "interrupted" and "barge_in" in first.stamps
    assert "barge_in" in kinds(events)
    # the agent was told: a local model stops generating at once
    assert agent.cancel_events[0].is_set()
    assert "wait" in agent.heard[1].lower()
    assert second.info["status"] == "completed"
    # The agent remembers the story only as far as it was spoken.
    [(said, spoken)] = agent.histories[1]
    assert said == first.info["user_text"]
    assert is_word_prefix(spoken, " ".join(LONG_REPLY[: len(story_pushes)]))  # one push per sentence
    assert loop.conversation[-1] == (second.info["user_text"], "Sure, I'm listening.")
    # The cut-short reply is reported with what of it was spoken, for the transcript and its recording.
    assert text_of(events, "agent_interrupted") == [spoken]
    assert text_of(events, "agent_done") == ["Sure, I'm listening."]


def test_a_written_reply_is_said_as_sentences_without_markup_or_figures(models):
    """A model's list, markdown, emoji and figures reach neither speech synthesis nor the transcript as written."""
    sink, events = FakeEngineSink(), []
    agent = ScriptedAgent(["Here is how:\n1. Boil **water** for 3 min\n2. Add 2 tea bags 🍵\n"])
    with make_loop(models, sink, agent=agent, events=events) as loop:
        feed_audio(loop, question("How do I make tea?"), real_time=False)
        assert loop.wait_idle(30)
    assert text_of(events, "agent_done") == ["Here is how. Boil water for three minutes. Add two tea bags."]
    assert "".join(text_of(events, "agent_text")).strip() == "Here is how. Boil water for three minutes. Add two tea bags."
    assert sink.pushes()


def test_a_sentence_in_which_the_model_speaks_as_a_program_is_not_said(models, tmp_path):
    """"As an AI language model, I don't have preferences." is left unsaid; the rest of the reply is said, shown
    and remembered."""
    sink, events = FakeEngineSink(), []
    agent = ScriptedAgent(["As an AI language model, I don't have personal preferences. However, green is a lovely colour."])
    with make_loop(models, sink, agent=agent, events=events, trace_path=str(tmp_path / "t.jsonl")) as loop:
        feed_audio(loop, question("What is your favourite colour?"), real_time=False)
        assert loop.wait_idle(30)
    assert text_of(events, "agent_done") == ["However, green is a lovely colour."]
    assert loop.conversation[-1][1] == "However, green is a lovely colour."
    [record] = [r for r in read_jsonl(tmp_path / "t.jsonl") if r.get("reply_text")]
    assert record["out_of_character"] == ["As an AI language model, I don't have personal preferences."], record
    assert sink.pushes()


def test_barge_in_while_a_finished_reply_plays_cuts_it_back_to_what_was_heard(models, tmp_path):
    """Synthesis runs ahead of playback: a reply can be whole in the sink, its books closed, and still playing when
    the user cuts in. Its record is rewritten as interrupted and the agent remembers only what was heard."""
    # one sentence without a comma, so that it is spoken as one piece
    story = ["Once upon a time in a small village by the cold grey sea there stood a tall white lighthouse.",
             "It stood on a rock for a hundred years.", "Every night its keeper climbed the stairs."]
    sink, events = FakeEngineSink(), []
    agent = ScriptedAgent(story, ["Sure."])
    path = tmp_path / "trace.jsonl"
    # each scripted reply made once, at the end of its turn (a reply begun at a pause would take the next script)
    with make_loop(models, sink, agent=agent, events=events, trace_path=str(path), preemptive_generation=False) as loop:
        clock = feed_audio(loop, question("Tell me a story.", after_s=0.6))
        while not (loop.trace.turns and loop.trace.turns[0].written):  # the microphone stays open meanwhile
            clock = feed_audio(loop, np.zeros(512, np.float32), clock=clock)
        assert loop.is_speaking  # the reply is all in the sink and still playing
        clock = feed_audio(loop, np.zeros(SAMPLE_RATE // 2, np.float32), clock=clock)
        feed_audio(loop, question("Stop, please wait."), clock=clock)
        assert loop.wait_idle(30)
    assert len(sink.clears()) == 1
    assert text_of(events, "agent_done") == [" ".join(story), "Sure."]
    # after its agent_done the line is cut back, into the first sentence (about 6 s long; cut 2-3 s in)
    [heard] = text_of(events, "agent_interrupted")
    assert is_word_prefix(heard, story[0]) and 0 < len(heard.split()) < len(story[0].split())
    first = [r for r in read_jsonl(path) if r["turn_id"] == 1][0]  # the record's last line
    assert first["status"] == "interrupted" and "barge_in" in first["stamps"]
    assert [spoken for _, spoken in agent.histories[1]] == [heard]


class LaggingSink(FakeEngineSink):
    """A sink with a playout buffer: what is pushed plays LAG_S later, after what is queued before it; it says so."""

    LAG_S = 5.0

    def __init__(self) -> None:
        super().__init__()
        self.plays_until = 0.0

    def push_audio(self, pcm: np.ndarray, sample_rate: int) -> float:
        super().push_audio(pcm, sample_rate)
        starts = max(self.plays_until, time.monotonic() + self.LAG_S)
        self.plays_until = starts + pcm.size / sample_rate
        return starts

    def clear(self) -> None:
        super().clear()
        self.plays_until = 0.0


def test_a_reply_still_queued_in_the_sink_is_still_speaking_and_can_be_cut(models):
    """The loop takes the sink's word for when audio plays: once the reply's own length has passed since it was
    pushed, it still waits in the sink's playout buffer, so it still counts as speaking and a barge-in cuts it
    (none of it heard yet)."""
    sink, events = LaggingSink(), []
    with make_loop(models, sink, agent=ScriptedAgent(["Okay."]), events=events) as loop:
        feed_audio(loop, question("Hello there."), real_time=False)
        assert loop.wait_idle(30) and sink.pushes()
        pushed_t = sink.pushes()[0][1]
        audio_s = sum(p[2].size / p[3] for p in sink.pushes())
        time.sleep(max(0.0, pushed_t + audio_s + 0.2 - time.monotonic()))
        assert time.monotonic() < sink.plays_until - 2.0  # the test's own premise: still queued, with room to spare
        assert loop.is_speaking
        feed_audio(loop, question("Wait a moment."), real_time=False)
        assert loop.wait_idle(30)
    assert len(sink.clears()) == 1 and "barge_in" in kinds(events)
    assert text_of(events, "agent_interrupted") == [""]  # it had not started playing


class EarlyEstimateSink(LaggingSink):
    """Says each push after the first plays 5 ms before the audio queued ahead of it ends: the app's estimate, read
    off the playout clock at each push, can be that far off between two readings."""

    def push_audio(self, pcm: np.ndarray, sample_rate: int) -> float:
        queued = self.plays_until
        starts = super().push_audio(pcm, sample_rate)
        return starts - 0.005 if queued else starts


def test_a_replys_next_audio_is_taken_to_play_after_its_last_whatever_the_estimate(models):
    """The sink appends a reply's audio after what it queued before, so the loop counts each sentence from the end
    of the one before it, even when the sink's estimate says a few ms sooner: what was heard of a cut reply never
    sums to more than the span it played over."""
    sink = EarlyEstimateSink()
    agent = ScriptedAgent(["Here is the first sentence of it.", "And here is a second one after it."])
    with make_loop(models, sink, agent=agent) as loop:
        feed_audio(loop, question("Tell me two things."), real_time=False)
        assert loop.wait_idle(30) and len(sink.pushes()) >= 2
        turn = loop._last_spoken  # the reply's turn, with when each sentence plays
        assert turn is not None and len(turn.spoken_at) == 2
        assert turn.spoken_at[1] >= turn.spoken_at[0] + turn.spoken_s[0] - 1e-9
        turn.barge_in_t = turn.spoken_at[1] + 0.2
        assert turn.heard_audio_s(sum(turn.spoken_s)) <= turn.heard_span_s() + 1e-9


def test_stop_while_a_reply_plays_keeps_what_was_heard_and_marks_it_interrupted(models, tmp_path):
    """Stop (close) in the middle of a reply whose audio is all in the sink and still playing: the sink is cleared,
    the reply is cut back to what had begun to play, reported interrupted, and its record says so."""
    # one sentence without a comma, so that it is spoken as one piece
    story = ["Once upon a time in a small village by the cold grey sea there stood a tall white lighthouse.",
             "It stood on a rock for a hundred years.", "Every night its keeper climbed the stairs."]
    sink, events = FakeEngineSink(), []
    path = tmp_path / "trace.jsonl"
    loop = make_loop(models, sink, agent=ScriptedAgent(story), events=events, trace_path=str(path))
    clock = feed_audio(loop, question("Tell me a story.", after_s=0.6))
    while not (loop.trace.turns and loop.trace.turns[0].written):
        clock = feed_audio(loop, np.zeros(512, np.float32), clock=clock)
    clock = feed_audio(loop, np.zeros(SAMPLE_RATE, np.float32), clock=clock)
    assert loop.is_speaking  # the reply is all in the sink, its first sentence (about 6 s) playing
    first_push = sink.pushes()[0][1]
    loop.close()
    assert len(sink.clears()) == 1
    [heard] = text_of(events, "agent_interrupted")
    assert is_word_prefix(heard, story[0]) and 0 < len(heard.split()) < len(story[0].split())
    record = [r for r in read_jsonl(path) if r["turn_id"] == 1][-1]
    assert record["status"] == "interrupted" and "stopped" in record["stamps"]
    assert loop.conversation[-1][1] == heard
    # What was heard, beside what was made: the reply played from its first push until the stop, and the words
    # kept are the first sentence's in the share of its audio played.
    assert record["heard_text"] == heard
    assert record["heard_audio_s"] == pytest.approx(record["stamps"]["stopped"] - first_push, abs=0.05)
    assert 0 < record["heard_audio_s"] < record["reply_audio_s"]
    first_sentence_s = sink.pushes()[0][2].size / sink.pushes()[0][3]  # Piper gives a sentence in one piece
    share = record["heard_audio_s"] / first_sentence_s  # rounded to the ms in the record: a word either way
    assert abs(len(heard.split()) - len(story[0].split()) * share) <= 1


def test_stop_while_a_reply_is_being_made_ends_it_and_marks_it_interrupted(models, tmp_path):
    sink, events = LaggingSink(), []
    path = tmp_path / "trace.jsonl"
    agent = PacedAgent(LONG_REPLY, token_s=0.05)
    loop = make_loop(models, sink, agent=agent, events=events, trace_path=str(path))
    feed_audio(loop, question("Tell me a long story."), real_time=False)
    assert wait_for(lambda: sink.pushes(), 20)
    loop.close()
    assert len(sink.clears()) == 1
    assert text_of(events, "agent_interrupted") == [""]  # the sink had not begun to play any of it
    assert "agent_done" not in kinds(events)
    [record] = read_jsonl(path)
    assert record["status"] == "interrupted" and "stopped" in record["stamps"]
    assert agent.made[0] < sum(len(s.split()) for s in LONG_REPLY)  # generation stopped


def test_a_monologue_is_answered_in_bounded_turns_none_lost(models):
    """70 s of talk with only short pauses: each pause ends a turn and the next start joins it on, but not past
    half of max_speech_s, so every turn's audio stays in the history; each turn is answered, in order."""
    sentence = sample_speech("I went to the market this morning and bought apples, bread, some cheese and a bottle of milk.")
    gap = np.zeros(SAMPLE_RATE // 10, np.float32)
    speech = with_silence(np.concatenate([sentence, gap] * int(70 * SAMPLE_RATE // (sentence.size + gap.size) + 1)), 0.4, 1.5)
    sink, events = FakeEngineSink(), []
    with make_loop(models, sink, agent=ScriptedAgent(), events=events, barge_in=False) as loop:
        feed_audio(loop, speech, real_time=False)
        assert loop.wait_idle(30)
        turns = [t for t in loop.trace.turns if t.info.get("status") != "continued"]
    # Every turn's books are closed. fed this fast, on two cores a turn's audio can leave the 45 s history before
    # its final decode runs (in real time it cannot): that turn is then ignored, not lost
    assert len(turns) >= 3 and all(t.written and t.info.get("status") in ("completed", "ignored") for t in turns)
    assert all(t.info["audio_s"] <= loop.config.vad.max_speech_s * 1.5 for t in turns)
    answered = [e.turn_id for e in events if e.kind == "agent_done"]
    assert len(answered) >= 2 and answered == [t.turn_id for t in turns if t.info["status"] == "completed"]


def test_barge_in_can_be_turned_off(models):
    sink = FakeEngineSink()
    agent = ScriptedAgent(LONG_REPLY[:3], ["Okay."])
    with make_loop(models, sink, agent=agent, barge_in=False) as loop:
        feed_audio(loop, question("Tell me a story."), real_time=False)
        assert wait_for(lambda: len(sink.pushes()) >= 1)
        feed_audio(loop, question("Stop, please wait."), real_time=False)
        assert loop.wait_idle(30)
    assert sink.clears() == []
    assert loop.trace.turns[0].info["status"] == "completed"


def test_a_user_who_keeps_talking_after_a_pause_stays_in_one_turn(models):
    sink = FakeEngineSink()
    agent = ScriptedAgent(["Got it."], ["Got it."])
    with make_loop(models, sink, agent=agent) as loop:
        both = np.concatenate([question("Hello there.", after_s=0.6), question("Can you help me find my keys?")])
        feed_audio(loop, both, real_time=False)  # the pause ends a turn, but no reply audio has left yet
        assert loop.wait_idle(30)
    statuses = [t.info.get("status") for t in loop.trace.turns]
    assert statuses[0] == "continued"
    answered = [t for t in loop.trace.turns if t.info.get("status") == "completed"]
    assert len(answered) == 1 and agent.heard == [answered[0].info["user_text"]]
    assert agent.histories == [[]] and len(loop.conversation) == 1
    heard = agent.heard[0].lower()
    assert "hello" in heard and "keys" in heard


class PacedAgent(ScriptedAgent):
    """A ScriptedAgent that takes `token_s` per chunk, like a model decoding, and stops when cancelled."""

    def __init__(self, *replies, token_s: float = 0.05, **kw) -> None:
        super().__init__(*replies, **kw)
        self.token_s = token_s
        self.made: list[int] = []  # chunks generated, per call

    def stream_reply(self, user_text: str, history=(), cancelled=None) -> Iterator[str]:
        self.made.append(0)
        for chunk in super().stream_reply(user_text, history, cancelled):
            for word in chunk.split():
                if cancelled is not None and cancelled.is_set():
                    return
                time.sleep(self.token_s)
                self.made[-1] += 1
                yield word + " "


def test_the_reply_begins_at_the_pause_and_is_heard_only_after_the_end_of_turn(models, tmp_path):
    sink, events = FakeEngineSink(), []
    agent = PacedAgent(["My name is Joe.", "Nice to meet you."], token_s=0.02)
    trace_path = tmp_path / "turns.jsonl"
    # A long silence wait, so the transcript made at the pause is in well before the end of the turn.
    with make_loop(models, sink, agent=agent, events=events, trace_path=str(trace_path),
                   vad=VADConfig(min_silence_ms=2000)) as loop:
        feed_audio(loop, question("What is your name?", after_s=3.0), real_time=True)
        assert loop.wait_idle(30)
    [record] = read_jsonl(trace_path)
    stamps = record["stamps"]
    assert record["preemptive"] is True and record["status"] == "completed"
    assert stamps["reply_start"] < stamps["speech_end"]  # begun during the silence wait
    assert stamps["tts_first_audio"] >= stamps["speech_end"]  # but heard only once the turn had ended
    assert len(agent.heard) == 1 and "name" in agent.heard[0].lower()
    # the page sees the user's final words before any of the reply
    assert kinds(events).index("user_final") < kinds(events).index("agent_text") < kinds(events).index("agent_done")
    assert "Joe" in text_of(events, "agent_done")[0]
    assert record["durations_s"]["stt"] < 0.05  # nothing left to transcribe at the end of the turn


def test_a_reply_begun_at_a_pause_is_dropped_unheard_when_the_user_goes_on(models, tmp_path):
    sink, events = FakeEngineSink(), []
    agent = PacedAgent(default=["Green is a lovely colour, and I like it a lot too."], token_s=0.1)
    trace_path = tmp_path / "turns.jsonl"
    with make_loop(models, sink, agent=agent, events=events, trace_path=str(trace_path),
                   vad=VADConfig(min_silence_ms=2500)) as loop:
        first = with_silence(sample_speech("My favourite colour is green."), before_s=0.4, after_s=1.5)
        clock = feed_audio(loop, first, real_time=True)  # a pause shorter than the silence wait
        assert agent.heard  # the reply began on the words so far
        rest = with_silence(sample_speech("What is yours?"), before_s=0.0, after_s=3.5)
        feed_audio(loop, rest, real_time=True, clock=clock)
        assert loop.wait_idle(30)
    [record] = read_jsonl(trace_path)
    assert record["replies_dropped"] == 1 and record["status"] == "completed"
    assert len(agent.heard) == 2 and "yours" not in agent.heard[0].lower() and "yours" in agent.heard[1].lower()
    assert agent.made[0] < agent.made[1] == 12  # the dropped reply stopped generating
    # nothing of the dropped reply was shown or heard: one reply, to the whole question
    assert text_of(events, "user_final") == [agent.heard[1]] and len(text_of(events, "agent_done")) == 1
    assert sum(p[2].size for p in sink.pushes()) / 16000 == pytest.approx(record["reply_audio_s"], abs=0.01)
    assert "preemptive" not in record or record["stamps"]["reply_start"] > record["stamps"]["last_voiced_audio"]


def test_preemptive_generation_can_be_turned_off(models, tmp_path):
    agent = PacedAgent(["My name is Joe."], token_s=0.01)
    trace_path = tmp_path / "turns.jsonl"
    with make_loop(models, FakeEngineSink(), agent=agent, trace_path=str(trace_path), preemptive_generation=False,
                   vad=VADConfig(min_silence_ms=1200)) as loop:
        feed_audio(loop, question("What is your name?", after_s=2.0), real_time=True)
        assert loop.wait_idle(30)
    [record] = read_jsonl(trace_path)
    assert "preemptive" not in record and record["stamps"]["reply_start"] >= record["stamps"]["speech_end"]


def test_bad_chunks_are_refused_and_the_loop_goes_on(models):
    sink, events = FakeEngineSink(), []
    with make_loop(models, sink, events=events) as loop:
        for bad, message in (
            (np.array([0.0, np.nan, 0.1], np.float32), "NaN"),
            (np.zeros(0, np.float32), "empty"),
            (np.broadcast_to(np.float32(0), (3 * 3600 * SAMPLE_RATE,)), "limit"),
            (np.zeros((3, 3, 3), np.float32), "shape"),
        ):
            with pytest.raises(ValueError, match=message):
                loop.feed(bad)
        feed_audio(loop, np.zeros(2 * SAMPLE_RATE, np.float32), real_time=False)
        assert loop.trace.turns == [] and sink.pushes() == []
        feed_audio(loop, question("What time is it?"), real_time=False)
        assert loop.wait_idle(30)
    assert "time" in text_of(events, "user_final")[0].lower()
    assert sink.pushes()


def test_clipped_speech_gets_a_bounded_result(models):
    sink, events = FakeEngineSink(), []
    with make_loop(models, sink, events=events) as loop:
        clipped = np.clip(question("What is your name?") * 40.0, -1.0, 1.0)
        feed_audio(loop, clipped * 1.5, real_time=False)  # beyond full scale: clipped again on input
        assert loop.wait_idle(30)
    assert "error" not in kinds(events)
    assert all(t.info.get("status") in ("completed", "ignored") for t in loop.trace.turns)


def test_failing_agent_and_callback_do_not_stop_the_loop(models):
    sink = FakeEngineSink()
    seen: list[LoopEvent] = []

    def broken_ui(event: LoopEvent) -> None:
        seen.append(event)
        raise RuntimeError("UI bug")

    agent = ScriptedAgent(ConnectionError("chat endpoint unreachable"), ["Fine, thanks."])
    # espeak-ng's speech, which the end-of-turn model scores as unfinished: the silence rule ends its turns
    with VoiceLoop(sink, agent=agent, asr=models[0], tts=models[1], on_event=broken_ui,
                   config=VoiceLoopConfig(turn_detection="silence")) as loop:
        feed_audio(loop, question("How are you?"), real_time=False)
        assert loop.wait_idle(30)
        feed_audio(loop, question("How are you?"), real_time=False)
        assert loop.wait_idle(30)
        assert wait_for(lambda: not loop.is_speaking)  # heard to the end (a close before that is a Stop)
    first, second = loop.trace.turns
    assert first.info["status"] == "error" and "unreachable" in first.info["error"]
    assert second.info["status"] == "completed" and sink.pushes()
    assert any(e.kind == "error" for e in seen)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device every write to fails as a full disk)")
def test_a_trace_file_that_cannot_be_written_costs_the_trace_not_the_conversation(models):
    sink, events = FakeEngineSink(), []
    loop = make_loop(models, sink, agent=ScriptedAgent(["My name is Joe."], ["By the sea."]), events=events,
                     trace_path="/dev/full", barge_in=False)
    for q in ("What is your name?", "Where do you live?"):
        feed_audio(loop, question(q), real_time=False)
        assert loop.wait_idle(30)
    loop.close()  # does not raise
    assert text_of(events, "agent_done") == ["My name is Joe.", "By the sea."]
    assert "/dev/full" in loop.trace.error


def test_close_is_clean_and_final(models):
    sink = FakeEngineSink()
    loop = make_loop(models, sink)
    feed_audio(loop, question("What is your name?", after_s=0.5), real_time=False)
    loop.close()
    loop.close()
    assert not any(t.is_alive() for t in loop._threads)
    with pytest.raises(RuntimeError, match="closed"):
        loop.feed(np.zeros(512, np.float32))


def test_the_sink_protocol_is_what_the_engine_implements():
    assert isinstance(FakeEngineSink(), AudioSink)


def test_audio_history_ring_keeps_absolute_sample_indices():
    ring = _AudioHistory(10)
    stream = np.arange(37, dtype=np.float32)
    for size in (3, 7, 1, 12, 14):  # 12 and 14 overflow the ring in one call
        start = ring.total
        ring.append(stream[start : start + size])
    assert ring.total == 37 and ring.first == 27
    np.testing.assert_array_equal(ring.slice(0, 37), stream[27:])
    np.testing.assert_array_equal(ring.slice(30, 33), stream[30:33])
    assert ring.slice(40, 50).size == 0


HELD_AT_EXIT_SCRIPT = """
import threading, time
import numpy as np
from voice.loop import VoiceLoop

class Sink:
    def push_audio(self, pcm, sample_rate): pass
    def clear(self): pass

if __name__ == "__main__":
    loop = VoiceLoop(Sink(), asr=object(), tts=object(), agent=object())
    loop.feed(np.zeros(4800, np.float32), 48000)  # browser-rate audio: the loop makes a resampler
    loop.close()
    threading.Thread(target=lambda held=loop: time.sleep(60), daemon=True).start()  # held past exit, as an app thread may
    print("closed", flush=True)
"""


def test_a_closed_loop_still_held_at_exit_leaves_no_resampler_behind(tmp_path):
    """A loop that resampled browser audio and was closed, but is still referenced when the interpreter exits
    (by a daemon thread, say), holds no libsoxr object then: nanobind would report it as leaked."""
    done = run_script(tmp_path / "held_at_exit.py", HELD_AT_EXIT_SCRIPT, timeout=120)
    assert done.returncode == 0 and "closed" in done.stdout, done.stderr
    assert "leaked" not in done.stderr, done.stderr


@pytest.mark.parametrize("token_s, gap", [(0.001, False), (0.15, True)])
def test_the_trace_keeps_the_longest_silence_inside_a_reply(models, tmp_path, token_s, gap):
    """"Sure!" plays for about half a second; a next sentence that takes 2 s to write leaves the voice silent
    between them, and the trace says for how long; one written at once leaves no gap."""
    agent = PacedAgent(["Sure!", "Here is a long answer that has very many words in it before it comes to its end."],
                       token_s=token_s)
    trace_path = tmp_path / "turns.jsonl"
    with make_loop(models, FakeEngineSink(), agent=agent, trace_path=str(trace_path)) as loop:
        feed_audio(loop, question("Can you tell me a joke?"), real_time=False)
        assert loop.wait_idle(60)
    [record] = read_jsonl(trace_path)
    assert record["status"] == "completed"
    if gap:
        assert 1.0 < record["reply_gap_s"] < 3.0
    else:
        assert record.get("reply_gap_s", 0.0) < 0.05


def test_a_cut_reply_counts_the_audio_heard_not_the_pauses_between_its_sentences():
    """Two sentences with 0.5 s of silence between them (the second was not ready), cut 0.4 s into the second:
    1.0 + 0.4 s of audio heard over a span of 1.9 s."""
    from voice.loop import _Turn
    from voice.trace import TurnTrace

    turn = _Turn(trace=TurnTrace(session_id="s", turn_id=1), start=0)
    turn.spoken, turn.spoken_at, turn.spoken_s = ["One.", "Two words."], [10.0, 11.5], [1.0, 1.2]
    assert turn.heard_audio_s(2.2) == 2.2 and turn.heard_span_s() == pytest.approx(2.7)  # not cut: all of it
    turn.barge_in_t = 11.9
    assert turn.heard_audio_s(2.2) == pytest.approx(1.4) and turn.heard_span_s() == pytest.approx(1.9)
    turn.barge_in_t = 11.2  # in the pause: the first sentence alone
    assert turn.heard_audio_s(2.2) == pytest.approx(1.0) and turn.heard_span_s() == pytest.approx(1.0)
    assert turn.heard() == "One."
