"""Write docs/benchmarks.md: per target, the latest figure, read from its result file in docs/results/.

    python -m lab.bench_table

Each row names one result file; the figures are read from it, never typed here. Which file is the latest
of a target is named here; a dated result of the same benchmark (bench, spec, tensor-parallel shard, world)
with a later date than the one named is an error, so a newer run cannot be left out unnoticed. Older runs
stay in docs/results/ and in git.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
OUT = ROOT / "docs" / "benchmarks.md"


class ResultError(Exception):
    """A result file that is missing, unreadable, or lacks a figure a row reads."""


class Result(dict):
    """A result's JSON object; a missing key raises ResultError naming the file and the key."""

    def __init__(self, data: dict, where: str):
        super().__init__(data)
        self.where = where

    def __getitem__(self, key):
        try:
            value = super().__getitem__(key)
        except KeyError:
            raise ResultError(f"{self.where}: no {key!r}") from None
        return Result(value, f"{self.where}[{key!r}]") if isinstance(value, dict) else value


def load(name: str) -> Result:
    path = RESULTS / name
    if not path.is_file():
        raise ResultError(f"docs/results/{name}: missing")
    text = path.read_text()
    if path.suffix == ".txt":
        return Result({"text": text.strip(), "last_line": text.strip().splitlines()[-1]}, f"docs/results/{name}")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ResultError(f"docs/results/{name}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ResultError(f"docs/results/{name}: not a JSON object")
    return Result(data, f"docs/results/{name}")


def committed(name: str) -> str:
    """The date of the last commit that wrote the file (for results that carry no date of their own)."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%cs", "--", f"docs/results/{name}"], cwd=ROOT,
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "not committed"


def check_latest(name: str, r: Result) -> None:
    if "date" not in r or "bench" not in r:
        return
    key = lambda d: (d.get("bench"), d.get("spec"), d.get("tp_shard"), d.get("world"))
    for other in sorted(RESULTS.glob("*.json")):
        try:
            d = json.loads(other.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(d, dict) and key(d) == key(r) and str(d.get("date", "")) > str(r["date"]):
            raise ResultError(f"docs/results/{other.name} ({d['date']}) is newer than docs/results/{name} "
                              f"({r['date']}): name it in lab/bench_table.py")


@dataclass
class Row:
    what: str
    file: str
    latest: Callable[[Result], str]
    bound: str | Callable[[Result], str] = ""
    met: Callable[[Result], bool | None] | None = None


def mode(r: Result, name: str) -> Result:
    for i, m in enumerate(r["modes"]):
        if m["mode"] == name:
            return Result(m, f"{r.where}['modes'][{i}]")
    raise ResultError(f"{r.where}: no mode {name!r}")


def json_target(gpu_only: bool = False) -> dict:
    """Bound and verdict as the result states them (`target`: limit_s, met); gpu_only: none for a CPU run."""
    applies = lambda r: not gpu_only or r["device"] == "cuda"
    return {"bound": lambda r: f"<= {r['target']['limit_s']:g} s" if applies(r) else "(a one-GPU target)",
            "met": lambda r: r["target"]["met"] if applies(r) else None}


# Bounds and verdicts (the targets), then how each kind of result reads.
s = lambda x: f"{x:.2f} s"
le = lambda limit, unit, get: {"bound": f"<= {limit:g} {unit}", "met": lambda r: get(r) <= limit}
PASS = {"bound": "all pass", "met": lambda r: not any(w in r["last_line"] for w in (" failed", " error"))}
REAL_TIME = {"bound": "24 fps, no underrun", "met": lambda r: r["fps"] >= 23.99 and r["underruns"] == 0}
PERIOD = {"bound": lambda r: f"<= {r['real_time_period_ms']:.1f} ms", "met": lambda r: r["period_ms"] <= r["real_time_period_ms"]}
REAL_TIME_STEPS = 6.0  # 24 fps, 4 frames a step
STEPS = {"bound": f">= {REAL_TIME_STEPS:g}", "met": lambda r: r["steps_per_second"] >= REAL_TIME_STEPS}
AGENT = {"bound": lambda r: "; ".join(r["targets"]), "met": lambda r: all(r["targets"].values())}
turn = lambda r: (lambda m: f"{s(m['end_of_turn_delay_s']['median'])} (p95 {s(m['end_of_turn_delay_s']['p95'])}; "
                            f"{m['cut_early']} cut)")(mode(r, "smart_turn"))
voice_e2e = lambda r: (f"{s(r['stages_s']['e2e_latency']['median'])} (p95 {s(r['stages_s']['e2e_latency']['p95'])}"
                       + (f"; first text {s(r['stages_s']['llm_ttft']['median'])})" if r["agent"] == "local" else ")"))
agent = lambda r: f"{r['correct_share']:.0%}, {r['follow_up_share']:.0%}, {s(r['first_text_s']['median'])} ({r['turns']} turns)"
app_e2e = lambda r: (f"{s(r['target']['median_s'])} (p95 {s(r['target']['p95_s'])}); engine {r['engine']['fps']:.1f} fps, "
                     f"step p50 {r['engine']['step_ms_p50']:.1f} ms"
                     + (f"; {r['engine']['video_fps']:.1f} new pictures a second, the voice's samples concealed by the "
                        f"browser {r['voice_at_the_browser']['concealed_share']:.1%}" if "video_fps" in r["engine"] else ""))
lipsync = lambda r: (f"{r['generated']['score']:.3f} (ceiling {r['ceiling']['score']:.3f}, floor {r['floor']['score']:.3f}): "
                     f"{r['ratio_to_ceiling']:.0%} of the ceiling")
motion = lambda r: (f"{r['motion']['within_to_renderer']:.0%} of the renderer's per-frame change "
                    f"({r['motion']['within_to_across']:.0%} of the change across groups)")
MOTION = {"bound": ">= 50%", "met": lambda r: r["motion"]["within_to_renderer"] >= 0.5
          and r["motion"]["within_to_across"] >= 0.5}
offsets = lambda r: (f"{r['clips']['best_offset_zero']} of {r['clips']['of']} clips "
                     f"(offsets {', '.join(str(c['best_offset']) for c in r['clips']['clips'])})")
OFFSETS = {"bound": ">= 4 of 5", "met": lambda r: r["clips"]["best_offset_zero"] >= 4}
listening = lambda r: (f"|corr| {abs(r['generated']['corr']):.2f} (shuffled voice at most {r['generated']['shuffled_abs_max']:.2f}; "
                       f"renderer {abs(r['rendered']['corr']):.2f})")
LISTENING = {"bound": "above the shuffled voice", "met": lambda r: r["generated"]["above_shuffled"]}
sv = lambda r: r["serving"]
STEP = "step_57b_tp3_h200_move_now.json"
STEP_BEFORE_MOVE = "step_57b_tp3_h200_move_before_1.json"  # the tree before engine/'s structure move, same call
ATTENTION = "attention_57b_tp3_h200_repeat_4.json"

SECTIONS = [  # (title, note, rows)
    ("GPU fast path: the 57b step, one rank at tensor-parallel degree 3",
     "One H200, one rank's compute (communication left out), random weights, the step's CUDA graph. Rows without a "
     "bound: figures beside the targets.", [
        Row("rank step, median, back to back", STEP, lambda r: f"{sv(r)['step_ms']:.1f} ms (p90 {sv(r)['step_ms_p90']:.1f})",
            **le(100, "ms", lambda r: sv(r)["step_ms"])),
        Row("the same, the tree before the structure move (22f459a), in turns in the same device call", STEP_BEFORE_MOVE,
            lambda r: f"{sv(r)['step_ms']:.1f} ms (p90 {sv(r)['step_ms_p90']:.1f}); this tree "
                      f"{sv(load(STEP))['step_ms'] / sv(r)['step_ms'] - 1:+.1%}",
            bound="this tree within 2%", met=lambda r: abs(sv(load(STEP))["step_ms"] / sv(r)["step_ms"] - 1) <= 0.02),
        Row("cache upkeep per step", STEP, lambda r: f"{sv(r)['cache_upkeep_ms']:.2f} ms",
            **le(3, "ms", lambda r: sv(r)["cache_upkeep_ms"])),
        Row("position reset: reset step - step (the rotation alone)", STEP,
            lambda r: f"{sv(r)['reset_step_ms'] - sv(r)['step_ms']:+.1f} ms ({sv(r)['reset_rotation_ms']:.2f} ms)",
            **le(10, "ms", lambda r: sv(r)["reset_step_ms"] - sv(r)["step_ms"])),
        Row("FP8 attention vs SDPA bf16, production shape", ATTENTION,
            lambda r: f"{r['speedup']:.3f}x ({r['speedup_e4m3_out']:.3f}x with the e4m3 output as served)",
            bound=">= 1.6x", met=lambda r: r["speedup"] >= 1.6),
        Row("peak GPU memory, shard + FP8 cache", STEP, lambda r: f"{sv(r)['peak_memory_gb']:.1f} GB",
            **le(80, "GB", lambda r: sv(r)["peak_memory_gb"])),
        Row("energy per step, back to back", STEP,
            lambda r: f"{sv(r)['step_joules']:.1f} J at {sv(r)['step_watts']:.0f} W (power limit {r['power_limit_w']:.0f} W)"),
        Row("eager baseline (naive cache, SDPA bf16, bf16 GEMMs)", STEP,
            lambda r: f"{r['baseline']['step_ms']:.1f} ms: the served step is {r['speedup']:.2f}x faster"),
        Row("GPU tests", "pytest_gpu_h200.txt", lambda r: f"`{r['last_line']}`", **PASS),
        Row("cache upkeep alone: ring (Triton) vs naive", "cache_57b_tp3_h200.json",
            lambda r: f"{r['ring_triton_ms']:.2f} vs {r['naive_ms']:.1f} ms a step; reset rotation {r['reset_triton_ms']:.2f} ms"),
        Row("FlashAttention-3 FP8, called as the engine would, vs ours (as served then)", "fa3_fp8_attention_h200.json",
            lambda r: f"{r['fa3_fp8_kvcache']['us']:.1f} vs {r['ws_fp8']['us']:.1f} us a call (SDPA bf16 {r['sdpa_bf16']['us']:.1f})"),
        Row("cuDNN FP8 SDPA (its fastest) vs ours (as served then)", "cudnn_fp8_attention_h200.json",
            lambda r: f"{min(r['cudnn_fp8_prefix']['us'], r['cudnn_fp8_padding_mask']['us']):.1f} vs {r['ws_fp8']['us']:.1f} us "
                      f"a call (SDPA bf16 {r['sdpa_bf16']['us']:.1f})"),
    ]),
    ("Two GPUs", "Two H200s of one host (NVLink; NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).", [
        Row("57b step at degree 2, NCCL all-reduce (compute only)", "step_57b_x2_h200.json",
            lambda r: f"{r['nccl']['step_ms']:.1f} ms ({r['none']['step_ms']:.1f} ms)"),
        Row("57b step at degree 2, fused GEMM + all-reduce, partials pushed", "step_57b_x2_h200.json",
            lambda r: f"{r['symmetric_tiles_push']['step_ms']:.1f} ms"),
        Row("`demo` (random weights) step period, decoder on GPU 1", "pipeline_demo_x2_h200.json",
            lambda r: f"{r['period_ms']:.1f} ms ({r['fps']:.0f} fps)", **PERIOD),
        Row("two-GPU tests", "pytest_gpu_x2.txt", lambda r: f"`{r['last_line']}`", **PASS),
    ]),
    ("A demo-character session with the decoder on its own GPU",
     "The trained `demo` in real time, diffusion on GPU 0 and the decoder on GPU 1 in their own processes, scripted turns.", [
        Row("session, 5 minutes", "session_demo_x2_h200.json", lambda r: f"{r['fps']:.2f} fps, {r['underruns']} underruns, "
            f"{r['seconds_below_24fps']} of {r['whole_seconds']} s below 24 fps", **REAL_TIME),
    ]),
    ("Demo character",
     f"Real time: {REAL_TIME_STEPS:g} steps a second (24 fps, 4 frames a step). Lip sync: generated mouth against the "
     "audio envelope; ceiling: the renderer's own frames; floor: shuffled audio.", [
        Row("`demo`, one H200, 10-minute session, CUDA graph", "soak_demo_h200.json", lambda r: f"{r['fps']:.2f} fps, step "
            f"p50 {r['step_ms']['p50']:.1f} ms (p99 {r['step_ms']['p99']:.1f}), {r['underruns']} underruns", **REAL_TIME),
        Row("`demo` (random weights), one H200, step period, decoder in its own process", "pipeline_demo_h200.json",
            lambda r: f"{r['period_ms']:.1f} ms (diffusion {r['diffusion_ms']:.1f}, decode {r['decode_ms']:.1f})", **PERIOD),
        Row("`demo`, one H200, 2-minute session, the listening decoder", "soak_demo_h200_120s.json",
            lambda r: f"{r['fps']:.2f} fps, step p50 {r['step_ms']['p50']:.1f} ms (p99 {r['step_ms']['p99']:.1f}), "
                      f"{r['underruns']} underruns", **REAL_TIME),
        Row("`demo`, one H200, 1-minute session, as served (per-frame mouth, each step's first frame blended)",
            "soak_demo_h200_60s_blend.json", lambda r: f"{r['fps']:.2f} fps, step p50 {r['step_ms']['p50']:.1f} ms "
            f"(p99 {r['step_ms']['p99']:.1f}), {r['underruns']} underruns", **REAL_TIME),
        Row("the same, no blend (`group_blend=0`), run just after", "soak_demo_h200_60s_noblend.json",
            lambda r: f"{r['fps']:.2f} fps, step p50 {r['step_ms']['p50']:.1f} ms (p99 {r['step_ms']['p99']:.1f}), "
                      f"{r['underruns']} underruns", **REAL_TIME),
        Row("`demo`, one H200, 10 minutes offline: first against last minute", "drift_demo_h200.json",
            lambda r: f"{r['drift']['verdict']} (score slope {r['drift']['score_slope_per_minute']:+.4f} a minute)",
            bound="stable", met=lambda r: r["drift"]["verdict"] == "stable"),
        Row("`demo`, 2-core CPU, steps a second (with decoding and scoring)", "lipsync_demo_cpu_blend.json",
            lambda r: f"{r['steps_per_second']:.1f}", **STEPS),
        Row("`demo-cpu`, 2-core CPU, steps a second (with decoding and scoring)", "lipsync_demo-cpu_cpu_blend.json",
            lambda r: f"{r['steps_per_second']:.1f}", **STEPS),
        Row("lip sync, `demo`, 2-core CPU", "lipsync_demo_cpu_blend.json", lipsync),
        Row("lip sync, `demo-cpu`, 2-core CPU", "lipsync_demo-cpu_cpu_blend.json", lipsync),
        Row("lip sync, `demo`, one H200", "lipsync_demo_h200_blend.json", lipsync),
        Row("lip sync, `demo-cpu`, one H200", "lipsync_demo-cpu_h200_blend.json", lipsync),
        Row("lip sync, `demo`, one H200, the decoder before the per-frame mouth", "lipsync_demo_h200_listen.json", lipsync),
        Row("lip sync, `demo-cpu`, one H200, the decoder before the per-frame mouth", "lipsync_demo-cpu_h200_listen.json",
            lipsync),
        Row("lips in time: best offset 0, held-out speech in 5 clips, `demo`, 2-core CPU", "lipsync_demo_cpu_blend.json",
            offsets, **OFFSETS),
        Row("the same, `demo-cpu`, 2-core CPU", "lipsync_demo-cpu_cpu_blend.json", offsets, **OFFSETS),
        Row("the same, `demo`, one H200", "lipsync_demo_h200_blend.json", offsets, **OFFSETS),
        Row("the same, `demo-cpu`, one H200", "lipsync_demo-cpu_h200_blend.json", offsets, **OFFSETS),
        Row("the same, `demo`, one H200, the decoder before the per-frame mouth", "lipsync_demo_h200_listen.json",
            offsets, **OFFSETS),
        Row("per-frame mouth motion inside a latent group, `demo`, 2-core CPU", "lipsync_demo_cpu_blend.json", motion,
            **MOTION),
        Row("the same, `demo-cpu`, 2-core CPU", "lipsync_demo-cpu_cpu_blend.json", motion, **MOTION),
        Row("the same, `demo`, one H200", "lipsync_demo_h200_blend.json", motion, **MOTION),
        Row("the same, `demo-cpu`, one H200", "lipsync_demo-cpu_h200_blend.json", motion, **MOTION),
        Row("the same, `demo`, 2-core CPU, each step's first frame as the codec draws it (`--group-blend 0`)",
            "lipsync_demo_cpu_mouth.json", motion, **MOTION),
        Row("the same, `demo-cpu`, 2-core CPU, as the codec draws it", "lipsync_demo-cpu_cpu_mouth.json", motion, **MOTION),
        Row("listening: the picture's change with the user's voice, `demo`, one H200", "listen_demo_h200.json", listening,
            **LISTENING),
        Row("the same, `demo-cpu`, 2-core CPU", "listen_demo-cpu_cpu_mouth.json", listening, **LISTENING),
    ]),
    ("Voice loop", "End of speech to the first reply audio, medians over Piper-spoken questions fed in real time.", [
        Row("end of turn, Smart Turn: delay (paused questions cut early)", "turn_bench_cpu_asks.json", turn,
            bound=lambda r: f"<= {r['target']['end_of_turn_delay_median_s']:g} s, {r['target']['cut_early']} cut",
            met=lambda r: mode(r, "smart_turn")["met"]),
        Row("1.5B model, CPU, the defaults", "voice_bench_llm_cpu_asr_window.json", voice_e2e, **json_target()),
        Row("0.5B model (`lite`), CPU", "voice_bench_llm_cpu_05b.json", voice_e2e, **json_target()),
        Row("template agent (since replaced by the model), the GPU machine's CPU", "voice_bench_h200.json", voice_e2e,
            **json_target()),
        Row("what the 1.5B model says: correct, follow-ups, first text", "agent_bench_cpu.json", agent, **AGENT),
        Row("what the 0.5B model says", "agent_bench_cpu_05b.json", agent, **AGENT),
    ]),
    ("App", "End of speech to the character's voice at the browser (chromium under Playwright), medians.", [
        Row("`demo`, one H200, template agent", "app_bench_demo_h200_graph.json", app_e2e, **json_target(True)),
        Row("`demo`, one H200, 1.5B model on the GPU", "app_bench_llm_h200_repeat.json", app_e2e, **json_target(True)),
        Row("`demo`, one H200, 1.5B model on its CPU (8 threads)", "app_bench_llm_h200_cpu_llm.json", app_e2e,
            **json_target(True)),
        Row("`--spec auto` (`demo-cpu`), 2-core CPU, `llm: auto` (the 0.5B), the engine on one thread in bfloat16",
            "app_bench_auto_cpu_asr_window.json", app_e2e, **json_target(True)),
        Row("the same, the 1.5B model", "app_bench_cpu_budget_llm15.json", app_e2e, **json_target(True)),
        Row("the same, 1.5B model, the engine on two threads in float32, before the CPU budget",
            "app_bench_auto_cpu_mouth.json", app_e2e, **json_target(True)),
        Row("the same, the listening decoder before the per-frame mouth", "app_bench_auto_cpu_listen.json", app_e2e,
            **json_target(True)),
        Row("the same, the decoder before listening, run just before", "app_bench_auto_cpu_listen_baseline.json", app_e2e,
            **json_target(True)),
        Row("`tiny`, 2-core CPU, template agent", "app_bench_tiny_cpu_adaptive_lead.json", app_e2e, **json_target(True)),
    ]),
]

LIPSYNC_CMD = "python -m lab.quality lipsync --spec {} --audio data/eval.wav --device {} --clips 5 --json"
COMMANDS = {
    STEP: "python -m lab.bench step --spec characters-57b --tp-shard 3 --json",
    ATTENTION: "python -m lab.bench attention --tp-shard 3 --json",
    STEP_BEFORE_MOVE: "BEFORE_TAR=data/before-move.tar.gz bash lab/device/gpu_suite.sh step-move (the tree of 22f459a)",
    "pytest_gpu_h200.txt": "bash lab/device/gpu_suite.sh tests",
    "cache_57b_tp3_h200.json": "python -m lab.bench cache --device cuda --spec characters-57b --tp-shard 3 --json",
    "fa3_fp8_attention_h200.json": "FA3_SRC=<flash-attention checkout> bash lab/device/gpu_suite.sh attention-fa3",
    "cudnn_fp8_attention_h200.json": "pip install nvidia-cudnn-frontend && python -m lab.probes.cudnn_attention_probe",
    "step_57b_x2_h200.json": "python -m lab.bench step --spec characters-57b --world 2 --json",
    "pipeline_demo_x2_h200.json": "python -m lab.bench pipeline --spec demo --gpus 0,1 --decoder-gpu 1 --json",
    "pytest_gpu_x2.txt": "python -m pytest -q tests/test_gemm_allreduce.py tests/test_distributed.py -k \"two_gpus or one_rank\"",
    "session_demo_x2_h200.json": "SESSION_SECONDS=300 bash lab/device/gpu_suite.sh session2",
    "soak_demo_h200.json": "python -m lab.soak --spec demo --config cuda-graph --seconds 600 --json",
    "pipeline_demo_h200.json": "python -m lab.bench pipeline --spec demo --json",
    "soak_demo_h200_120s.json": "python -m lab.soak --spec demo --config cuda-graph --seconds 120 --json",
    "soak_demo_h200_60s_blend.json": "python -m lab.soak --spec demo --config cuda-graph --seconds 60 --json",
    "soak_demo_h200_60s_noblend.json": "python -m lab.soak --spec demo --config cuda-graph,group_blend=0 --seconds 60 --json",
    "drift_demo_h200.json": "python -m lab.quality drift --spec demo --minutes 10 --json",
    "lipsync_demo_h200_blend.json": LIPSYNC_CMD.format("demo", "cuda"),
    "lipsync_demo-cpu_h200_blend.json": LIPSYNC_CMD.format("demo-cpu", "cuda"),
    "lipsync_demo_h200_listen.json": LIPSYNC_CMD.format("demo", "cuda"),
    "lipsync_demo-cpu_h200_listen.json": LIPSYNC_CMD.format("demo-cpu", "cuda"),
    "lipsync_demo_cpu_blend.json": LIPSYNC_CMD.format("demo", "cpu"),
    "lipsync_demo-cpu_cpu_blend.json": LIPSYNC_CMD.format("demo-cpu", "cpu"),
    "lipsync_demo_cpu_mouth.json": LIPSYNC_CMD.format("demo", "cpu") + " (before --group-blend: as 0)",
    "lipsync_demo-cpu_cpu_mouth.json": LIPSYNC_CMD.format("demo-cpu", "cpu") + " (before --group-blend: as 0)",
    "listen_demo-cpu_cpu_mouth.json": "python -m lab.quality listen --spec demo-cpu --audio data/eval.wav --device cpu "
                                      "--sheet docs/listen_demo-cpu.png --json",
    "listen_demo_h200.json": "python -m lab.quality listen --spec demo --audio data/eval.wav --device cuda --json",
    "turn_bench_cpu_asks.json": "python -m lab.turn_bench --json --mode smart_turn",
    "voice_bench_llm_cpu_asr_window.json": "python -m lab.voice_bench --json --utterances 10",
    "voice_bench_llm_cpu_05b.json": "python -m lab.voice_bench --json --utterances 10 --llm qwen2.5-0.5b",
    "voice_bench_h200.json": "python3 lab/device/with_site.py /tmp/site lab.voice_bench --device cpu --json",
    "agent_bench_cpu.json": "python -m lab.agent_bench --json",
    "agent_bench_cpu_05b.json": "python -m lab.agent_bench --json --llm qwen2.5-0.5b",
    "app_bench_demo_h200_graph.json": "APP_UTTERANCES=8 bash lab/device/gpu_suite.sh app",
    "app_bench_llm_h200_repeat.json": "python -m lab.app_bench --device cuda --utterances 8 --json (llama-cpp-python's CUDA build)",
    "app_bench_llm_h200_cpu_llm.json": "python -m lab.app_bench --device cuda --utterances 8 --json",
    "app_bench_auto_cpu_asr_window.json": "python -m lab.app_bench --json",
    "app_bench_cpu_budget_llm15.json": "python -m lab.app_bench --json --config llm.yaml (llm: qwen2.5-1.5b)",
    "app_bench_auto_cpu_mouth.json": "python -m lab.app_bench --device cpu --utterances 4 --json",
    "app_bench_auto_cpu_listen.json": "python -m lab.app_bench --device cpu --utterances 4 --json",
    "app_bench_auto_cpu_listen_baseline.json": "python -m lab.app_bench --device cpu --utterances 4 --json "
                                               "(assets/demo-cpu-codec.pt of 912bd84)",
    "app_bench_tiny_cpu_adaptive_lead.json": "python -m lab.app_bench --spec tiny --utterances 4 --json",
}


def machine(name: str, r: Result) -> str:
    """The GPU as the result names it, else as its file name does (`_h200`, `_x2`); cores and load where recorded."""
    gpu = "2x H200" if "_x2" in name else "H200" if "_h200" in name or name.startswith("pytest_gpu") else ""
    where = str(r["device"]) if str(r.get("device", "")).startswith("NVIDIA") else (gpu or "CPU")
    if gpu and r.get("device") == "cpu":
        where += ", on its CPU"
    if "cpu_count" in r:
        load_avg = r.get("load_average_before")
        where += f", {r['cpu_count']} cores" + (f", load {load_avg[0]:g}" if load_avg else "")
    return where


def versions(r: Result) -> str:
    v = [f"torch {r['torch']}"] if "torch" in r else []
    v += [f"triton {r['triton']}"] if "triton" in r else []
    return ", ".join(v) or "-"


def cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", "; ")


def render() -> str:
    results: dict[str, Result] = {}
    out = ["# Benchmarks", "",
           "Generated by `python -m lab.bench_table` from `docs/results/`: per target, the latest result. Each figure is read "
           "from the result file named in its row; the runs table below gives each file's command, machine, versions and "
           "date. Older runs: the other files in `docs/results/` and git history.", "",
           f"GPU machine: {cell(load('gpu_h200.txt')['text'])}. Two GPUs: {cell(load('gpu_h200_x2.txt')['text'])}.", ""]
    for title, note, rows in SECTIONS:
        out += [f"## {title}", "", note, "", "| what | bound | latest | met | result |", "|---|---|---|---|---|"]
        for row in rows:
            if row.file not in results:
                results[row.file] = load(row.file)
                check_latest(row.file, results[row.file])
            r = results[row.file]
            bound = row.bound(r) if callable(row.bound) else row.bound
            met = row.met(r) if row.met else None
            verdict = "" if met is None else ("yes" if met else "no")
            out.append(f"| {row.what} | {cell(bound)} | {cell(row.latest(r))} | {verdict} | `{row.file}` |")
        out.append("")
    out += ["## Runs", "", "| result | command | machine | versions | date |", "|---|---|---|---|---|"]
    for name, r in results.items():
        if name not in COMMANDS:
            raise ResultError(f"docs/results/{name}: no command named for it in lab/bench_table.py")
        date = r["date"] if "date" in r else committed(name)
        out.append(f"| `{name}` | `{cell(COMMANDS[name])}` | {cell(machine(name, r))} | {cell(versions(r))} | {date} |")
    return "\n".join(out) + "\n"


def main() -> None:
    try:
        text = render()
    except ResultError as e:
        raise SystemExit(f"bench_table: {e}") from None
    OUT.write_text(text)


if __name__ == "__main__":
    main()
