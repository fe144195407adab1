"""lab/probes/step_profile.py's timeline of one step's kernels (the --graph mode's arithmetic)."""


from lab.probes.step_profile import timeline


def test_busy_time_counts_overlapping_kernels_once_and_gaps_are_the_idle_between():
    # (start us, duration us): two streams overlapping from 5 to 10, then idle 15..20 and 25..30
    kernels = [(0.0, 10.0, "gemm"), (5.0, 10.0, "attention"), (20.0, 5.0, "sum"), (30.0, 1.0, "quant")]
    t = timeline(kernels)
    assert t == {"kernels": 4, "span_ms": 0.031, "busy_ms": 0.021, "idle_gaps": 2, "idle_ms": 0.01,
                 "idle_gap_median_us": 5.0, "idle_gap_max_us": 5.0, "kernel_ms": 0.026}


def test_a_kernel_inside_a_longer_one_adds_no_busy_time():
    t = timeline([(0.0, 100.0, "long"), (10.0, 5.0, "short"), (100.0, 10.0, "next")])
    assert t["busy_ms"] == t["span_ms"] == 0.11 and t["idle_gaps"] == 0 and t["kernel_ms"] == 0.115
    assert t["idle_gap_max_us"] == 0.0
