"""Playout buffer on a simulated clock: slow steps absorbed, underruns counted."""

import pytest

from engine.playout import PlayoutBuffer

FPS = 24


def simulate(step_ms: list[float], *, prebuffer: int = 4, max_lead: int = 7, tail_ms: int = 1000) -> PlayoutBuffer:
    """The engine loop against the 24 fps consumer, in 1 ms ticks of virtual time."""
    now = [0.0]
    buf = PlayoutBuffer(FPS, prebuffer=prebuffer, max_lead=max_lead, clock=lambda: now[0])
    busy_until, next_step, made = None, 0, 0
    for ms in range(int(sum(step_ms)) + tail_ms):
        now[0] = ms / 1000
        if busy_until is not None and now[0] >= busy_until:
            buf.put(list(range(made, made + 4)))
            made += 4
            busy_until = None
        buf.pop_due()
        if busy_until is None and next_step < len(step_ms) and buf.has_room():
            busy_until = now[0] + step_ms[next_step] / 1000
            next_step += 1
    return buf


STEADY = [150.0] * 60
WITH_RESET_STEP = STEADY[:30] + [263.0] + STEADY[31:]  # the seed's reset step, mid-session


def test_holds_24fps_through_a_263ms_step_at_depth_7():
    buf = simulate(WITH_RESET_STEP, max_lead=7)  # 7 frames = 292 ms of lead
    assert buf.stats.underruns == 0
    assert buf.stats.released == 240
    assert buf.stats.fps() == pytest.approx(FPS, rel=1e-6)


def test_counts_the_underrun_when_the_lead_is_too_small():
    assert simulate(STEADY, max_lead=5).stats.underruns == 0  # steady 150 ms steps are fine
    buf = simulate(WITH_RESET_STEP, max_lead=5)  # 208 ms of lead < 263 ms
    assert buf.stats.underruns == 1
    assert buf.stats.released + len(buf.frames) == 240  # nothing lost, only late


def test_a_slow_engine_underruns_every_few_steps():
    buf = simulate([200.0] * 30)  # 200 ms per 166.7 ms of video
    assert buf.stats.underruns >= 3
    assert buf.stats.fps() < FPS


def test_the_recent_rate_forgets_a_slow_start_and_sees_a_stall_still_going_on():
    warmed_up = simulate([400.0] * 5 + [150.0] * 60, tail_ms=0)  # slow first steps, then real time
    assert warmed_up.stats.underruns >= 1 and warmed_up.stats.fps() < 0.95 * FPS
    assert warmed_up.stats.recent_fps(warmed_up.clock(), warmed_up.period) == pytest.approx(FPS, rel=1e-6)
    stalled = simulate([150.0] * 60 + [2000.0], tail_ms=0)  # real time, then a 2 s step not yet done
    assert stalled.stats.fps() == pytest.approx(FPS, rel=1e-6)  # the average still says real time
    assert stalled.stats.recent_fps(stalled.clock(), stalled.period) < 0.9 * FPS
    assert PlayoutBuffer(FPS).stats.recent_fps(0.0, 1 / FPS) == 0.0  # nothing played yet


def test_frames_leave_in_order_and_barge_in_rewrites_waiting_ones():
    now = [0.0]
    buf = PlayoutBuffer(FPS, prebuffer=2, max_lead=8, clock=lambda: now[0])
    buf.put([1, 2, 3])
    assert buf.pop_due() == [1]
    buf.map_waiting(lambda f: -f)
    now[0] = 2 / FPS
    assert buf.pop_due() == [-2, -3]


def test_bad_settings():
    with pytest.raises(ValueError, match="prebuffer"):
        PlayoutBuffer(prebuffer=5, max_lead=4)
    with pytest.raises(ValueError, match="fps"):
        PlayoutBuffer(fps=0)


def simulate_adaptive(step_ms: list[float], *, prebuffer: int = 4, max_lead: int = 7, window: int = 48, skip: int = 8,
                      pause: tuple[float, float] | None = None) -> tuple[PlayoutBuffer, list[int], list[int]]:
    """simulate() with the engine loop's adaptive lead (RealtimeCharacter's rule). `pause`: (start s, length s)
    during which the consumer takes nothing (a stalled encoder, say), then catches up. Also returns the frames
    waiting when each step started (how long speech pushed at that moment waits before it plays) and the
    lead after each step."""
    now = [0.0]
    buf = PlayoutBuffer(FPS, prebuffer=prebuffer, max_lead=max_lead, clock=lambda: now[0])
    busy_until, next_step, made, seen, depths, leads = None, 0, 0, [], [], []
    video_ms = len(step_ms) * 4 * 1000 / FPS  # steps wait for playback: the run lasts at least the video it makes
    for ms in range(int(max(sum(step_ms), video_ms)) + 2000):
        now[0] = ms / 1000
        if busy_until is not None and now[0] >= busy_until:
            buf.put(list(range(made, made + 4)))
            made += 4
            busy_until = None
            seen.append(step_ms[next_step - 1] / 1000)
            recent = seen[skip:][-window:]
            if len(recent) == window:
                buf.adapt_lead(max(recent))
            leads.append(buf.lead)
        if busy_until is None and next_step == len(step_ms):
            break  # the last frames are in; what follows is the buffer draining, not the engine
        if pause is None or not pause[0] <= now[0] < pause[0] + pause[1]:
            buf.pop_due()
        if busy_until is None and next_step < len(step_ms) and buf.has_room():
            depths.append(len(buf.frames))
            busy_until = now[0] + step_ms[next_step] / 1000
            next_step += 1
    return buf, depths, leads


def test_the_lead_covers_the_slowest_step_with_a_margin_and_stays_within_max_lead():
    buf = PlayoutBuffer(FPS, prebuffer=4, max_lead=7)
    assert buf.lead == 7  # max_lead until told otherwise
    assert buf.adapt_lead(0.006) == 2  # a 6 ms step: 1 frame of margin beyond the step's own
    assert buf.adapt_lead(0.150) == 6  # 150 ms x 1.25 = 4.5 frames -> 5, + 1
    assert buf.adapt_lead(0.263) == 7 and buf.adapt_lead(5.0) == 7  # never above max_lead
    with pytest.raises(ValueError, match="slowest_step_s"):
        buf.adapt_lead(float("nan"))


def test_a_fast_engine_keeps_a_short_lead_and_speech_waits_behind_fewer_frames():
    steady, depths, leads = simulate_adaptive([30.0] * 240)
    assert steady.stats.underruns == 0 and leads[-1] == 2  # 30 ms x 1.25 -> 1 frame, + 1
    assert max(depths[-100:]) <= 2  # once adapted
    fixed_depths = simulate_adaptive([30.0] * 240, window=10**6)[1]  # a window that never fills: the fixed lead
    assert min(fixed_depths[-100:]) >= 4  # up to 7 wait before each step, never fewer than 4 once running


def test_a_slow_reset_step_inside_the_window_keeps_the_whole_lead_and_a_fast_one_does_not():
    slow_resets = [263.0 if i % 42 == 41 else 30.0 for i in range(240)]  # the seed's reset step, every 42 steps
    buf, _, leads = simulate_adaptive(slow_resets)
    assert buf.stats.underruns == 0 and buf.stats.released > 900  # five of them, absorbed
    assert set(leads[56:]) == {7}  # the window always holds one, so the lead never shrinks below what it needs
    fast_resets = [60.0 if i % 42 == 41 else 30.0 for i in range(240)]
    buf, depths, leads = simulate_adaptive(fast_resets)
    assert buf.stats.underruns == 0 and set(leads[56:]) == {3} and max(depths[-100:]) <= 3  # 60 ms x 1.25 -> 2, + 1


@pytest.mark.parametrize("prebuffer", [4, 7])
def test_playback_restarts_after_an_underrun_even_when_the_lead_is_shorter_than_the_prebuffer(prebuffer):
    # 6 ms steps bring the lead to 2; then the consumer stalls 300 ms and, catching up, runs the buffer dry
    buf, _, leads = simulate_adaptive([6.0] * 400, prebuffer=prebuffer, pause=(12.0, 0.3))
    assert leads[-1] == 2 and buf.stats.underruns >= 1
    assert buf.stats.released > 1500  # playback went on to the end: 400 steps are 1600 frames
    refill = PlayoutBuffer(FPS, prebuffer=prebuffer, max_lead=7)
    refill.adapt_lead(0.006)
    refill.put([0, 1, 2, 3])
    assert refill.has_room() == (prebuffer > 4)  # still filling up to prebuffer: room despite a lead of 2
