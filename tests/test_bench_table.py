"""lab/bench_table.py's FlashAttention-3 paragraphs, from a result shaped as lab/probes/fa3_attention_probe.py writes it,
the step's energy by part, from a result shaped as `lab.bench step` writes it, and each block kernel's energy
at the power limit, from a result shaped as lab/probes/gemm_energy_probe.py writes it, and the target commands' repeats."""

import json

from lab import bench_table
from lab.bench_table import against, fa3_attention, fast_path_targets, part_energy, repeat_runs


def probe_result(fa3_us: float) -> dict:
    row = lambda us: {"us": us, "us_runs": [us] * 5, "rel_err": 0.025, "timing": "CUDA graph of 20 calls",
                      "speedup_vs_sdpa_bf16": 80.0 / us}
    return {"torch": "2.11.0", "fa3_source": "flash-attention abc", "shape": {"heads": 20, "queries": 757, "slots": 5824,
                                                                            "live": 5785, "head_dim": 128},
            "sdpa_bf16": row(80.0), "ws_fp8": row(60.0), "fa3_fp8": row(fa3_us), "fa3_fp8_cache_views": row(fa3_us + 1),
            "fa3_fp8_splits_auto": row(fa3_us + 2), "fa3_fp8_kvcache": row(fa3_us + 3), "calls_per_step": 240}


STEP = {"serving": {"step_ms": 105.0, "step_ms_p90": 107.0, "reset_step_ms": 104.0, "reset_rotation_ms": 0.4,
                    "cache_upkeep_ms": 2.5, "peak_memory_gb": 19.4, "step_ms_with_attention_out_bf16": 105.5}}
ATTENTION = {"speedup": 1.4}


def test_the_table_lists_every_kernel_and_compares_the_fastest_fa3_run_with_ours():
    text = "\n".join(fa3_attention(probe_result(50.0)))
    assert "| SDPA, bf16 | 80.0 | 1.00x | 0.0250 |" in text
    assert "| warp-specialised FP8 (ours with P nearest 2^x, as served when that ran) | 60.0 | 1.33x |" in text
    served = "\n".join(fa3_attention({**probe_result(50.0), "ws_fp8_options": {"block_m": 128, "stages": 2, "exp2": "e4m3_bits",
                                                                              "row_sum": "tensor"}}))
    assert ("| warp-specialised FP8 (ours: P as log-linear e4m3 codes, row sums on the tensor cores, 128-row tiles, "
            "2 stages) | 60.0 | 1.33x |") in served
    assert text.count("| FlashAttention-3 FP8") == 4
    assert "FlashAttention-3 is 1.20x as fast as the engine's kernel here" in text  # 60 / 50: its fastest run
    assert "flash-attention abc" in text
    assert fa3_attention(None) == []


def test_the_targets_say_the_bound_is_beyond_fa3_only_when_it_is():
    below = "\n".join(fast_path_targets(STEP, ATTENTION, fa3=probe_result(55.0)))  # 80 / 55 = 1.45x
    assert ("reaches 1.45x at this shape on this GPU, where ours reaches 1.33x in the same run (ours with P nearest 2^x, as "
            "served when that ran): the 1.6x bound is beyond") in below
    above = "\n".join(fast_path_targets(STEP, ATTENTION, fa3=probe_result(45.0)))  # 80 / 45 = 1.78x
    assert "reaches 1.78x" in above and "bound is beyond" not in above
    assert "FlashAttention-3" not in "\n".join(fast_path_targets(STEP, ATTENTION))


def test_the_step_saving_is_the_per_call_gain_over_the_steps_calls_less_the_bf16_outputs_cost():
    text = "\n".join(fa3_attention(probe_result(50.0), STEP))  # the engine-style call: 53 us against 60
    assert "it takes 53.0 us against 60.0: 7.0 us a call, 1.68 ms over the step's 240 attention calls" in text
    assert "puts that difference at 0.50 ms a step" in text
    assert "Net, what FA3 would save: 1.18 ms by time, of a 105.0 ms step (whose p90 lies 2.0 ms above its median)" in text
    slow = "\n".join(fa3_attention(probe_result(58.0), STEP))  # 61 us: slower than ours per call
    assert "Net, what FA3 would save: -0.74 ms by time," in slow
    assert "Called as the engine" not in "\n".join(fa3_attention(probe_result(50.0)))  # no step result: no estimate
    # a step that serves the kernel otherwise than the probe ran it: the per-call figures, no saving in the step
    served = {"block_m": 128, "block_n": 128, "stages": 2, "row_sum": "tensor", "exp2": "e4m3_bits"}
    other = "\n".join(fa3_attention(probe_result(50.0), {**STEP, "serving": {**STEP["serving"], "attention_kernel_options": served}}))
    assert "it takes 53.0 us against 60.0" in other and "Net, what FA3 would save" not in other
    assert "no saving in the step is estimated from this probe" in other
    same = "\n".join(fa3_attention({**probe_result(50.0), "ws_fp8_options": served},
                                   {**STEP, "serving": {**STEP["serving"], "attention_kernel_options": served}}))
    assert "Net, what FA3 would save: 1.18 ms by time" in same
    no_cost = {"serving": {**STEP["serving"], "step_ms_with_attention_out_bf16": 104.9}}  # bf16 out measured 0.1 ms faster
    text = "\n".join(fa3_attention(probe_result(50.0), no_cost))
    assert "found no cost in its run (-0.10 ms a step, inside the run-to-run spread), so none is taken off" in text
    assert "Net, what FA3 would save: 1.68 ms by time," in text


def test_with_energy_figures_the_saving_is_also_given_at_the_power_limit():
    r = probe_result(50.0)
    r["energy"] = {"ws_fp8": {"joules_per_call": 0.044}, "fa3_fp8_kvcache": {"joules_per_call": 0.041}, "power_limit_w": 700.0}
    text = "\n".join(fa3_attention(r, STEP))
    # (44 - 41) mJ x 240 calls = 0.72 J a step; at 700 W, 1.03 ms; less the 0.50 ms of the bf16 output
    assert "FA3's call takes 41.0 mJ against 44.0 mJ: 0.72 J a step, 1.03 ms at that limit" in text
    assert "Net, what FA3 would save: 1.18 ms by time, 0.53 ms by energy at the power limit, of" in text


def test_the_parts_energy_is_set_against_what_a_100_ms_step_may_spend_at_the_power_limit():
    part = lambda joules, ms, clock: {"joules_per_call": joules, "us_per_call": 1000 * ms, "watts": 690.0, "sm_clock_mhz": clock}
    parts = {"gemm": part(59.0, 85.5, 1425), "attention": part(10.5, 15.2, 1830), "cache_upkeep": part(1.4, 2.6, None)}
    text = part_energy(parts, 74.5, 700.0)
    assert ("GEMMs 59.0 J (85.5 ms a step at a median 1425 MHz); attention 10.5 J (15.2 ms a step at a median 1830 MHz); "
            "cache upkeep 1.4 J (2.6 ms a step)") in text  # no clock reading, no clock
    assert "Together 70.9 J of the step's 74.5 J" in text
    assert "may spend 70 J at this limit: these parts alone take 101% of that, the GEMMs 84%." in text


def test_the_step_target_names_what_the_gemms_and_attention_take_of_a_100_ms_steps_energy():
    part = lambda joules: {"joules_per_call": joules, "us_per_call": 1000.0, "watts": 690.0, "sm_clock_mhz": 1500}
    step = {"power_limit_w": 700.0, "serving": {**STEP["serving"], "step_joules": 72.7, "part_energy": {
        "gemm": part(57.2), "attention": part(10.9), "cache_upkeep": part(1.1)}}}
    text = "\n".join(fast_path_targets(step, ATTENTION))
    assert ("need at most 70 J each, of which the step's GEMMs alone take 57.2 J and its attention 10.9 J, each held "
            "back to back at that limit (energy paragraph below).") in text
    del step["serving"]["part_energy"]
    assert "need at most 70 J each (energy paragraph below)." in "\n".join(fast_path_targets(step, ATTENTION))


def test_a_flipped_setting_is_set_against_the_served_step_timed_in_turns_with_it_where_the_run_did_so():
    s = {"step_ms": 103.0, "step_ms_with_triton_attention": 109.0}
    assert against(s, "step_ms_with_triton_attention") == "against 103.0 ms above"
    s["step_ms_with_triton_attention_serving"] = 102.6
    assert against(s, "step_ms_with_triton_attention") == "against 102.6 ms for the served setting, the two timed in turns"
    # FA3's net saving takes the bf16 output's cost from the same turns: 105.5 - 104.5, not 105.5 - 105.0
    paired = {"serving": {**STEP["serving"], "step_ms_with_attention_out_bf16_serving": 104.5}}
    assert "puts that difference at 1.00 ms a step" in "\n".join(fa3_attention(probe_result(50.0), paired))


def test_kernel_energy_lists_each_kernel_a_step_s_worth_and_the_padding_turns_only_where_run():
    from lab.bench_table import kernel_energy

    call = lambda mj, kernel="": {"us_clock_up": 60.0, "us_per_call": 80.0, "sm_clock_mhz": 1440, "mj_per_call": mj,
                                  "pj_per_flop": 0.616, "kernels": [kernel] if kernel else []}
    probe = {"power_limit_w": 700.0, "qkv": {"cublas": call(55.0, "nvjet_a"), "cublas_m768": call(50.0, "nvjet_b"),
                                             "triton_bn128_s4_w8": call(60.0), "triton_bn256_s3_w8": {"error": "smem"}},
             "elementwise": {"gated_sum_ln_quant_w8": call(10.0)}}
    text = "\n".join(kernel_energy(probe, None))
    assert "| qkv | cuBLAS, as served | `nvjet_a` | 60.0 | 80.0 | 1440 | 55.0 | 0.616 | 13.2 |" in text  # 240 calls a step
    assert "| qkv | Triton FP8 GEMM, 128-column tiles, 4 stages, 8 warps |" in text
    assert "256-column" not in text  # a configuration that did not build has no row
    assert "| gated_sum_ln_quant | 8 warps (as served) |  | 60.0 | 80.0 | 1440 | 10.00 |  | 2.36 |" in text  # 236 calls
    assert "timed in turns" not in text
    padded = {"serving": {"step_ms": 104.4, "step_ms_without_gemm_row_padding": 103.4,
                          "step_ms_without_gemm_row_padding_serving": 104.0}}
    turns = "\n".join(kernel_energy(probe, padded))
    assert "50.0 mJ a call against 55.0" in turns and "took 104.0 ms against 103.4 ms unpadded" in turns
    assert kernel_energy(None, padded) == []


def test_cublaslt_configurations_list_the_heuristic_then_the_least_energy_and_the_step_turns_only_where_run():
    from lab.bench_table import cublaslt_configurations

    call = lambda mj, kernel: {"us_per_call": 80.0, "sm_clock_mhz": 1500, "mj_per_call": mj, "pj_per_flop": mj / 90,
                               "kernels": [kernel]}
    row = {"scaled_mm": call(54.5, "nvjet_default"), "rank0": call(54.2, "nvjet_default"), "rank100": call(53.9, "nvjet_b"),
           "rank101": call(53.4, "nvjet_a"), "rank102": {"us_clock_up": 70.0}, "enumerated": 3}
    probe = {"command": "python -m lab.probes.cublaslt_algo_probe", "cublaslt": 130100, "qkv": row}
    lines = cublaslt_configurations(probe, None, best=2)
    text = "\n".join(lines)
    assert "cuBLASLt 13.1.0" in text and "| qkv | 3 others | `nvjet_default` torch._scaled_mm (the heuristic's) |" in text
    rows = [line for line in lines if line.startswith("|  |")]
    assert [r.split("`")[1] for r in rows] == ["nvjet_default", "nvjet_a", "nvjet_b"]  # the same kernel, then least energy first
    assert "the same, through the probe's binding (the measurement's spread) | 80.0 | 1500 | 54.20 |" in rows[0]
    assert "timed in turns" not in text
    step = {"serving": {"step_ms_without_tuned_algorithms": 102.5, "step_ms_without_tuned_algorithms_serving": 103.7,
                        "step_ms_with_combine_in_gemm": 103.8, "step_ms_with_combine_in_gemm_serving": 103.6}}
    turns = "\n".join(cublaslt_configurations(probe, step))
    assert "103.7 ms a step against 102.5 ms on the heuristic's kernels" in turns and "103.8 ms against 103.6" in turns
    assert cublaslt_configurations(None, step) == []


def test_each_step_repeat_names_its_date_and_engine_code(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_table, "RESULTS", tmp_path)
    assert repeat_runs() == []
    step = lambda ms, joules, date: {"date": date, "serving": {"step_ms": ms, "step_joules": joules}}
    (tmp_path / "step_57b_tp3_h200_repeat_1.json").write_text(json.dumps(step(103.31, 74.4, "2026-12-01")))
    (tmp_path / "step_57b_tp3_h200_repeat_2.json").write_text(json.dumps(step(102.12, 72.5, "2026-12-02")))
    (tmp_path / "attention_57b_tp3_h200_repeat_1.json").write_text(json.dumps({"date": "2026-12-01", "speedup": 1.631}))
    text = "\n".join(repeat_runs())
    assert "1.631x (`attention_57b_tp3_h200_repeat_1.json`) (2026-12-01; the attention kernels are unchanged since)" in text
    assert ("103.3 ms at 74.4 J a step (`step_57b_tp3_h200_repeat_1.json`; 2026-12-01, at the engine code of "
            "`step_57b_tp3_h200_2026-12-01.json`, before its graph wrote the sink's keys)") in text
    assert ("102.1 ms at 72.5 J a step (`step_57b_tp3_h200_repeat_2.json`; 2026-12-02, at the engine code of "
            "`step_57b_tp3_h200_2026-12-02.json`, before the Triton kernels launched with programmatic dependent launch)") in text
    (tmp_path / "step_57b_tp3_h200_repeat_3.json").write_text(json.dumps(step(98.57, 71.0, "2026-12-02")))
    assert ("98.6 ms at 71.0 J a step (`step_57b_tp3_h200_repeat_3.json`; 2026-12-02, at the engine code of "
            "`step_57b_tp3_h200_attn_out_cublas.json`, before the out-projection moved to the Triton FP8 GEMM)") in "\n".join(repeat_runs())
    (tmp_path / "step_57b_tp3_h200_repeat_5.json").write_text(json.dumps(step(97.94, 70.1, "2026-12-03")))
    assert ("97.9 ms at 70.1 J a step (`step_57b_tp3_h200_repeat_5.json`; 2026-12-03, at the engine code of the step "
            "above)") in "\n".join(repeat_runs())


def test_the_run_before_the_out_projection_moved_to_triton_is_set_against_this_runs_flip(tmp_path, monkeypatch):
    from lab.bench_table import run_before_attn_out_triton

    monkeypatch.setattr(bench_table, "RESULTS", tmp_path)
    step = {"serving": {"step_ms": 98.23, "step_ms_with_attn_out_gemm_cublas": 99.4, "step_ms_with_attn_out_gemm_cublas_serving": 98.01}}
    assert run_before_attn_out_triton(step) == []  # no earlier run to set it against
    earlier = {"date": "2026-12-02", "serving": {"step_ms": 96.43, "step_ms_with_triton_gemms": 97.38,
                                                 "step_ms_with_triton_gemms_serving": 98.09}}
    (tmp_path / "step_57b_tp3_h200_attn_out_cublas.json").write_text(json.dumps(earlier))
    text = "\n".join(run_before_attn_out_triton(step))
    assert "96.4 ms per step, here 98.2" in text and "took 99.4 against 98.0 ms" in text
    assert "97.4 against 98.1 ms (`step_57b_tp3_h200_attn_out_cublas.json`)." in text  # the only run at that code here
    assert run_before_attn_out_triton({"serving": {"step_ms": 98.2}}) == []  # a run that did not flip the out-projection


def test_part_energy_says_when_the_parts_alone_exceed_the_step():
    parts = {"gemm": {"joules_per_call": 61.6, "us_per_call": 87600}, "attention": {"joules_per_call": 9.1, "us_per_call": 12900}}
    assert "Together 70.7 J, more than the step's 70.0 J." in part_energy(parts, 70.0, 700)
    assert "Together 70.7 J of the step's 72.0 J; the rest is the other kernels'." in part_energy(parts, 72.0, 700)


def test_the_run_before_pdl_is_set_against_this_runs_step_without_pdl_timed_in_turns(tmp_path, monkeypatch):
    from lab.bench_table import run_before_pdl

    monkeypatch.setattr(bench_table, "RESULTS", tmp_path)
    step = {"serving": {"step_ms": 96.43, "step_ms_without_pdl": 98.14, "step_ms_without_pdl_serving": 97.79}}
    assert run_before_pdl(step) == []  # no earlier run to set it against
    (tmp_path / "step_57b_tp3_h200_2026-12-02.json").write_text(json.dumps({"date": "2026-12-02", "serving": {"step_ms": 100.62}}))
    text = "\n".join(run_before_pdl(step))
    assert "100.6 ms per step, here 96.4" in text and "took 98.1 against 97.8 ms" in text
    assert run_before_pdl({"serving": {"step_ms": 96.4}}) == []  # a run that did not time the step without PDL
