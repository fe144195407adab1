"""lab.bench's timing of variants in turns (the clock drifts between timings)."""

from lab import bench


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


def test_the_gemm_part_of_a_step_times_the_products_as_the_fused_step_feeds_them(monkeypatch):
    """The breakdown's GEMM time runs every block linear on pre-quantised inputs, as the fused step does (the
    out-projection reads the attention's e4m3 output): a quantisation pass timed there would be counted twice,
    once as GEMM and once in the step's other work."""
    import torch

    from engine.config import get_spec
    from engine.fused_block import apply_fp8_kernels
    from engine.kernels.fp8_linear import FP8Linear
    from engine.model import build_model

    spec = get_spec("tiny")
    model = apply_fp8_kernels(build_model(spec, seed=1, device="cpu", dtype=torch.float32), fuse=True)
    calls = {"forward": 0, "forward_quantized": 0, "swiglu_product": 0}
    for name in calls:
        def counted(self, *args, _name=name, _plain=getattr(FP8Linear, name)):
            calls[_name] += 1
            return _plain(self, *args)

        monkeypatch.setattr(FP8Linear, name, counted)
    bench._gemms_of_a_step(model, spec, torch.device("cpu"), torch.float32)()
    per_step = spec.passes * spec.n_blocks
    assert calls == {"forward": 0, "forward_quantized": 3 * per_step, "swiglu_product": per_step}  # qkv, out, MLP-out; MLP-in
