import json

import pytest

from voice.trace import SessionTrace, TurnTrace, read_jsonl, summarize


def stamped(**stamps: float) -> TurnTrace:
    turn = TurnTrace("s", 1)
    for name, t in stamps.items():
        turn.mark(name, t)
    return turn


def test_durations_use_the_names_pipecat_and_livekit_users_know():
    turn = stamped(last_voiced_audio=10.0, speech_end=10.3, asr_done=10.4, reply_start=10.4, reply_first_text=10.41,
                   tts_first_audio=10.6)
    assert turn.durations() == {
        "end_of_turn_delay": pytest.approx(0.3),
        "stt": pytest.approx(0.1),
        "llm_ttft": pytest.approx(0.01),
        "tts_ttfb": pytest.approx(0.19),
        "e2e_latency": pytest.approx(0.6),
        "speech_end_to_first_audio": pytest.approx(0.3),
    }


def test_missing_stamps_leave_their_durations_out():
    turn = stamped(speech_end=1.0, asr_done=1.5)
    assert turn.durations() == {"stt": pytest.approx(0.5)}


def test_first_stamp_wins_unless_overwritten():
    turn = stamped(tts_first_audio=1.0)
    turn.mark("tts_first_audio", 2.0)
    assert turn.stamps["tts_first_audio"] == 1.0
    turn.mark("tts_first_audio", 2.0, overwrite=True)
    assert turn.stamps["tts_first_audio"] == 2.0


def test_turns_are_appended_as_json_lines_and_late_stamps_update_them(tmp_path):
    path = tmp_path / "traces" / "session.jsonl"
    trace = SessionTrace(path, session_id="abc")
    turn = trace.new_turn()
    for name, t in (("last_voiced_audio", 5.0), ("speech_end", 5.3), ("tts_first_audio", 5.8)):
        turn.mark(name, t)
    turn.info["user_text"] = "hi"
    trace.write(turn)
    first = json.loads(path.read_text().splitlines()[0])
    assert first["turn_id"] == 1 and first["user_text"] == "hi"
    assert first["durations_s"]["e2e_latency"] == pytest.approx(0.8)
    # The engine and app stamp later; the record is appended again.
    trace.mark(turn.turn_id, "first_speaking_frame", 6.0)
    trace.mark(turn.turn_id, "client_delivered", 6.1)
    assert len(path.read_text().splitlines()) == 3
    [latest] = read_jsonl(path)
    assert latest["durations_s"]["e2e_latency_to_first_frame"] == pytest.approx(1.0)
    assert latest["durations_s"]["e2e_latency_to_client"] == pytest.approx(1.1)
    assert list(latest["stamps"]) == ["last_voiced_audio", "speech_end", "tts_first_audio", "first_speaking_frame", "client_delivered"]
    with pytest.raises(KeyError):
        trace.mark(99, "client_delivered")


def test_summary_median_and_p95():
    values = [float(v) for v in range(1, 21)]
    assert summarize(values) == {"n": 20, "median": 10.5, "p95": 19.0, "min": 1.0, "max": 20.0}
    assert summarize([0.7]) == {"n": 1, "median": 0.7, "p95": 0.7, "min": 0.7, "max": 0.7}
    assert summarize([]) == {"n": 0}


def test_lines_that_are_not_turn_records_are_skipped_not_fatal(tmp_path):
    path = tmp_path / "trace.jsonl"
    good = [{"session_id": "s", "turn_id": n, "stamps": {}} for n in (1, 2)]
    path.write_text("\n".join([json.dumps(good[0]), "[1, 2]", '{"turn_id": 3}', json.dumps(good[1]),
                               '{"session_id": "s", "turn_id": 4, "sta']))  # the last line cut short by a crash
    assert sorted(r["turn_id"] for r in read_jsonl(path)) == [1, 2]


class _CutShort:
    """A file whose write stores half the text, then fails as a full disk does."""

    def __init__(self, path):
        self.f = open(path, "a", encoding="utf-8")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, text):
        self.f.write(text[: len(text) // 2])
        raise OSError(28, "No space left on device")


def test_a_failed_write_is_kept_as_an_error_and_the_next_record_stays_readable(tmp_path, monkeypatch):
    import voice.trace

    path = tmp_path / "trace.jsonl"
    trace = SessionTrace(path, session_id="abc")
    first, second, third = (trace.new_turn() for _ in range(3))
    trace.write(first)
    monkeypatch.setattr(voice.trace, "open", lambda p, *a, **k: _CutShort(p), raising=False)
    trace.write(second)  # does not raise: a full disk costs the trace, not the turn
    assert trace.error is not None and str(path) in trace.error and "No space left" in trace.error
    monkeypatch.undo()
    trace.write(third)
    assert sorted(r["turn_id"] for r in read_jsonl(path)) == [1, 3]  # the cut line alone is lost


def test_an_unwritable_trace_path_does_not_raise(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    trace = SessionTrace(tmp_path / "t.jsonl", session_id="abc")
    trace.path = blocked / "t.jsonl"  # its folder is a file now (NotADirectoryError)
    turn = trace.new_turn()
    trace.write(turn)
    assert turn.written and "t.jsonl" in trace.error
