"""engine.bench's timing of variants in turns (the clock drifts between timings)."""

from engine import bench


def test_variants_are_timed_in_turns_so_a_drift_falls_on_each_alike():
    order = []

    def time_part(fn) -> float:  # a clock that slows down steadily: each timing 1 ms longer than the one before
        order.append(fn())
        return float(len(order))

    medians = bench._in_turns({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, time_part, rounds=3)
    assert order == ["a", "b", "c"] * 3
    assert medians == {"a": 4.0, "b": 5.0, "c": 6.0}  # 1 ms apart, the drift of one place in the turn, not of three


def test_every_timing_is_kept_in_the_order_taken():
    clock = iter(range(1, 7))
    runs = bench.timings_in_turns({"a": 0, "b": 0}, lambda _: float(next(clock)), rounds=3)
    assert runs == {"a": [1.0, 3.0, 5.0], "b": [2.0, 4.0, 6.0]}
