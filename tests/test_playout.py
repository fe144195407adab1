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
