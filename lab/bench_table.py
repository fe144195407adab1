"""Write docs/benchmarks.md from the JSON results under docs/results/ (numbers are never typed by hand).

    python -m lab.bench_table
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


def load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def ms(x: float) -> str:
    return f"{x:.1f}"


def train_summary(path: Path) -> dict | None:
    """Totals from a training log (JSON lines of `python -m training.train all`, one or more resumed calls)."""
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    saved = {r["phase"]: r for r in rows if r.get("event") == "saved"}
    codec_psnr = [r["psnr"] for r in rows if r["phase"] == "codec" and "psnr" in r][-10:]
    if "codec" not in saved or "dit" not in saved:
        return None
    return {"codec": saved["codec"], "dit": saved["dit"], "codec_psnr": sum(codec_psnr) / len(codec_psnr),
            "dit_loss": [r["loss"] for r in rows if r["phase"] == "dit" and "loss" in r][-1]}


LIPSYNC_MACHINES = {"h200": "one H200 (cuda)", "cpu": "2-core CPU"}


def demo_character(gpu: str) -> list[str]:
    out: list[str] = []
    train = train_summary(RESULTS / "train_demo_h200.jsonl")
    if train:
        c, d = train["codec"], train["dit"]
        out += ["## The demo character: training", "",
                f"Hardware: {gpu}. Corpus: `python -m training.train corpus --out data/speech.npz --minutes 15 --seed 0` "
                "(here, espeak-ng + piper), then on the GPU, three calls of "
                "`python -m training.train all --spec demo --corpus data/speech.npz --device cuda --assets out/assets "
                "--work out/train --session-minutes 9.3 [--resume]` (log: `docs/results/train_demo_h200.jsonl`).", "",
                "| part | steps | training seconds | final | size MB |", "|---|---|---|---|---|",
                f"| codec (4 frames <-> 1 latent) | {c['steps']} | {c['elapsed']:.0f} | PSNR {train['codec_psnr']:.1f} dB "
                f"(training batches, last 10 logs) | {c['mb']:.1f} |",
                f"| DiT (teacher forcing, session attention) | {d['steps']} | {d['elapsed']:.0f} | loss {train['dit_loss']:.4f} "
                f"| {d['mb']:.1f} |",
                f"| total | | {c['elapsed'] + d['elapsed']:.0f} ({(c['elapsed'] + d['elapsed']) / 60:.1f} min) | | "
                f"{c['mb'] + d['mb']:.1f} |", ""]
    rows = [(name, load(f"lipsync_demo_{name}.json")) for name in ("h200", "cpu")]
    rows = [(name, r) for name, r in rows if r]
    if rows:
        out += ["## The demo character: lip sync", "",
                "The engine's generated frames (ring FP8 cache, position reset every 42 steps, decoder on the same "
                "device) scored against the audio envelope; ceiling = the renderer's own frames, floor = the generated "
                "mouth against shuffled audio. Audio: `python -m lab.eval_speech data/eval.wav` (held-out piper speech).", "",
                "Command: `python -m lab.quality lipsync --spec demo --audio data/eval.wav --device DEVICE --json` "
                "(results: `docs/results/lipsync_demo_*.json`)", "",
                "| machine | seconds | generated score | ceiling | floor | generated / ceiling | steps/s (real time: 6) |",
                "|---|---|---|---|---|---|---|"]
        for name, r in rows:
            out.append(f"| {LIPSYNC_MACHINES[name]} | {r['seconds']:.1f} | {r['generated']['score']:.3f} | {r['ceiling']['score']:.3f} | "
                       f"{r['floor']['score']:.3f} | {r['ratio_to_ceiling']:.0%} | {r['steps_per_second']:.1f} |")
        out.append("")
    long = load("long_session_demo_h200.json")
    if long:
        fl = long["first_vs_last"]
        scores = [m["score"] for m in long["per_minute"]]
        out += [f"Long session ({long['minutes']:.0f} minutes, the clip looped with 1 s pauses, {long['device']}): "
                f"per-minute score {min(scores):.3f} to {max(scores):.3f}; first minute against last: "
                + ", ".join(f"{k} {v['first']:.3f} -> {v['last']:.3f}" for k, v in fl.items() if k != "confidence")
                + f" (`ref_diff`: mean absolute difference from the reference picture, 0..255). Renderer ceiling over the first "
                f"minute {long['ceiling_first_minute']['score']:.3f}. {long['steps_per_second']:.1f} steps/s with decoding "
                "and scoring on the same device (real time: 6).", "",
                "Command: `python -m lab.quality lipsync --spec demo --audio data/eval.wav --device cuda --minutes 10 --json` "
                "(result: `docs/results/long_session_demo_h200.json`)", ""]
    if (ROOT / "docs" / "contact.png").is_file():
        out += ["Generated frames for two presets (top row of each pair: the engine; below: the renderer), every 6th frame:", "",
                "![contact sheet](contact.png)", "",
                "Command: `python -m lab.quality sheet --spec demo --audio data/eval.wav --presets ada,kofi --out docs/contact.png`", ""]
    return out


def two_gpus() -> list[str]:
    """Runs on a machine of two H200s (NVLink, multicast off)."""
    host = RESULTS / "gpu_h200_x2.txt"
    if not host.is_file():
        return []
    gpu = host.read_text().strip().replace("\n", "; ")
    out = ["## Two GPUs", "", f"Hardware: {gpu}. NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1.", ""]
    tests = RESULTS / "pytest_gpu_x2.txt"
    kernel_tests = RESULTS / "pytest_gemm_allreduce_x2.txt"
    if kernel_tests.is_file():
        out += ["Fused kernel alone, both program layouts, bf16 and FP8, with CUDA-graph replay "
                "(`python -m pytest -q tests/test_gemm_allreduce.py -k \"two_gpus or one_rank\"`, output "
                f"`docs/results/pytest_gemm_allreduce_x2.txt`): `{kernel_tests.read_text().strip().splitlines()[-1]}`.", ""]
    if tests.is_file():
        out += ["Correctness (`python -m pytest -q tests/test_gemm_allreduce.py tests/test_distributed.py -k \"two_gpus or one_rank\"`, "
                "output `docs/results/pytest_gpu_x2.txt`): tensor-parallel degree 2 gives the frames of one GPU (plain NCCL "
                "and the fused GEMM + all-reduce; mean difference <= 1 level of 255), and the fused kernel's sums equal "
                "NCCL's within 1% of the largest output, also replayed from a CUDA graph: "
                f"`{tests.read_text().strip().splitlines()[-1]}`.", ""]
    step = load("step_57b_x2_h200.json")
    if step:
        rows = (("none", "reduction left out (compute only)"), ("nccl", "NCCL all-reduce"),
                ("symmetric_tiles", "fused GEMM + all-reduce (symmetric memory)"),
                ("symmetric_tiles_push", "fused, partials pushed to the peers"))
        out += ["### The 57b step on two GPUs, communication included", "",
                f"Run {step['date']}. Tensor-parallel degree {step['world']}, one process per GPU; {step['path']}; random weights; "
                "median over the steady-state steps after warm-up, ranks aligned by a barrier before each step; one all-reduce "
                "per block (60 blocks x 4 passes = 240 a step).", "",
                "Command: `python -m lab.bench step --spec characters-57b --world 2 --json` "
                "(result: `docs/results/step_57b_x2_h200.json`)", "",
                "| block reduction | step ms (median) | p90 | reset step ms | communication ms per step | peak GB per GPU |",
                "|---|---|---|---|---|---|"]
        for key, label in rows:
            if key not in step:
                continue
            r = step[key]
            comm = step["communication_ms"].get(key)
            out.append(f"| {label} | {ms(r['step_ms'])} | {ms(r['step_ms_p90'])} | {ms(r['reset_step_ms'])} | "
                       f"{'' if comm is None else f'{comm:.1f}'} | {r['peak_memory_gb']:.1f} |")
        out.append("")
    ar = load("allreduce_57b_x2_h200.json")
    if ar:
        out += ["### A block's MLP-out GEMM + all-reduce at the production shape", "",
                f"{ar['shape'][0]} x {ar['shape'][1]} bf16 output, inner dimension {ar['inner_dim']} (one of two ranks); "
                "per call, median of back-to-back calls between CUDA events. Hidden share = (GEMM alone + all-reduce alone "
                "- fused) / all-reduce alone.", "",
                "Command: `python -m lab.bench allreduce --json` (result: `docs/results/allreduce_57b_x2_h200.json`)", "",
                "| operands | GEMM + gated sum (cuBLAS) us | NCCL all-reduce alone us | plain (GEMM, then NCCL) us | "
                "fused, best tile config us | fused's GEMM part alone us | speedup vs plain | all-reduce hidden |",
                "|---|---|---|---|---|---|---|---|"]
        for kind, gemm_key, plain_key in (("bf16", "gemm_us", "unfused_us"), ("fp8", "gemm_fp8_us", "unfused_fp8_us")):
            f = ar.get(f"symmetric_tiles_{kind}")
            if f:
                out.append(f"| {kind} | {ar[gemm_key]:.1f} | {ar['allreduce_us']:.1f} | {ar[plain_key]:.1f} | {f['fused_us']:.1f} "
                           f"({f['config'].split(' ', 1)[1]}) | {f['gemm_alone_us']:.1f} | {f['speedup_vs_plain']:.2f}x | "
                           f"{100 * f['allreduce_hidden_share']:.0f}% |")
        chunks = ar["row_chunks"]
        out += ["", "Every configuration measured (`r`: programs that only reduce; 0: each program reduces its previous "
                "tile after multiplying the next; `push`: partial tiles written into every rank's buffer, the sum read "
                "locally, instead of pulled from each peer):", "", "| configuration | fused us | its GEMM part alone us | max relative "
                "difference from NCCL |", "|---|---|---|---|"]
        out += [f"| {k} | {v['fused_us']:.1f} | {v['gemm_alone_us']:.1f} | {v['max_rel_diff_vs_nccl']:.4f} |"
                for k, v in ar.get("symmetric_tiles_sweep", {}).items()]
        parts = {kind: ar[gemm_key] + ar["allreduce_us"] for kind, gemm_key in (("bf16", "gemm_us"), ("fp8", "gemm_fp8_us"))}
        fp8 = ar.get("symmetric_tiles_fp8")
        out += ["", "Reading it: the plain path costs more than its two parts timed apart (cuBLAS GEMM + NCCL alone: "
                f"{parts['bf16']:.1f} us in bf16, {parts['fp8']:.1f} us in FP8), by the gap between the GEMM and NCCL's "
                "kernel; that gap varies from run to run, so the speedup against the plain path does too, and the sum of "
                "the parts is the steadier yardstick."]
        if fp8:
            over = fp8["fused_us"] - parts["fp8"]
            out += [f"The best fused configuration ({fp8['config']}, {fp8['fused_us']:.1f} us) is {over:+.1f} us against "
                    "that sum: " + ("the reduction still runs in series with the product rather than under it." if over >= 0
                                    else f"{100 * -over / ar['allreduce_us']:.0f}% of the all-reduce runs under the product.")
                    + (" Pushing each finished partial tile to every peer while the next tile is multiplied is the fastest "
                       "layout measured." if fp8["config"].endswith("push") else "")
                    + " Pulling tiles stalls every program on NVLink reads; programs set aside to reduce (`r` > 0) take SMs "
                    "from the product and, one tile at a time, finish after it. What remains to try: FP8 partials (half "
                    "the bytes on NVLink) and a GEMM part as fast as cuBLAS's at M = 757."]
        out += ["", f"Row chunks ({ar['chunks']} chunks, each reduced asynchronously while the next is multiplied): "
                f"{ar['row_chunks_us']:.1f} us, {chunks['speedup']:.2f}x the plain path.", ""]
    pipe = load("pipeline_demo_x2_h200.json")
    if pipe:
        out += ["### Step period with the decoder on its own GPU", "",
                f"Spec `{pipe['spec']}` (random weights, stand-in decoder), placement {pipe['placement']}; median over "
                f"{pipe['steps_timed']} steady-state steps, two in flight; latents go GPU to GPU through CUDA IPC.", "",
                "Command: `python -m lab.bench pipeline --spec demo --gpus 0,1 --decoder-gpu 1 --json` "
                "(result: `docs/results/pipeline_demo_x2_h200.json`)", "",
                "| period ms | diffusion ms | decode ms | period - diffusion ms | frames per second |", "|---|---|---|---|---|",
                f"| {ms(pipe['period_ms'])} | {ms(pipe['diffusion_ms'])} | {ms(pipe['decode_ms'])} | "
                f"{pipe['period_minus_diffusion_ms']:.2f} | {pipe['fps']:.0f} |", ""]
    sess = load("session_demo_x2_h200.json")
    if sess:
        mem, st = sess["memory"], sess["step_ms"]
        out += ["### A demo-character session with the decoder on its own GPU", "",
                f"The trained demo character (`trained_weights: {str(sess['trained_weights']).lower()}`) in real time, "
                f"diffusion on GPU 0 and the decoder on GPU 1 in their own processes (`{sess['config']}`), driven by "
                "scripted turns (4 s of speech, 3 s of silence) through the playout buffer; frames counted at their "
                "release times.", "",
                f"Command: `SESSION_SECONDS={sess['seconds_asked']:.0f} bash lab/device/gpu_suite.sh session2`, i.e. "
                f"`python -m lab.soak --spec demo --config cuda-graph,processes=true,decoder_gpu=1 --seconds "
                f"{sess['seconds_asked']:.0f} --json` (result: `docs/results/session_demo_x2_h200.json`, per-second trace "
                "`docs/results/session_demo_x2_h200_trace.jsonl`)", "",
                "| ended | seconds | fps | frames released | underruns | whole seconds below 24 fps | engine loop wait per step "
                "p50 / p99 ms | host MB first / last (growth) | GPU MB first / last (growth) |",
                "|---|---|---|---|---|---|---|---|---|",
                f"| {sess['ended']} | {sess['wall_seconds']:.0f} | {sess['fps']:.2f} | {sess['frames_released']} | "
                f"{sess['underruns']} | {sess['seconds_below_24fps']} of {sess['whole_seconds']} | {st['p50']:.1f} / "
                f"{st['p99']:.1f} | {mem['host_mb_first']:.0f} / {mem['host_mb_last']:.0f} ({mem['host_growth']}) | "
                f"{mem['gpu_mb_first']:.0f} / {mem['gpu_mb_last']:.0f} ({mem['gpu_growth']}) |", "",
                "The engine loop's step figure is the time from submitting a step to holding the frames of the step now "
                "due; with the decoder a step behind on its own GPU those frames are mostly in already. Memory grows "
                "while the processes start and capture their graphs (first 10 s), then stays flat.", ""]
    return out


def voice_loop() -> list[str]:
    out: list[str] = []
    from lab.voice_bench import TARGET_S

    gpu_machine = ("The GPU machine (one H200), the models on its CPU: CTranslate2's CUDA build needs CUDA 12's cuBLAS, "
                   "which that machine (CUDA 13) lacks, and its onnxruntime has no CUDA provider")
    for name, where in (("cpu", "The development machine, no GPU"), ("h200", gpu_machine)):
        r = load(f"voice_bench_{name}.json")
        if not r:
            continue
        st = r["stages_s"]
        out += [f"## The voice loop with the earlier template agent, end of speech to first reply audio ({name.upper()})", "",
                "A rule-based agent that answered at once, since replaced by the language model (next sections); kept for "
                "the loop's own stages.", "",
                f"{where}: {r['cpu_count']} cores, device `{r['device']}`, ASR compute type {r['asr_compute_type']}, agent "
                f"`{r['agent']}`, speech from {r['speech_source']}; {len(r['utterances'])} questions fed in 32 ms chunks at "
                f"wall-clock pace; min_silence_ms {r['config']['min_silence_ms']}, threshold {r['config']['threshold']}; "
                f"mean word error rate {r['mean_wer']:.3f}.", "",
                ("Command: `python -m lab.voice_bench --json`" if name == "cpu" else
                 "Commands: `bash lab/device/voice_wheels.sh` here, one device call per part "
                 "(`python3 lab/device/carry_parts.py receive .carry/voice/pNN --store /tmp/parts`), then there "
                 "`python3 lab/device/carry_parts.py assemble --store /tmp/parts --out /tmp/wheels && python3 -m pip install "
                 "--no-index --no-deps --target /tmp/site /tmp/wheels/*.whl && python3 lab/device/with_site.py /tmp/site "
                 "lab.voice_bench --device cpu --json`") + f" (result: `docs/results/voice_bench_{name}.json`)", "",
                "| stage (Pipecat / LiveKit name) | median s | p95 s |", "|---|---|---|"]
        for key in ("end_of_turn_delay", "stt", "llm_ttft", "tts_ttfb", "speech_end_to_first_audio", "e2e_latency"):
            out.append(f"| {key} | {st[key]['median']:.3f} | {st[key]['p95']:.3f} |")
        t = r["target"]
        out += ["", f"Target: {t['metric']} <= {t['limit_s']} s: {t['median_s']:.3f} s, {'met' if t['met'] else 'not met'}."]
        if name == "h200":
            gpu_limit = TARGET_S["cuda"]
            out += [f"Against the GPU machine's target ({gpu_limit} s): {'met' if t['median_s'] <= gpu_limit else 'not met'}, "
                    "with no model on the GPU."]
        out += [""]
    return out


def character_replies() -> list[str]:
    """The local language model: what it says (agent bench), the voice loop with it on 2 CPU cores, the app on an H200."""
    out: list[str] = []
    rows = [(n, load(f"agent_bench_{n}.json")) for n in ("cpu", "cpu_05b")]
    if any(r for _, r in rows):
        out += ["## The character's replies: what the language model says (CPU)", "",
                "Spoken-style turns (small talk, facts, requests, follow-ups; since the example exchange also questions "
                "about the character's own taste), each scored on the facts a right answer contains, a reply that speaks of "
                "itself as an AI counted wrong; what would reach speech synthesis checked for list or markdown syntax. "
                "Commands: `python -m lab.agent_bench --json`, and with `--llm qwen2.5-0.5b` (results: "
                "`docs/results/agent_bench_cpu.json`, `..._05b.json`)", "",
                "| model | where | turns | correct | follow-ups | as an AI | list or markup to TTS | first text median s |",
                "|---|---|---|---|---|---|---|---|"]
        for _, r in rows:
            if r:
                out.append(f"| {r['model']} | {r['cpu_count']} cores | {r['turns']} | {r['correct_share']:.1%} | "
                           f"{r['follow_up_share']:.0%} | {r.get('replies_out_of_character', '-')} | "
                           f"{r['replies_with_markup_to_tts']} | {r['first_text_s']['median']:.3f} |")
        out.append("")
    runs = [(n, load(f"voice_bench_llm_{n}.json")) for n in ("cpu", "cpu_repeat_1", "cpu_repeat_2", "cpu_05b")]
    if any(r for _, r in runs):
        out += ["## The voice loop with the language model, end of speech to first reply audio (CPU)", "",
                "The development machine, no GPU, 2 cores; 10 Piper-spoken questions fed at wall-clock pace. Command: "
                "`python -m lab.voice_bench --json --utterances 10` (`--llm qwen2.5-0.5b` for the last row; results: "
                "`docs/results/voice_bench_llm_cpu*.json`)", "",
                "| model | llm_ttft median s | tts_ttfb median s | e2e_latency median s | p95 s | target (<= 1.3 s) |",
                "|---|---|---|---|---|---|"]
        for name, r in runs:
            if r:
                st = r["stages_s"]
                out.append(f"| {r['agent_model']} ({name}) | {st['llm_ttft']['median']:.3f} | {st['tts_ttfb']['median']:.3f} | "
                           f"{st['e2e_latency']['median']:.3f} | {st['e2e_latency']['p95']:.3f} | "
                           f"{'met' if r['target']['met'] else 'not met'} |")
        out.append("")
    apps = [(n, load(f"app_bench_llm_h200{n}.json")) for n in ("", "_repeat", "_cpu_llm")]
    if any(r for _, r in apps):
        out += ["## The app with the language model, end of speech to voice at the browser (H200)", "",
                "One H200, the demo spec with its CUDA graph, 8 spoken questions, Debian's chromium under Playwright. "
                "Commands: `LLM=qwen2.5-1.5b PART_MIB=56 bash lab/device/app_carry.sh` here, one device call per part, then "
                "`APP_UTTERANCES=8 bash lab/device/gpu_suite.sh app` there (the model on the CPU); with the CUDA build of "
                "llama-cpp-python in its place (`LLM_CUDA=1` builds it so), `python -m lab.app_bench --device cuda --utterances 8 "
                "--json` (results: "
                "`docs/results/app_bench_llm_h200.json`, `..._repeat.json`, `..._cpu_llm.json`)", "",
                "| language model | reply first text median s | median s | p95 s | fps | underruns | target (<= 0.9 s) |",
                "|---|---|---|---|---|---|---|"]
        for _, r in apps:
            if r:
                total = r["stages_s"]["end of speech to voice at the browser"]
                out.append(f"| {r['replies']} | {r['stages_s']['reply first text']['median']:.3f} | {total['median']:.3f} | "
                           f"{total['p95']:.3f} | {r['engine']['fps']} | {r['engine']['underruns']} | "
                           f"{'met' if r['target']['met'] else 'not met'} |")
        out.append("")
    return out


def power_summary(name: str) -> str | None:
    """The GPU's clock and power while it was busy (samples drawing over 300 W), from an nvidia-smi CSV."""
    path = RESULTS / name
    if not path.is_file():
        return None
    import csv
    import statistics

    rows = [r for r in csv.reader(path.read_text().splitlines()[1:]) if len(r) >= 7 and "MHz" in r[1] and "W" in r[3]]
    busy = [r for r in rows if float(r[3].split()[0]) > 300]
    if not busy:
        return None
    clock = [float(r[1].split()[0]) for r in busy]
    power = [float(r[3].split()[0]) for r in busy]
    capped = sum(1 for r in busy if int(r[6].strip(), 16) & 0x4)  # clocks_event_reasons: SW power cap
    return (f"Clock and power through `bash lab/device/gpu_suite.sh step` (the two profiles, eager and graph-replayed, then "
            f"a run of the step benchmark, in one call, that of the profiles above; `docs/results/{name}`, every 250 ms). While the GPU was busy ({len(busy)} samples over 300 W): SM clock median "
            f"{statistics.median(clock):.0f} MHz (min {min(clock):.0f}, max {float(busy[0][2].split()[0]):.0f}), power median "
            f"{statistics.median(power):.0f} W of a {busy[0][4].strip()} limit; the software power cap was holding the clock "
            f"down in {capped / len(busy):.0%} of these samples.")


def ncu_summary(name: str) -> str | None:
    """What Nsight Compute saw in one call of the warp-specialised attention kernel."""
    path = RESULTS / name
    if not path.is_file():
        return None
    import re

    text = path.read_text()

    def metric(pattern: str) -> str | None:
        m = re.search(pattern, text)
        return m.group(1) if m else None

    found = {key: metric(pattern) for key, pattern in (
        ("clock", r"SM Frequency\s+Ghz\s+([\d.]+)"), ("us", r"Duration\s+us\s+([\d.]+)"),
        ("busy", r"Issue Slots Busy\s+%\s+([\d.]+)"), ("idle", r"No Eligible\s+%\s+([\d.]+)"),
        ("barrier", r"This stall type represents about ([\d.]+)% of the total"))}
    busiest = re.search(r"(\w+) is the highest-utilized pipeline \(([\d.]+)%\)", text)
    if None in found.values() or busiest is None:
        return None
    found["pipe"], found["pipe_pct"] = busiest.groups()
    pipe = "shared (FP64 and tensor)" if found["pipe"] == "Shared" else found["pipe"].lower()
    return (f"Nsight Compute on one call of the warp-specialised kernel (64x128, 3 stages; `bash lab/device/gpu_suite.sh attention-ncu`, "
            f"output `docs/results/{name}`; profiled at the tool's locked {found['clock']} GHz, so {found['us']} us): the busiest "
            f"pipe is the {pipe} pipe at {found['pipe_pct']}%, instructions issued in {found['busy']}% of scheduler cycles, no warp "
            f"ready to issue in {found['idle']}%; the stall it singles out is warps waiting at a barrier ({found['barrier']}% "
            "of stall cycles), most of them the producer's idle warps (below).")


def ncu_source_summary(name: str) -> str | None:
    """The same kernel per instruction: where the consumer's loop stalls, and what the rest of the samples are."""
    path = RESULTS / name
    if not path.is_file():
        return None
    from lab.probes.ncu_sass_summary import summary

    r = summary(path)
    loop, rest = r["loop"], r["rest"]
    stalls = ", ".join(f"{k} {v:.0%}" for k, v in list(loop["stalls"].items())[:4])
    ops = ", ".join(f"{n} {op}" for op, n in list(loop["opcodes"].items())[:9])
    once = rest["top"][:2]
    return (f"Per instruction (`bash lab/device/gpu_suite.sh attention-ncu-source`, then `python -m lab.probes.ncu_sass_summary "
            f"docs/results/{name}`): the consumer's loop body ({loop['instructions']} instructions, run once per K/V block "
            f"per warp) holds {loop['share_of_samples']:.0%} of the stall samples; in it: {stalls} (\"selected\" is issuing; "
            f"\"barrier\" there is waiting for the tensor cores' results). Per block and warp it runs {ops}. The other "
            f"{rest['share_of_samples']:.0%} of the samples are mostly warps parked at a barrier outside the loop: two "
            f"instructions run {once[0]['executed']:.0f} and {once[1]['executed']:.0f} times in the whole call (once or twice "
            f"per program) hold {once[0]['share_of_samples'] + once[1]['share_of_samples']:.0%} of all samples, so the "
            f"barrier share in the summary above is not the consumer's. In the loop, the instructions holding most samples are "
            + "; ".join(f"`{t['source']}` {t['share_of_loop_samples']:.1%} ({t['stall']})" for t in loop["top"][:3]) + "."
            + (" The first is the wait for the block's P·V product: ptxas moves it from after the softmax, where the source "
               "has it, to the softmax's start, so P·V does not run under the softmax."
               if loop["top"][0]["source"].startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0") else ""))


def pytest_run(name: str, what: str, command: str) -> list[str]:
    """A recorded pytest run: what it tested, its command and output file, and its summary line."""
    path = RESULTS / name
    if not path.is_file():
        return []
    return [f"{what} (`{command}`, output `docs/results/{name}`): `{path.read_text().strip().splitlines()[-1]}`.", ""]


def step_profile(prof: dict | None, step_ms: float | None, gemm_ms: float | None = None) -> list[str]:
    """Kernel time of one eager serving step, grouped."""
    if not prof:
        return []
    groups = [("FP8 GEMMs (cuBLAS, `torch._scaled_mm`)", lambda n: n.startswith("nvjet_sm90_qq")),
              ("FP8 GEMMs on the Triton kernel (MLP-in with SwiGLU in its epilogue; the plain form where served)",
               lambda n: n == "_fp8_gemm_kernel"),
              ("FP8 attention", lambda n: n in ("_attn_kernel", "_attn_ws_kernel")),
              ("fused block kernels (LayerNorm + quantise, SwiGLU + quantise, gated sum (+ the next LayerNorm), row quantise)",
               lambda n: n in ("_ln_mod_quant_kernel", "_qkv_norm_kernel", "_swiglu_quant_kernel", "_gated_sum_kernel",
                               "_gated_sum_ln_quant_kernel", "_quant_rows_kernel")),
              ("cache writes (q/k/v head norms + RoPE + FP8 + ring store, the sink)",
               lambda n: n in ("_write_frame_kernel", "_rope_store_kernel")),
              ("memsets", lambda n: n.startswith("Memset"))]
    rows, used = [], set()
    for label, test in groups:
        ks = [k for k in prof["kernels"] if test(k["name"])]
        used.update(k["name"] for k in ks)
        rows.append((label, sum(k["ms"] for k in ks), sum(k["calls"] for k in ks)))
    rest = [k for k in prof["kernels"] if k["name"] not in used]
    rows.append(("everything else (patchify, audio embedding, head, ...)", sum(k["ms"] for k in rest), sum(k["calls"] for k in rest)))
    out = ["Where one serving step's GPU time goes, kernel by kernel (the step run eagerly under `torch.profiler`, so that "
           "each kernel shows by name; kernel durations only). Command: `python -m lab.probes.step_profile` "
           "(result: `docs/results/step_profile_57b_tp3_h200.json`).", "",
           "| kernels | ms per step | launches |", "|---|---|---|",
           *[f"| {label} | {t:.1f} | {n} |" for label, t, n in rows],
           f"| total kernel time | {prof['kernel_ms_total']:.1f} | |", ""]
    if "fast_accum" not in prof:
        out += ["(Profiled in an earlier run the same day, before fast accumulation and the warp-specialised attention "
                "kernel were the benchmark's defaults: these GEMMs promote their sums to float32, and the attention row "
                "is the Triton kernel.)", ""]
    elif step_ms:
        line = (f"The graph-replayed step above takes {step_ms:.1f} ms against {prof['kernel_ms_total']:.1f} ms of kernel time here. "
                "With each block's MLP branch on its side stream, kernels of the two branches overlap, and a kernel's time "
                "here includes the wait for SMs that the other branch's kernel holds (the cache write beside the persistent "
                "MLP-in GEMM, for one).")
        if gemm_ms:
            line += (f" The GEMMs' kernels (the first two rows) add up to {rows[0][1] + rows[1][1]:.1f} ms here, run eagerly with launch gaps between them, and take "
                     f"{gemm_ms:.1f} ms back to back in a CUDA graph (the GEMM row above); the clock log below shows the power "
                     "cap holding the SM clock down while the GPU is busy, which would account for the difference.")
        out += [line, ""]
    return out


def steps_timed(step: dict) -> str:
    """How many steady-state steps each median is over: the serving path's count and the baseline's, where the
    run recorded them (it goes on past the steps asked until a reset step was timed); older runs only the steps asked."""
    s, b = step["serving"], step["baseline"]
    if "steps_timed" in s and "steps_timed" in b:
        return f"{s['steps_timed']} (serving path) and {b['steps_timed']} (baseline)"
    return f"at least {step.get('steps_asked', step.get('steps_timed'))}"


def step_graph_time(s: dict) -> list[str]:
    """How much of the serving step's wall time its CUDA graph takes on the GPU (marks recorded inside the graph)."""
    if "step_graph_ms" not in s:
        return []
    line = (f"Of those wall times, the step's CUDA graph itself (from marks recorded inside it, `step_graph_ms`) takes "
            f"{ms(s['step_graph_ms'])} ms of the GPU's time back to back")
    if "step_graph_ms_at_realtime_cadence" in s:
        line += f" and {ms(s['step_graph_ms_at_realtime_cadence'])} ms at the cadence"
    line += (f"; it starts {1e3 * s['graph_launch_lag_ms']:.0f} us after the step's inputs are copied in "
             f"(`graph_launch_lag_ms`). The rest of the back-to-back step, {ms(s['step_ms'] - s['step_graph_ms'])} ms, is "
             "the host's work before the graph (the audio window, the step's positions, the noise) and the copy of its "
             "output; the sink's keys are written inside the graph.")
    return [line, ""]


# The step's run before its graph wrote the sink's keys (the engine code the step's repeat ran at)
STEP_BEFORE_GRAPH_SINK = "step_57b_tp3_h200_2026-12-01.json"


def host_share_before(step: dict, name: str = STEP_BEFORE_GRAPH_SINK) -> list[str]:
    """The run before the sink's keys moved into the step's graph (result `name`): the back-to-back step's part outside
    its graph there and here. That part is the host's; the graph's own time moves with the machine."""
    earlier = load(name)
    s = step["serving"]
    if not earlier or "step_graph_ms" not in earlier["serving"] or "step_graph_ms" not in s:
        return []
    e = earlier["serving"]
    return [f"The run before the step's graph wrote the sink's keys itself and the noise was drawn into its input "
            f"({earlier.get('date', '?')}, result `docs/results/{name}`, in another session on a machine of the same "
            f"kind): {ms(e['step_ms'])} ms per step, its graph {ms(e['step_graph_ms'])} ms and the rest "
            f"{ms(e['step_ms'] - e['step_graph_ms'])} ms; here {ms(s['step_ms'])}, {ms(s['step_graph_ms'])} and "
            f"{ms(s['step_ms'] - s['step_graph_ms'])} ms.", ""]


def step_timeline(t: dict | None, step: dict | None = None) -> list[str]:
    """The served step on the GPU's timeline (lab/probes/step_profile.py --graph); `step`, the step benchmark's result,
    says how far the graph's start lags its inputs without the profiler."""
    if not t:
        return []
    first = t["widest_gaps_last_step"][0] if t.get("widest_gaps_last_step") else None
    line = (f"The served step on the GPU's timeline (its CUDA graph replayed under `torch.profiler`, {len(t['steps'])} steps, "
            f"each run alone after an idle pause of {t.get('pause_ms', 20):.0f} ms; command: `python -m lab.probes.step_profile --graph`, "
            f"result `docs/results/step_timeline_57b_tp3_h200.json`): of a {t['median_span_ms']:.1f} ms span from its first "
            f"kernel to its last, at least one kernel runs for {t['median_busy_ms']:.1f} ms and none for "
            f"{t['median_idle_ms']:.1f} ms (medians). The kernels' durations add up to {t['median_kernel_ms']:.1f} ms: the two "
            "streams run kernels at once, and a kernel's duration includes its wait for SMs the other stream holds.")
    if first:
        after_copy = first["after"].startswith("Memcpy")  # the step's inputs are copied in just before its graph
        line += (f" The widest idle gap of the last step, {first['us'] / 1e3:.1f} ms, lies between `{first['after']}` and "
                 f"`{first['before']}`" + (" (the step's inputs are copied in just before its graph is replayed)"
                                           if after_copy else "") + ".")
        lag = ((step or {}).get("serving") or {}).get("graph_launch_lag_ms")
        if after_copy and lag is not None:
            line += (f" Without the profiler the graph starts {1e3 * lag:.0f} us after that copy (the step benchmark's "
                     "`graph_launch_lag_ms`, marks recorded inside the graph): the profiler's own cost.")
    return [line, ""]


FA3_RUNS = ("fa3_fp8", "fa3_fp8_cache_views", "fa3_fp8_splits_auto", "fa3_fp8_kvcache")  # how lab/probes/fa3_attention_probe.py calls FA3


def against(s: dict, key: str) -> str:
    """What a flipped setting's step (`key`) compares with: the served step timed in turns with it where the run did
    so (`key`_serving), else the served step's median above."""
    if f"{key}_serving" in s:
        return f"against {ms(s[f'{key}_serving'])} ms for the served setting, the two timed in turns"
    return f"against {ms(s['step_ms'])} ms above"


def fastest_fa3(r: dict) -> dict:
    """The fastest FlashAttention-3 run of a lab/probes/fa3_attention_probe.py result."""
    return min((r[k] for k in FA3_RUNS if k in r), key=lambda x: x["us"])


def fa3_in_the_step(r: dict, step: dict | None) -> str:
    """What FA3 would save in the served step, called as the engine would have to call it: its per-call gain over
    the step's attention calls, by time and (back to back at the power limit, where the step runs) by energy, less
    the bf16 output's cost that the step benchmark measures."""
    if "fa3_fp8_kvcache" not in r or not step or "step_ms_with_attention_out_bf16" not in step["serving"]:
        return ""
    s, calls = step["serving"], r["calls_per_step"]
    per_call = r["ws_fp8"]["us"] - r["fa3_fp8_kvcache"]["us"]
    bf16_out = s["step_ms_with_attention_out_bf16"] - s.get("step_ms_with_attention_out_bf16_serving", s["step_ms"])
    gains = {"by time": per_call * calls / 1000}
    text = (f" Called as the engine would have to call it (the last row: K and V views of every slot, the live count in "
            f"`cache_seqlens`, so that shapes stay fixed while the window fills; FA3's variable-length build), it takes "
            f"{r['fa3_fp8_kvcache']['us']:.1f} us against {r['ws_fp8']['us']:.1f}: {per_call:.1f} us a call, "
            f"{gains['by time']:.2f} ms over the step's {calls} attention calls.")
    served = s.get("attention_kernel_options")
    if served is not None and r.get("ws_fp8_options") != served:  # the probe's kernel is not the step's
        return (text + f" The step above serves the engine's kernel with {ws_options(served)}, not as the probe ran it "
                "(" + probe_ws(r) + "), so no saving in the step is estimated from this probe.")
    e = r.get("energy") or {}
    if "fa3_fp8_kvcache" in e and "ws_fp8" in e:
        joules = (e["ws_fp8"]["joules_per_call"] - e["fa3_fp8_kvcache"]["joules_per_call"]) * calls
        gains["by energy at the power limit"] = ms_at_power_limit(joules, e["power_limit_w"])
        text += (f" Each replayed back to back for seconds, at the {e['power_limit_w']:.0f} W limit where the step runs, "
                 f"FA3's call takes {1000 * e['fa3_fp8_kvcache']['joules_per_call']:.1f} mJ against "
                 f"{1000 * e['ws_fp8']['joules_per_call']:.1f} mJ: {joules:.2f} J a step, "
                 f"{gains['by energy at the power limit']:.2f} ms at that limit.")
    if bf16_out > 0:
        cost = f"puts that difference at {bf16_out:.2f} ms a step"
    else:  # a bf16 output measured no slower: nothing to take off the gain
        cost = f"found no cost in its run ({bf16_out:+.2f} ms a step, inside the run-to-run spread), so none is taken off"
        bf16_out = 0.0
    nets = ", ".join(f"{g - bf16_out:.2f} ms {how}" for how, g in gains.items())
    return (text + " Its output is bf16, which the out-projection's FP8 GEMM needs quantised per row; the served kernel "
            f"writes e4m3 instead, and the step benchmark {cost} "
            f"(`step_ms_with_attention_out_bf16`, step section above). Net, what FA3 would save: {nets}, of a "
            f"{s['step_ms']:.1f} ms step (whose p90 lies {s['step_ms_p90'] - s['step_ms']:.1f} ms above its median), "
            "and only after three changes to the ring: V stored in rows (FA3 reads V as (slot, head, dim); the ring "
            "stores its transpose), the live slots made contiguous (the sink's padding slots lie between the reference "
            "and the window), and FA3 built with variable lengths.")


def fa3_attention(r: dict | None, step: dict | None = None) -> list[str]:
    """FlashAttention-3's FP8 forward beside SDPA bf16 and the warp-specialised kernel, from lab/probes/fa3_attention_probe.py;
    with the step benchmark's result, what it would save in the step."""
    if not r:
        return []
    shape = r["shape"]
    rows = [("SDPA, bf16", "sdpa_bf16"), (f"warp-specialised FP8 ({probe_ws(r)})", "ws_fp8"),
            ("FlashAttention-3 FP8, K and V copied to (batch, slot, head, dim), the live slots", "fa3_fp8"),
            ("FlashAttention-3 FP8, strided views of the same (head, slot, dim) buffers", "fa3_fp8_cache_views"),
            ("FlashAttention-3 FP8, its own choice of KV splits (`num_splits=0`)", "fa3_fp8_splits_auto"),
            ("FlashAttention-3 FP8, views of all slots, the live count in `cache_seqlens`", "fa3_fp8_kvcache")]
    versions = f"torch {r['torch']}" + (f", Triton {r['triton']}" if "triton" in r else "")
    out = [f"FlashAttention-3's FP8 forward ({r['fa3_source'] or 'source not recorded'}; "
           f"{versions}; no wheel on PyPI, so built from source for head size 128 by `lab/device/build_fa3.sh`) on the same "
           f"e4m3 q, K, V with the same per-head scales ({shape['heads']} heads, {shape['queries']} queries, {shape['live']} "
           f"live of {shape['slots']} slots), medians of {len(r['sdpa_bf16']['us_runs'])} runs taken in turns, each timed as a "
           f"{r['sdpa_bf16']['timing']} (command: `FA3_SRC=<flash-attention checkout> bash lab/device/gpu_suite.sh attention-fa3`, "
           "result `docs/results/fa3_fp8_attention_h200.json`):", "",
           "| kernel | us per call | against SDPA | relative L2 error |", "|---|---|---|---|"]
    out += [f"| {label} | {r[key]['us']:.1f} | {r[key]['speedup_vs_sdpa_bf16']:.2f}x | {r[key]['rel_err']:.4f} |"
            for label, key in rows if key in r]
    out += ["", f"FlashAttention-3 is {r['ws_fp8']['us'] / fastest_fa3(r)['us']:.2f}x as fast as the engine's kernel here."
            + fa3_in_the_step(r, step) + " The engine does not call it; nor is FA3 on PyPI.", ""]
    return out


def probe_ws(probe: dict) -> str:
    """The engine kernel's configuration in a probe's run (probes before `ws_fp8_options` ran P nearest 2^x)."""
    options = probe.get("ws_fp8_options")
    return f"ours: {ws_options(options)}" if options is not None else "ours with P nearest 2^x, as served when that ran"


def fast_path_targets(step: dict | None, att: dict | None, cudnn: dict | None = None,
                      fa3: dict | None = None) -> list[str]:
    """The GPU fast path's targets (one H200, the 57b shape at tensor-parallel degree 3) against the runs below."""
    if not step or not att:
        return []
    s = step["serving"]
    reset_cost = s["reset_step_ms"] - s["step_ms"]
    fa3_best = fastest_fa3(fa3)["speedup_vs_sdpa_bf16"] if fa3 and any(k in fa3 for k in FA3_RUNS) else 0.0
    rows = [("rank step, median", "<= 100 ms", f"{s['step_ms']:.1f} ms", s["step_ms"] <= 100),
            ("cache upkeep per step", "<= 3 ms", f"{s['cache_upkeep_ms']:.1f} ms", s["cache_upkeep_ms"] <= 3),
            ("position reset (reset step - step; the delta rotation alone)", "<= 10 ms",
             f"{reset_cost:+.1f} ms; {s['reset_rotation_ms']:.2f} ms", max(reset_cost, s["reset_rotation_ms"]) <= 10),
            ("FP8 attention vs SDPA bf16 at the production shape", ">= 1.6x", f"{att['speedup']:.3f}x" + (f" ({att['speedup_e4m3_out']:.3f}x with the e4m3 output as served)"
                                          if "speedup_e4m3_out" in att else ""), att["speedup"] >= 1.6),
            ("peak memory of the shard with its FP8 cache", "fits 80 GB", f"{s['peak_memory_gb']:.1f} GB", s["peak_memory_gb"] <= 80)]
    return ["## GPU fast path: targets", "",
            "One H200, one rank's share of the 57b step at tensor-parallel degree 3, from the two runs below.", "",
            "| target | bound | measured | met |", "|---|---|---|---|",
            *[f"| {name} | {bound} | {value} | {'yes' if ok else 'no'} |" for name, bound, value, ok in rows], "",
            *repeat_runs(),
            *([f"For scale on the attention target: cuDNN's own FP8 attention reaches "
               f"{cudnn['cudnn_fp8_prefix']['speedup_vs_sdpa_bf16']:.2f}x at this shape on this GPU, where ours reaches "
               f"{cudnn['ws_fp8']['speedup_vs_sdpa_bf16']:.2f}x in the same run ({probe_ws(cudnn)}; FP8 attention section below).", ""]
              if cudnn and "cudnn_fp8_prefix" in cudnn else []),
            *([f"FlashAttention-3's FP8 forward, built from source, reaches {fa3_best:.2f}x at this shape on this GPU, "
               f"where ours reaches {fa3['ws_fp8']['speedup_vs_sdpa_bf16']:.2f}x in the same run ({probe_ws(fa3)})"
               + (": the 1.6x bound is beyond what FlashAttention-3 reaches at this shape" if fa3_best < 1.6 else "")
               + " (FP8 attention section below).", ""]
              if fa3 and "fa3_fp8" in fa3 else []),
            *([f"On the step target: back to back, the GPU holds its {step['power_limit_w']:.0f} W power limit, and at that "
               f"limit steps of {s['step_joules']:.1f} J cannot come more often than one every "
               f"{power_floor_ms(step):.1f} ms on average, the host's pauses between them included; "
               f"steps one every 100 ms, back to back, need at most {0.1 * step['power_limit_w']:.0f} J each"
               + (f", of which the step's GEMMs alone take {s['part_energy']['gemm']['joules_per_call']:.1f} J and its "
                  f"attention {s['part_energy']['attention']['joules_per_call']:.1f} J, each held back to back at that limit"
                  if "part_energy" in s else "")
               + (" (the GEMMs more alone than in the step, whose other branch fills the SMs their last round of tiles "
                  "leaves; energy paragraph below)." if "part_energy" in s and s.get("other_ms", 0) < 0
                  else " (energy paragraph below).")
               + (f" Held back to back, SDPA in bf16 takes {att['energy']['sdpa_over_fp8_joules']:.2f}x the served FP8 "
                  "attention's energy per call." if att.get("energy") else ""), ""]
              if "step_joules" in s and "power_limit_w" in step else [])]


def cudnn_attention(r: dict | None) -> list[str]:
    """cuDNN's FP8 SDPA beside SDPA bf16 and the warp-specialised kernel, from lab/probes/cudnn_attention_probe.py."""
    if not r:
        return []
    shape = r["shape"]
    v = r["cudnn"]
    cudnn_version = f"{v // 10000}.{v % 10000 // 100}.{v % 100}"

    def reason(message: str) -> str:  # cuDNN's own words: the backend's reason where it gives one
        message = message.split(": ", 1)[-1]
        if "backend declined: " in message:
            message = message.split("backend declined: ", 1)[1].split("; python engines", 1)[0]
        return message.rstrip(".")

    rows = [("SDPA, bf16", "sdpa_bf16"), (f"warp-specialised FP8 ({probe_ws(r)})", "ws_fp8"),
            ("cuDNN FP8 SDPA, K and V cut to the live slots", "cudnn_fp8_prefix"),
            ("cuDNN FP8 SDPA, all slots with a sequence-length mask", "cudnn_fp8_padding_mask")]
    out = [f"NVIDIA's own FP8 attention on this GPU: cuDNN {cudnn_version}'s FP8 SDPA (nvidia-cudnn-frontend "
           f"{r['cudnn_frontend']}, torch {r['torch']}{', Triton ' + r['triton'] if 'triton' in r else ''}) on the same e4m3 q, K, V ({shape['heads']} heads, {shape['queries']} "
           f"queries, {shape['live']} live of {shape['slots']} slots; one scale for all heads, as cuDNN takes one per tensor), "
           f"medians of {len(r['sdpa_bf16']['us_runs'])} runs taken in turns"
           + (f", each timed as a {r['sdpa_bf16']['timing']}" if len({r[k].get('timing') for k in ('sdpa_bf16', 'ws_fp8') if k in r}) == 1
              and r['sdpa_bf16'].get('timing') else "") + " (command: `pip install nvidia-cudnn-frontend && "
           "python -m lab.probes.cudnn_attention_probe`, result `docs/results/cudnn_fp8_attention_h200.json`):", "",
           "| kernel | us per call | against SDPA | relative L2 error |", "|---|---|---|---|"]
    out += [f"| {label} | {r[key]['us']:.1f} | {r[key]['speedup_vs_sdpa_bf16']:.2f}x | {r[key]['rel_err']:.4f} |"
            + (f" ({r[key]['timing']})" if r[key].get("timing") != r["sdpa_bf16"].get("timing") else "")
            for label, key in rows if key in r]
    out += [""]
    if r.get("refused"):
        out += ["Refused by cuDNN on this GPU: " + "; ".join(f"`{k}` ({reason(m)})" for k, m in r["refused"].items()) + ".", ""]
    return out


def ms_at_power_limit(joules: float, limit_w: float) -> float:
    """How long a GPU held at its power limit takes to spend `joules`."""
    return 1000 * joules / limit_w


def power_floor_ms(step: dict) -> float:
    """The shortest mean period of back-to-back serving steps that the power limit allows at their energy."""
    return ms_at_power_limit(step["serving"]["step_joules"], step["power_limit_w"])


def step_energy(step: dict) -> list[str]:
    """The step's energy (NVML's counter over the timed steps) and what the power limit makes of it."""
    s, b = step["serving"], step["baseline"]
    if "step_joules" not in s or "power_limit_w" not in step:
        return []
    limit = step["power_limit_w"]
    period_ms = 1000 * s["step_joules"] / s["step_watts"]  # the window's length per step, the host's pauses included
    out = [f"Energy over the same timed steps (NVML's energy counter, read before and after; `step_joules`, `step_watts`): "
           f"back to back the serving step takes {s['step_joules']:.1f} J, one every {period_ms:.1f} ms on average with the "
           f"host's pauses between steps, at a mean {s['step_watts']:.0f} W against the GPU's {limit:.0f} W power limit; "
           f"the SM clock's median is {s['sm_clock_mhz']:.0f} MHz of its {step['max_sm_clock_mhz']} MHz maximum. The driver "
           f"holds the mean power to the limit, so steps of {s['step_joules']:.1f} J cannot follow each other more often "
           f"than one every {power_floor_ms(step):.1f} ms on average: back to back, the step is bound by the GPU's power, and a "
           "shorter one needs less energy per step, not fewer idle gaps."]
    if "step_joules_at_realtime_cadence" in s:
        out[-1] += (f" At the real-time cadence: {s['step_joules_at_realtime_cadence']:.1f} J a period (the idle pause "
                    f"included) at a mean {s['step_watts_at_realtime_cadence']:.0f} W, below the limit.")
    if "step_joules" in b:
        out[-1] += f" The eager baseline: {b['step_joules']:.1f} J a step at a mean {b['step_watts']:.0f} W."
    if parts := s.get("part_energy"):
        out += ["", part_energy(parts, s["step_joules"], limit)]
        if s.get("other_ms", 0) < 0 and "triton" in {(s.get("gemm_kernels") or {}).get(n) for n in ("qkv", "mlp_out")}:
            out[-1] += (" The parts timed alone add up to more than the step: alone, the Triton kernel's products of 7,680 "
                        "columns in 128x256 tiles (180 tiles for 132 SMs) end each call in a round of tiles that leaves most "
                        "SMs idle, which in the step the other branch's kernels fill; on cuBLAS those products cost less "
                        "alone and the step more (the flipped settings below).")
    return out + [""]


# The FP8 GEMM kernels the step's profiles, timeline and clock log ran (lab/probes/step_profile.py records no kernel choice)
PROFILED_GEMM_KERNELS = {"qkv": "triton", "attn_out": "cublas", "mlp_in": "triton", "mlp_out": "triton"}


# The engine code of a step repeat that did not run the code of the step above
STEP_BEFORE_PDL = "step_57b_tp3_h200_2026-12-02.json"  # the step's run before its Triton kernels launched with PDL
# the step's run before the attention's out-projection moved to the Triton FP8 GEMM
STEP_BEFORE_ATTN_OUT_TRITON = "step_57b_tp3_h200_attn_out_cublas.json"
_BEFORE_ATTN_OUT = f"at the engine code of `{STEP_BEFORE_ATTN_OUT_TRITON}`, before the out-projection moved to the Triton FP8 GEMM"
STEP_REPEAT_CODE = {"step_57b_tp3_h200_repeat_1.json": f"at the engine code of `{STEP_BEFORE_GRAPH_SINK}`, before its graph "
                                                       "wrote the sink's keys",
                    "step_57b_tp3_h200_repeat_2.json": f"at the engine code of `{STEP_BEFORE_PDL}`, before the Triton kernels "
                                                       "launched with programmatic dependent launch",
                    "step_57b_tp3_h200_repeat_3.json": _BEFORE_ATTN_OUT,
                    "step_57b_tp3_h200_repeat_4.json": _BEFORE_ATTN_OUT + ", run after the step's two profiles in the same call"}
# the runs with PDL and the out-projection on cuBLAS, each of which timed all four block linears on Triton in turns
STEP_RUNS_ATTN_OUT_CUBLAS = (STEP_BEFORE_ATTN_OUT_TRITON, "step_57b_tp3_h200_repeat_3.json", "step_57b_tp3_h200_repeat_4.json")


def run_before_attn_out_triton(step: dict, name: str = STEP_BEFORE_ATTN_OUT_TRITON) -> list[str]:
    """The run of the step benchmark before the out-projection moved to the Triton FP8 GEMM (result `name`), beside this
    run's own step with it on cuBLAS, timed in turns; and what the runs at that code measured for all four on Triton."""
    earlier = load(name)
    s = step["serving"]
    if not earlier or "step_ms_with_attn_out_gemm_cublas" not in s:
        return []
    flips = [(n, r["serving"]) for n in STEP_RUNS_ATTN_OUT_CUBLAS if (r := load(n)) and "step_ms_with_triton_gemms" in r["serving"]]
    line = (f"The run before the attention's out-projection moved to the Triton FP8 GEMM ({earlier.get('date', '?')}, result "
            f"`docs/results/{name}`, in another session on a machine of the same kind): {ms(earlier['serving']['step_ms'])} ms "
            f"per step, here {ms(s['step_ms'])}. In this run the out-projection on cuBLAS, timed in turns with the served step, "
            f"took {ms(s['step_ms_with_attn_out_gemm_cublas'])} against {ms(s['step_ms_with_attn_out_gemm_cublas_serving'])} ms: "
            "the rest of the difference between the two runs is the machine's.")
    if flips:
        line += (" The runs at that code (each on a machine started afresh) timed all four block linears on Triton in turns "
                 "with the out-projection on cuBLAS: " + "; ".join(
                     f"{ms(f['step_ms_with_triton_gemms'])} against {ms(f['step_ms_with_triton_gemms_serving'])} ms (`{n}`)"
                     for n, f in flips) + ".")
    return [line, ""]


def run_before_pdl(step: dict, name: str = STEP_BEFORE_PDL) -> list[str]:
    """The run of the step benchmark before its Triton kernels launched with PDL (result `name`), beside this one and
    beside this run's own step without PDL, timed in turns: what PDL moved, and what the machine did."""
    earlier = load(name)
    s = step["serving"]
    if not earlier or "step_ms_without_pdl" not in s:
        return []
    return [f"The run before the Triton kernels launched with programmatic dependent launch ({earlier.get('date', '?')}, "
            f"result `docs/results/{name}`, in another session on a machine of the same kind): "
            f"{ms(earlier['serving']['step_ms'])} ms per step, here {ms(s['step_ms'])}. In this run the step without PDL, "
            f"timed in turns with the served one, took {ms(s['step_ms_without_pdl'])} against "
            f"{ms(s.get('step_ms_without_pdl_serving', s['step_ms']))} ms: the rest of the difference between the two runs is "
            "the machine's (H200s of this kind differ by a few percent in this step).", ""]


def repeat_runs() -> list[str]:
    """Later runs of the two target commands on machines of the same kind started afresh (`*_repeat_N.json`):
    how far the target rows move from run to run and machine to machine."""
    att = [(p.name, json.loads(p.read_text())) for p in sorted(RESULTS.glob("attention_57b_tp3_h200_repeat_*.json"))]
    step = [(p.name, json.loads(p.read_text())) for p in sorted(RESULTS.glob("step_57b_tp3_h200_repeat_*.json"))]
    if not att and not step:
        return []
    parts = []
    if att:
        dates = ", ".join(sorted({r.get("date", "?") for _, r in att}))
        parts.append("`python -m lab.bench attention --tp-shard 3 --json` "
                     + ", ".join(f"{r['speedup']:.3f}x ({r['speedup_e4m3_out']:.3f}x with the e4m3 output; `{name}`)"
                                 if "speedup_e4m3_out" in r else f"{r['speedup']:.3f}x (`{name}`)" for name, r in att)
                     + f" ({dates}; the attention kernels are unchanged since)")
    if step:
        parts.append("`python -m lab.bench step --spec characters-57b --tp-shard 3 --json` "
                     + ", ".join(f"{r['serving']['step_ms']:.1f} ms at {r['serving']['step_joules']:.1f} J a step "
                                 f"(`{name}`; {r.get('date', '?')}, {STEP_REPEAT_CODE.get(name, 'at the engine code of the step above')})"
                                 for name, r in step))
    return ["Repeats of the target commands, on machines of the same kind started afresh for them (the runs of one date "
            "in one call; results in `docs/results/`): " + "; ".join(parts) + ".", ""]


def served_gemm_kernels(spec_name: str, tp: int) -> dict[str, str]:
    """The FP8 GEMM kernel per block linear the engine serves on Hopper for one rank at degree tp of `spec_name`:
    the rule read off rank 0's block, sharded as the engine shards it (on the meta device: shapes only)."""
    import torch

    from engine.config import get_spec
    from engine.kernels.fp8_linear import BLOCK_LINEARS, hopper_gemm_kernels, linear_widths
    from engine.model import Block
    from engine.parallel import shard_block_

    with torch.device("meta"):
        block = Block(get_spec(spec_name))
    shard_block_(block, 0, tp)
    return {**dict.fromkeys(BLOCK_LINEARS, "cublas"), **hopper_gemm_kernels(linear_widths(block))}


def kernels_in_words(serving: dict) -> str:
    """A step run's FP8 GEMM kernel per block linear, e.g. 'q/k/v, MLP-in, MLP-out on Triton; the attention's
    out-projection on cuBLAS'."""
    kernels = serving.get("gemm_kernels") or {}
    by = {k: [LINEAR_NAMES[n] for n in LINEAR_NAMES if kernels.get(n, "cublas") == k] for k in ("triton", "cublas")}
    return "; ".join(f"{', '.join(v)} on {'Triton' if k == 'triton' else 'cuBLAS'}" for k, v in by.items() if v)


def earlier_step_run(step: dict, name: str) -> list[str]:
    """An earlier run of the same step benchmark (result `name`), in another session on a machine of the same kind,
    beside this one: how much the part that did not change between the two (the GEMMs) moved with the machine and its clock."""
    earlier = load(name)
    if not earlier or "sm_clock_mhz" not in earlier["serving"] or "sm_clock_mhz" not in step["serving"]:
        return []
    s, e = step["serving"], earlier["serving"]
    served = (ws_options(e["attention_kernel_options"]) if e.get("attention_kernel_options") else "?")
    return [f"An earlier run of the same command ({earlier.get('date', '?')}, result `docs/results/{name}`; attention served "
            f"with {served}), in another session on a machine of the same kind: {ms(e['step_ms'])} ms per step, its GEMMs alone "
            f"{ms(e['gemm_ms'])} ms and its attention {ms(e['attention_ms'])} ms, the SM clock's median {e['sm_clock_mhz']:.0f} "
            f"MHz; here {ms(s['step_ms'])}, {ms(s['gemm_ms'])} and {ms(s['attention_ms'])} ms at {s['sm_clock_mhz']:.0f} MHz. "
            + (f"The GEMMs, the same kernels in both, moved by {s['gemm_ms'] - e['gemm_ms']:+.1f} ms between the two runs, and "
               "by more than that with the machine: the earlier GEMM part also timed a quantisation pass before each "
               "out-projection, which the benchmark no longer does (the step feeds it the attention's e4m3 output). That is "
               "more than the change between the two attention kernels can move the step."
               if e.get("gemm_kernels") == s.get("gemm_kernels") else
               f"Their GEMM parts ran different kernels (there: {kernels_in_words(e)}; here: {kernels_in_words(s)}), so "
               "the two are not comparable part for part."), ""]


# the step benchmark's FP8 GEMM flips, as the other degrees' sentence names them
GEMM_FLIPS = (("step_ms_with_mlp_in_gemm_cublas", "MLP-in on cuBLAS"), ("step_ms_with_mlp_in_gemm_triton", "MLP-in on Triton"),
              ("step_ms_with_qkv_mlp_out_gemms_cublas", "q/k/v and MLP-out on cuBLAS"),
              ("step_ms_with_qkv_mlp_out_gemms_triton", "q/k/v and MLP-out on Triton"),
              ("step_ms_with_attn_out_gemm_cublas", "the out-projection on cuBLAS"),
              ("step_ms_with_attn_out_gemm_triton", "the out-projection on Triton"),
              ("step_ms_with_triton_gemms", "all four on Triton"))
LINEAR_NAMES = {"qkv": "q/k/v", "attn_out": "the attention's out-projection", "mlp_in": "MLP-in", "mlp_out": "MLP-out"}
PLAIN_LINEARS = ("qkv", "attn_out", "mlp_out")  # the block linears with no SwiGLU form
PART_NAMES = {"gemm": "GEMMs", "attention": "attention", "cache_upkeep": "cache upkeep"}


def part_energy(parts: dict, step_joules: float, limit_w: float) -> str:
    """The breakdown's parts, each held back to back at the power limit: their joules a step against the step's and
    against what a back-to-back step of 100 ms may spend at that limit."""
    budget = 0.1 * limit_w
    clock = lambda p: f" at a median {p['sm_clock_mhz']:.0f} MHz" if p.get("sm_clock_mhz") else ""
    listed = "; ".join(f"{PART_NAMES[name]} {p['joules_per_call']:.1f} J ({p['us_per_call'] / 1000:.1f} ms a step{clock(p)})"
                       for name, p in parts.items())
    total = sum(p["joules_per_call"] for p in parts.values())
    return (f"Each part of the breakdown alone, its step's worth replayed back to back for seconds so that the GPU "
            f"sits at its power limit as the step does (`part_energy`): {listed}. "
            + (f"Together {total:.1f} J of the step's {step_joules:.1f} J; the rest is the other kernels'. " if total <= step_joules
               else f"Together {total:.1f} J, more than the step's {step_joules:.1f} J. ")
            + f"A back-to-back step of 100 ms may spend {budget:.0f} J "
            f"at this limit: these parts alone take {100 * total / budget:.0f}% of that, the GEMMs "
            f"{100 * parts['gemm']['joules_per_call'] / budget:.0f}%.")


def ws_options(options: dict) -> str:
    """The warp-specialised kernel's options in words: tiles, stages, how P and its row sums are made."""
    p = ("P as log-linear e4m3 codes" if options.get("exp2") == "e4m3_bits" else "P as the e4m3 value nearest 2^x")
    sums = "row sums on the tensor cores" if options.get("row_sum") == "tensor" else "row sums in FP32"
    tiles = f"{options.get('block_m', 64)}-row tiles, {options.get('stages', 3)} stages"
    return f"{p}, {sums}, {tiles}" + (", output by TMA" if options.get("tma_out") else "")


# how the attention section names the ws kernel's `exp2` variants
WS_EXP2 = {"mixed": ", 2^x half on the FMA units (exp2=mixed)", "fma": ", 2^x on the FMA units (exp2=fma)",
           "e4m3_bits": ", 2^x as log-linear e4m3 codes (exp2=e4m3_bits)"}


# calls a 57b tp3 step makes (60 blocks x 4 passes; the residual kernel skips the last block of each pass)
CALLS_PER_STEP = {"qkv": 240, "attn_out": 240, "mlp_out": 240, "mlp_in_swiglu": 240, "gated_sum_ln_quant": 236, "quant_rows": 240}


def gemm_kernels_text(serving: dict) -> str:
    """Which FP8 GEMM kernel serves each block linear in a step run (its `gemm_kernels` and `triton_block_n`), as a
    clause of the serving path's description; '' where MLP-in is not on the Triton kernel."""
    kernels, widths = serving.get("gemm_kernels") or {}, serving.get("triton_block_n") or {}
    if kernels.get("mlp_in") != "triton":
        return ""
    plain = [n for n in PLAIN_LINEARS if kernels.get(n) == "triton"]
    rest = [n for n in PLAIN_LINEARS if kernels.get(n) != "triton"]
    text = ", MLP-in on the Triton FP8 GEMM with SwiGLU in its epilogue"
    if plain:
        tiles = sorted({widths.get(n, 128) for n in plain})
        text += (f", {' and '.join(LINEAR_NAMES[n] for n in plain)} on its plain form ("
                 + " and ".join(f"128x{w}" for w in tiles) + " tiles)")
    if rest:
        text += f", {' and '.join(LINEAR_NAMES[n] for n in rest)} on cuBLAS" if plain else " and the other linears on cuBLAS"
    return text


def cublas_kernel(measured: dict) -> str:
    """The cuBLAS (nvjet) kernel among a probe measurement's kernel names, or ''."""
    return next((k for k in measured.get("kernels", []) if k.startswith("nvjet")), "")


def kernel_energy(probe: dict | None, padded: dict | None) -> list[str]:
    """Each block kernel's energy a call held at the power limit (lab/probes/gemm_energy_probe.py), and the step with its
    GEMM operand padded to 768 rows against the unpadded one (`padded`: a step result whose serving path padded)."""
    if not probe:
        return []
    labels = {"cublas": "cuBLAS, as served", "cublas_m768": "cuBLAS, 768 rows (11 zero rows of padding)",
              "cublas_transposed_m768": "cuBLAS, the product transposed (weights on the left), 768 rows",
              "swiglu_s3_g8": "Triton, SwiGLU in the epilogue, as served (3 stages, 8 row tiles a group)",
              "swiglu_s4_g8": "the same, 4 stages", "swiglu_s3_g6": "the same, 6 row tiles a group"}

    def label(how: str) -> str:
        if how in labels:
            return labels[how]
        bn, stages, warps = how.split("_")[1:]  # triton_bn<N>_s<S>_w<W>
        return f"Triton FP8 GEMM, {bn[2:]}-column tiles, {stages[1:]} stages, {warps[1:]} warps"
    versions = f"torch {probe.get('torch', '?')}" + (f", Triton {probe['triton']}" if "triton" in probe else "")
    out = [f"On one {probe.get('device', '?')} ({versions}), each of a block's kernels alone at the step's shapes, replayed back to back (CUDA graphs of 20 calls) until the "
           "GPU settles at its power limit as it does in the step, then 1.5 s timed, with NVML's energy counter read before "
           f"and after (power limit {probe.get('power_limit_w', 0):.0f} W; command: `python -m lab.probes.gemm_energy_probe --seconds 1.5`"
           + (", in two calls on one machine: " + "; ".join(f"`{c['command']}` ({c['note']})" for c in probe["commands"])
              if len(probe.get("commands", [])) > 1 else "")
           + "; result `docs/results/gemm_energy_probe_h200.json`). At that limit a step's time follows its energy: the last "
           "column is a 57b tp3 step's worth of calls.", "",
           "| kernel | how | cuBLAS kernel | us a call, clock up | us a call at the limit | SM clock MHz | mJ a call | pJ per FLOP | J a step |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name in ("qkv", "attn_out", "mlp_out", "attn_out+mlp_out", "mlp_in_swiglu"):
        for how, r in (probe.get(name) or {}).items():
            if "mj_per_call" not in r:
                continue
            kernel = cublas_kernel(r)
            per_step = f"{r['mj_per_call'] * CALLS_PER_STEP[name] / 1000:.1f}" if name in CALLS_PER_STEP else ""
            out.append(f"| {name} | {label(how)} | {('`' + kernel + '`') if kernel else ''} | "
                       f"{r['us_clock_up']:.1f} | {r['us_per_call']:.1f} | {r['sm_clock_mhz']:.0f} | {r['mj_per_call']:.1f} | "
                       f"{r['pj_per_flop']:.3f} | {per_step} |")
    for how, r in (probe.get("elementwise") or {}).items():
        name, warps = how.rsplit("_w", 1)
        out.append(f"| {name} | {warps} warps{' (as served)' if warps == '8' else ''} |  | {r['us_clock_up']:.1f} | "
                   f"{r['us_per_call']:.1f} | {r['sm_clock_mhz']:.0f} | {r['mj_per_call']:.2f} |  | "
                   f"{r['mj_per_call'] * CALLS_PER_STEP[name] / 1000:.2f} |")
    out.append("")
    s = (padded or {}).get("serving", {})
    if "step_ms_without_gemm_row_padding" in s and probe.get("qkv", {}).get("cublas_m768"):
        q = probe["qkv"]
        out += [f"With 768 rows cuBLAS takes another kernel for the q/k/v product, which alone takes "
                f"{q['cublas_m768']['mj_per_call']:.1f} mJ a call against {q['cublas']['mj_per_call']:.1f}. The step with the "
                "q/k/v and MLP GEMMs' shared input padded with zero rows to 768 (so MLP-in's output and MLP-out's input too; "
                "served at commit d44360c only, result `docs/results/step_57b_tp3_h200_gemm_row_padding.json` of "
                "`python -m lab.bench step --spec characters-57b --tp-shard 3 --json` there) took "
                f"{ms(s['step_ms_without_gemm_row_padding_serving'])} ms against "
                f"{ms(s['step_ms_without_gemm_row_padding'])} ms unpadded, the two timed in turns "
                f"({ms(s['step_ms'])} ms back to back): the kernel that is cheaper alone is not cheaper beside the other "
                "branch's GEMM, and the engine does not pad.", ""]
    return out


def image_triton() -> str:
    """For a result that predates recording Triton's version: the machine image's, from docs/results/gpu_h200.txt."""
    path = RESULTS / "gpu_h200.txt"
    words = path.read_text().split() if path.is_file() else []
    version = words[words.index("triton") + 1] if "triton" in words[:-1] else "?"
    return f" (Triton {version} on the machine image, docs/results/gpu_h200.txt; the probe runs no Triton kernel)"


def lt_version(v: int | None) -> str:
    """cublasLtGetVersion's integer (major * 10000 + minor * 100 + patch) as major.minor.patch."""
    return "?" if v is None else f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def cublaslt_configurations(probe: dict | None, step: dict | None, best: int = 3) -> list[str]:
    """cuBLASLt's other configurations at the block GEMMs' shapes, each held at the power limit
    (lab/probes/cublaslt_algo_probe.py): the heuristic's kernel and the `best` others by energy a call, and the step with
    the best ones served against the heuristic's, in turns (`step`: a step result whose serving path ran them)."""
    if not probe:
        return []
    out = [f"cuBLASLt's own alternatives (command: `{probe.get('command', 'python -m lab.probes.cublaslt_algo_probe')}`, result "
           "`docs/results/cublaslt_algo_probe_h200.json`; one "
           f"{probe.get('device', '?')}, torch {probe.get('torch', '?')}"
           + (f", Triton {probe['triton']}" if "triton" in probe else image_triton())
           + f", cuBLASLt {lt_version(probe.get('cublaslt'))}): at these shapes its "
           "heuristic, which torch._scaled_mm follows, offers one algorithm; the probe enumerates every configuration "
           "cuBLASLt accepts without a workspace (its large tiles, stages, custom options and 1x1, 2x1, 1x2, 2x2 clusters), "
           "checks each against torch._scaled_mm's product, and holds the fastest with the clock up at the power limit "
           "as above, after torch._scaled_mm's own call and the binding's call of the same kernel, whose difference "
           "shows the spread of one measurement. The heuristic's kernel and the least energy a call:", "",
           "| GEMM | configurations accepted | kernel | us a call at the limit | SM clock MHz | mJ a call | pJ per FLOP |",
           "|---|---|---|---|---|---|---|"]
    for name in ("qkv", "attn_out", "mlp_out"):
        row = probe.get(name) or {}
        if "scaled_mm" not in row:
            continue
        held = sorted(((v["mj_per_call"], k) for k, v in row.items()
                       if isinstance(v, dict) and "mj_per_call" in v and k.startswith("rank") and k != "rank0"))
        same = ["rank0"] if "mj_per_call" in row.get("rank0", {}) else []
        for i, key in enumerate(["scaled_mm"] + same + [k for _, k in held[:best]]):
            r = row[key]
            kernel = cublas_kernel(r)
            label = {"scaled_mm": "torch._scaled_mm (the heuristic's)",
                     "rank0": "the same, through the probe's binding (the measurement's spread)"}.get(key, "")
            out.append(f"| {name if i == 0 else ''} | {(str(row.get('enumerated', '')) + ' others') if i == 0 else ''} | "
                       f"`{kernel}`{' ' + label if label else ''} | {r['us_per_call']:.1f} | {r['sm_clock_mhz']:.0f} | "
                       f"{r['mj_per_call']:.2f} | {r['pj_per_flop']:.3f} |")
    out.append("")
    s = (step or {}).get("serving", {})
    if "step_ms_without_tuned_algorithms" in s:
        out += ["Served in the step (the q/k/v and out-projection products on the least-energy configuration of each, "
                "through the probe's ctypes binding; at commit 3cfb0cd only, result "
                "`docs/results/step_57b_tp3_h200_cublaslt_tuned.json` of `python -m lab.bench step --spec characters-57b "
                f"--tp-shard 3 --json` there): {ms(s['step_ms_without_tuned_algorithms_serving'])} ms a step against "
                f"{ms(s['step_ms_without_tuned_algorithms'])} ms on the heuristic's kernels, the two timed in turns. With, in "
                "the same run and on those configurations, each block's gated residual sum moved into the out-projections' epilogues (cuBLASLt's "
                "beta = 1, the gates folded into the column scales; the next block's LayerNorm + FP8 as its own kernel): "
                f"{ms(s['step_ms_with_combine_in_gemm'])} ms against {ms(s['step_ms_with_combine_in_gemm_serving'])}. "
                "Cheaper kernels alone, again not a cheaper step beside the other branch's kernels: the engine keeps "
                "torch._scaled_mm's kernel and the gated-sum kernel.", ""]
    return out


def main() -> None:
    out = ["# Benchmarks", "",
           "Generated by `python -m lab.bench_table` from the JSON files in `docs/results/`; each file is the",
           "verbatim output of the command shown with it. GPU runs: see `docs/results/gpu_h200.txt`.", ""]
    gpu = (RESULTS / "gpu_h200.txt").read_text().strip().replace("\n", "; ") if (RESULTS / "gpu_h200.txt").is_file() else "?"
    out += pytest_run("pytest_gpu_h200.txt", "GPU tests on one H200, the engine's test files run on the GPU",
                      "bash lab/device/gpu_suite.sh tests")
    step = load("step_57b_tp3_h200.json")
    cudnn, fa3 = load("cudnn_fp8_attention_h200.json"), load("fa3_fp8_attention_h200.json")
    out += fast_path_targets(step, load("attention_57b_tp3_h200.json"), cudnn, fa3)
    if step:
        s, b = step["serving"], step["baseline"]
        mlp_in_kernel = (s.get("gemm_kernels") or {}).get("mlp_in")  # MLP-in's FP8 GEMM kernel
        out += ["## One rank's step of the 57b shape at tensor-parallel degree 3", "",
                f"Run {step.get('date', '?')}. Hardware: {gpu}. Communication left out (one rank's compute only); random weights; "
                f"median of {steps_timed(step)} steady-state steps after warm-up. Serving path: ring FP8 KV cache with "
                "write-time RoPE/FP8 kernels, "
                + ("the warp-specialised FP8 attention kernel (Gluon, Hopper"
                   + (f"; {ws_options(s['attention_kernel_options'])}" if s.get("attention_kernel_options") else "") + ")"
                   if s.get("attention_kernel") == "ws" else "Triton FP8 attention")
                + ", FP8 GEMMs (per-token x per-channel scales) with fused "
                "block kernels" + (" and fast accumulation" if step.get("fast_accum") else "")
                + gemm_kernels_text(s)
                + (", each block's MLP branch on a side stream beside its attention" if step.get("branch_streams") else "")
                + (", the Triton kernels launched with programmatic dependent launch" if s.get("pdl") else "")
                + ", the step's 4 passes in one CUDA graph. Baseline: naive cache (concatenate + rotate the "
                "window at every call), SDPA in bf16, bf16 GEMMs, eager; being eager it is bound by the host's "
                "kernel launches, so its total varies between machines and runs more than its parts do.", "",
                "Command: `python -m lab.bench step --spec characters-57b --tp-shard 3 --json` "
                "(result: `docs/results/step_57b_tp3_h200.json`)", "",
                "| ms per step | serving | baseline | baseline / serving |", "|---|---|---|---|"]
        for key, label in (("step_ms", "step (median)"), ("gemm_ms", "GEMMs"), ("attention_ms", "attention"),
                           ("cache_upkeep_ms", "cache upkeep"), ("other_ms", "other")):
            ratio = f"{b[key] / s[key]:.2f}x" if b[key] > 0 and s[key] > 0 else "n/a (parts timed alone exceed the step)"
            out.append(f"| {label} | {ms(s[key])} | {ms(b[key])} | {ratio} |")
        out += [f"| reset step (position reset + step) | {ms(s.get('reset_step_ms', float('nan')))} | n/a (no resets) | |",
                f"| delta rotation alone | {s['reset_rotation_ms']:.2f} | | |",
                f"| peak GPU memory, GB | {s['peak_memory_gb']:.1f} | {b['peak_memory_gb']:.1f} | |", ""]
        if "step_ms_at_realtime_cadence" in s:
            from engine.config import get_spec

            spec = get_spec(step["spec"])
            missed = s.get("realtime_cadence_missed")
            out += [f"Started at the real-time cadence, one step every {s['realtime_cadence_ms']:.1f} ms (a step's "
                    f"{spec.frames_per_latent} frames at {spec.fps} fps; same session, same run, median of "
                    f"{s.get('steps_timed_at_realtime_cadence', step.get('steps_asked', step.get('steps_timed')))} steps" + (f", {missed} of them started late" if missed else "") + "): "
                    f"{ms(s['step_ms_at_realtime_cadence'])} ms per step, against {ms(s['step_ms'])} ms back to back above. "
                    "Back to back the GPU never idles between steps; at the cadence a real-time session keeps, it does. "
                    "The target row above is the back-to-back figure.", ""]
        out += step_graph_time(s)
        out += step_energy(step)
        out += host_share_before(step)
        out += run_before_pdl(step)
        out += run_before_attn_out_triton(step)
        out += earlier_step_run(step, "step_57b_tp3_h200_2026-11-30.json")
        for key, setting, what in (("step_ms_with_branch_streams", "branch-streams on", "each block's MLP branch on a side stream"),
                                   ("step_ms_without_branch_streams", "branch-streams off", "each block's MLP branch in line"),
                                   ("step_ms_with_fast_accum", "fast-accum on", "the FP8 GEMMs' fast accumulation"),
                                   ("step_ms_without_fast_accum", "fast-accum off",
                                    "the FP8 GEMMs promoting their sums to float32 as they go")):
            if key in s:
                out += [f"With {what} (`--{setting}`; same weights, same run): "
                        f"{ms(s[key])} ms per step, {against(s, key)}.", ""]
        described = {"triton": "MLP-in on the Triton FP8 GEMM with SwiGLU in its epilogue",
                     "cublas": "MLP-in on cuBLAS, then the SwiGLU pass"}
        if mlp_in_kernel is not None:
            other = "cublas" if mlp_in_kernel == "triton" else "triton"
            out += [f"With {described[other]} (`--mlp-in-gemm {other}`; above: {described[mlp_in_kernel]}; same weights, "
                    f"same run): {ms(s[f'step_ms_with_mlp_in_gemm_{other}'])} ms per step, "
                    f"{against(s, f'step_ms_with_mlp_in_gemm_{other}')}.", ""]
        for label, flag, linears in (("qkv_mlp_out_gemms", "qkv-mlp-out-gemm", "q/k/v and MLP-out"),
                                     ("attn_out_gemm", "attn-out-gemm", "the attention's out-projection")):
            for other, where in (("cublas", "cuBLAS"), ("triton", "the Triton FP8 GEMM")):
                key = f"step_ms_with_{label}_{other}"
                if key in s:
                    out += [f"With {linears} on {where} (`--{flag} {other}`; same weights, same run): {ms(s[key])} ms per "
                            f"step, {against(s, key)}.", ""]
        if "step_ms_with_triton_gemms" in s:
            out += [f"With all four block linears on the Triton FP8 GEMM (same run): {ms(s['step_ms_with_triton_gemms'])} ms "
                    f"per step, {against(s, 'step_ms_with_triton_gemms')}.", ""]
        if "step_ms_with_triton_attention" in s:
            out += ["With the Triton FP8 attention kernel instead of the warp-specialised one "
                    "(`--attention-options '{\"kernel\": \"triton\"}'`; same weights, same run): "
                    f"{ms(s['step_ms_with_triton_attention'])} ms per step, {against(s, 'step_ms_with_triton_attention')}.", ""]
        if "step_ms_with_attention_p_nearest" in s:
            from engine.kernels.fp8_attention_ws import NEAREST_P_OPTIONS

            out += ["With the warp-specialised kernel's attention as served before "
                    f"({ws_options(NEAREST_P_OPTIONS)}; above: "
                    f"{ws_options(s.get('attention_kernel_options') or {})}; same weights, same run): "
                    f"{ms(s['step_ms_with_attention_p_nearest'])} ms per step, {against(s, 'step_ms_with_attention_p_nearest')}.", ""]
        if "step_ms_with_attention_out_bf16" in s:
            out += ["With the attention's output in bf16 and quantised per row before the out-projection (its setting "
                    "before; above: written in e4m3 by the attention kernel; same weights, same run): "
                    f"{ms(s['step_ms_with_attention_out_bf16'])} ms per step, {against(s, 'step_ms_with_attention_out_bf16')}.", ""]
        if "step_ms_without_pdl" in s:
            out += ["With every kernel launched only once the one before it has ended (`TALKLOOP_PDL=0`; above: the "
                    "Triton kernels, the GEMMs among them, launched with programmatic dependent launch, so that their "
                    "programs take the SMs as the kernel before frees them and wait there for its writes; same weights, "
                    f"same run): {ms(s['step_ms_without_pdl'])} ms per step, {against(s, 'step_ms_without_pdl')}.", ""]
        turns = f", the variants timed in turns, median of {s['upkeep_rounds']}" if "upkeep_rounds" in s else ""
        if "cache_upkeep_ms_write_blocks_of_64" in s:
            out += ["With the frame write in blocks of 64 rows and 4 warps (its setting before; now 16 rows, 8 warps; "
                    f"same run{turns}): cache upkeep {s['cache_upkeep_ms_write_blocks_of_64']:.2f} ms per step, against "
                    f"{s['cache_upkeep_ms']:.2f} ms above.", ""]
        if "cache_upkeep_ms_v_in_slot_order" in s:
            out += ["With V's slots written in their own order rather than the warp-specialised kernel's (`pv_order=False`; "
                    f"the attention would then read them wrongly; same run{turns}): cache upkeep "
                    f"{s['cache_upkeep_ms_v_in_slot_order']:.2f} ms per step, against {s['cache_upkeep_ms']:.2f} ms above.", ""]
        no_ws, ws = load("step_57b_tp3_h200_gemm_workspace_0.json"), load("step_57b_tp3_h200_gemm_workspace_1024.json")
        if no_ws and ws:
            out += ["cuBLASLt's workspace: the engine runs it at 0 KiB (`CUBLASLT_WORKSPACE_SIZE=0`, set when the FP8 linears "
                    "are made unless the user set it), so the FP8 GEMMs take statically scheduled kernels that need no memset "
                    "before each call. Two runs of the step benchmark back to back on one H200, at an earlier commit of the "
                    "same day: as the engine sets it, "
                    f"{ms(no_ws['serving']['step_ms'])} ms per step (`docs/results/step_57b_tp3_h200_gemm_workspace_0.json`); "
                    f"with `CUBLASLT_WORKSPACE_SIZE=1024` (a 1 MiB workspace), {ms(ws['serving']['step_ms'])} ms "
                    "(`docs/results/step_57b_tp3_h200_gemm_workspace_1024.json`).", ""]
        profiled = {"gemm_kernels": PROFILED_GEMM_KERNELS}  # the kernels the profiles below ran
        same_gemms = kernels_in_words(s) == kernels_in_words(profiled)
        if not same_gemms:
            out += ["The profile, the timeline and the clock log below come from one call at an earlier commit (its step "
                    "benchmark's result: `docs/results/step_57b_tp3_h200_repeat_4.json`), whose step served its FP8 GEMMs "
                    f"with {kernels_in_words(profiled)} (the step above: {kernels_in_words(s)}); the attention and the "
                    "other kernels are as above.", ""]
        out += step_profile(load("step_profile_57b_tp3_h200.json"), s["step_ms"], s.get("gemm_ms") if same_gemms else None)
        out += step_timeline(load("step_timeline_57b_tp3_h200.json"), step)
        power = power_summary("step_57b_tp3_h200_smi.csv")
        if power:
            out += [power, ""]
    others = [(tp, load(f"step_57b_tp{tp}_h200.json")) for tp in (1, 2, 4)]
    others = [(tp, r) for tp, r in others if r]
    if others:
        out += ["Other tensor-parallel degrees (same benchmark, `--tp-shard N`; the breakdown's parts are timed alone, so "
                "with the MLP branch beside the attention, \"other\" = step - parts also absorbs the overlap):", "",
                "| degree | serving step ms | attention kernel | FP8 GEMM kernels | FP8 fast accumulation | MLP branch on a side stream | "
                "the other branch setting, step ms | GEMMs | attention | cache upkeep | other | reset step ms | peak GB | baseline step ms |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for tp, r in others:
            s, b = r["serving"], r["baseline"]
            streams = r.get("branch_streams", False)
            alt = s.get("step_ms_without_branch_streams" if streams else "step_ms_with_branch_streams", float("nan"))
            kernel = s.get("attention_kernel", "triton")
            if kernel == "ws":  # results from before the step recorded the kernel's options served P nearest 2^x
                kernel += f" ({ws_options(s['attention_kernel_options']) if 'attention_kernel_options' in s else 'P nearest 2^x, as served then'})"
            out.append(f"| {tp} | {ms(s['step_ms'])} | {kernel} | {kernels_in_words(s) if 'gemm_kernels' in s else '?'} | "
                       f"{'on' if r.get('fast_accum') else 'off'} | {'on' if streams else 'off'} | "
                       f"{ms(alt)} | {ms(s['gemm_ms'])} | "
                       f"{ms(s['attention_ms'])} | {ms(s['cache_upkeep_ms'])} | {ms(s['other_ms'])} | "
                       f"{ms(s.get('reset_step_ms', float('nan')))} | {s['peak_memory_gb']:.1f} | {ms(b['step_ms'])} |")
        out.append("")
        flipped = []
        for tp, r in others:
            timed = [f"{what} {ms(r['serving'][key])} against {ms(r['serving'][key + '_serving'])} ms"
                     for key, what in GEMM_FLIPS if key + "_serving" in r["serving"]]
            if timed:
                flipped.append(f"at degree {tp}, " + "; ".join(timed))
        if flipped:
            out += ["The FP8 GEMM kernels flipped in those runs (each against its served setting, timed in turns): "
                    + "; and ".join(flipped) + ".", ""]
        now = {tp: kernels_in_words({"gemm_kernels": served_gemm_kernels(r["spec"], tp)}) for tp, r in others}
        older = [f"at degree {tp}, {now[tp]}" for tp, r in others
                 if "gemm_kernels" in r["serving"] and kernels_in_words(r["serving"]) != now[tp]]
        if older:
            out += [f"The engine's FP8 GEMM kernels changed since these rows ran, which were not run again: it now serves "
                    f"{'; and '.join(older)} (the rows above: as each ran).", ""]
    gemm = load("gemm_probe_h200.json")
    if gemm:
        out += ["GEMMs of one rank (M = 757) through `torch._scaled_mm`: TFLOP/s per shape "
                "(command: `python -m lab.probes.gemm_probe`, result `docs/results/gemm_probe_h200.json`):", "",
                "| GEMM | K x N | bf16 | FP8 row-wise scales | the same, fast accumulation | FP8 tensor-wise scale |",
                "|---|---|---|---|---|---|"]
        shapes = {"qkv": "7680 x 7680", "attn_out": "2560 x 7680", "mlp_in": "7680 x 16384", "mlp_out": "8192 x 7680"}
        for name, kn in shapes.items():
            g = gemm[name]
            out.append(f"| {name} | {kn} | {g['bf16_tflops']:.0f} | {g['fp8_rowwise_tflops']:.0f} | "
                       f"{g.get('fp8_rowwise_fast_accum_tflops', float('nan')):.0f} | {g['fp8_tensorwise_tflops']:.0f} |")
        out.append("")
        merged = [(name, parts) for name, parts in (("qkv+mlp_in", ("qkv", "mlp_in")), ("attn_out+mlp_out", ("attn_out", "mlp_out")))
                  if name in gemm]
        if merged:
            out += ["The block's two input GEMMs share their input and its two output GEMMs share their output, so each "
                    "pair could be one GEMM (N or K concatenated). FP8 row-wise, one GEMM against the pair: "
                    + "; ".join(f"{name} {gemm[name]['fp8_rowwise_us']:.1f} us against "
                                f"{sum(gemm[p]['fp8_rowwise_us'] for p in parts):.1f} us" for name, parts in merged)
                    + " (the output pair would also need the two gates folded into per-pass weights).", ""]
    out += kernel_energy(load("gemm_energy_probe_h200.json"), load("step_57b_tp3_h200_gemm_row_padding.json"))
    out += cublaslt_configurations(load("cublaslt_algo_probe_h200.json"), load("step_57b_tp3_h200_cublaslt_tuned.json"))
    att = load("attention_57b_tp3_h200.json")
    if att:
        best = att["fp8_best"]
        shape = att["shape"]
        out += ["## One attention call at the production shape", "",
                f"{shape['heads']} heads x {shape['queries']} queries x {shape['slots']} slots ({shape['live_slots']:,} live, padding masked), "
                f"head dim {shape['head_dim']}. Hardware: {gpu}."
                + (f" Timing: {att['timing']}. CUDA graphs, because launched one by one from Python the Gluon kernel's "
                   "launcher outlasts the kernel, and the timing measured the host." if "timing" in att else ""), "",
                "Command: `python -m lab.bench attention --tp-shard 3 --json` (result: `docs/results/attention_57b_tp3_h200.json`)", "",
                "| kernel | us per call | TFLOP/s | against SDPA |", "|---|---|---|---|",
                f"| SDPA, bf16 | {att['sdpa_bf16_us']:.1f} | {att['sdpa_tflops']:.0f} | 1.00x |"]
        flops = att["fp8_tflops"] * best["us"]
        names = {"triton": "Triton FP8", "ws": "warp-specialised FP8 (Gluon, Hopper)"}
        from lab.bench import ATTENTION_REL_ERR, ATTENTION_REL_ERR_LOG_LINEAR, fastest_correct  # the benchmark's own rule

        for kernel, name in names.items():
            try:
                top = fastest_correct([c for c in att["configs"] if c.get("kernel", "triton") == kernel])
            except RuntimeError:  # this kernel had no configuration that ran and matched the reference
                continue
            opts = ", ".join(f"{k}={v}" for k, v in top.items() if k not in ("us", "rel_err", "kernel"))
            if kernel == best["kernel"]:  # this kernel's fastest is the fastest of all, timed again in turns with SDPA
                top = best
            out.append(f"| {name} (best: {opts}) | {top['us']:.1f} | {flops / top['us']:.0f} | "
                       f"{att['sdpa_bf16_us'] / top['us']:.2f}x |")
        served = att.get("fp8_best_e4m3_out")
        if served:
            out.append(f"| the fastest, its output in e4m3 as served (the out-projection's FP8 GEMM reads it; no quantisation "
                       f"pass) | {served['us']:.1f} | {flops / served['us']:.0f} | {att['speedup_e4m3_out']:.2f}x |")
        out += ["", f"Relative L2 error of the fastest against exact attention over the same FP8 cache: {best['rel_err']:.3f}"
                + (f"; with its output in e4m3, {served['rel_err']:.3f}. The target above compares the bf16 output with "
                   "SDPA's (like for like: SDPA's bf16 output would need a quantisation pass before the FP8 "
                   "out-projection)." if served else "."), ""]
        energy = att.get("energy")
        if energy:
            e_sdpa, e_fp8 = energy["sdpa_bf16"], energy["fp8_best_e4m3_out"]
            e_bf16 = energy.get("fp8_best")  # the same kernel writing bf16, like SDPA (results before it lack it)
            like_for_like = (f"; with its output in bf16, like SDPA's, {1000 * e_bf16['joules_per_call']:.1f} mJ at "
                             f"{e_bf16['watts']:.0f} W and {e_bf16['us_per_call']:.1f} us, {energy['sdpa_over_fp8_bf16_out_joules']:.2f}x, "
                             f"and by time, held at the limit as in the served step, {e_sdpa['us_per_call'] / e_bf16['us_per_call']:.2f}x"
                             if e_bf16 else "")
            out += ["Energy per call (`energy` in the result: each kernel replayed back to back for 3 s after 3 s of warm-up, "
                    "NVML's energy counter read before and after): SDPA in bf16 "
                    f"{1000 * e_sdpa['joules_per_call']:.1f} mJ at a mean {e_sdpa['watts']:.0f} W and {e_sdpa['us_per_call']:.1f} us "
                    f"a call; the fastest FP8 kernel with its output in e4m3 {1000 * e_fp8['joules_per_call']:.1f} mJ at "
                    f"{e_fp8['watts']:.0f} W and {e_fp8['us_per_call']:.1f} us; SDPA takes "
                    f"{energy['sdpa_over_fp8_joules']:.2f}x the FP8 kernel's energy{like_for_like} "
                    f"(power limit {energy['power_limit_w']:.0f} W). "
                    "In the served step the GPU sits at its power limit, where a call costs the step its energy "
                    "rather than its time alone.", ""]
        fill = att.get("grid_fill")
        if fill:
            programs = -(-shape["queries"] // best["block_m"]) * shape["heads"]
            per = fill["programs_per_sm"]
            out += [f"How the call's programs spread over the GPU (the fastest configuration on the same queries and slots, "
                    f"the head count changed; `grid_fill` in the result): {shape['heads']} heads make {programs} programs for "
                    f"{fill['sms']} SMs that hold {per} each, so {max(0, per * fill['sms'] - programs)} program slots stay "
                    f"empty and the call takes {best['us']:.1f} us. "
                    + "; ".join(f"{r['heads']} heads ({r['programs']} programs"
                                + (", one per SM" if r["programs"] == fill["sms"] else
                                   f", {per} on every SM" if r["programs"] == per * fill["sms"] else
                                   ", past what the SMs hold at once" if r["programs"] > per * fill["sms"] else "")
                                + f"): {r['us']:.1f} us" for r in fill["rows"]) + ".", ""]
        out += fa3_attention(fa3, step)
        out += cudnn_attention(cudnn)
        options = [("splits", lambda c: c.get("splits", 1) > 1, "the KV axis split in 2"),
                   ("exp2", lambda c: c.get("exp2") == "fma", "2^x on the FMA units (`exp2=fma`)"),
                   ("mixed", lambda c: c.get("exp2") == "mixed", "2^x half on each unit (`exp2=mixed`)"),
                   ("lazy", lambda c: c.get("lazy_rescale", False), "lazy rescaling (`lazy_rescale=True`)"),
                   ("tma", lambda c: c.get("tma", False), "K and V tiles through TMA (`tma=True`)"),
                   ("pv16", lambda c: not c.get("pv_fp8", True), "P x V in fp16 (`pv_fp8=False`)")]
        triton_configs = [c for c in att["configs"] if c.get("kernel", "triton") == "triton"]
        found = [(label, min(c["us"] for c in triton_configs if test(c)))
                 for _, test, label in options if any(test(c) for c in triton_configs)]
        if found:
            out += [f"Of the {len(triton_configs)} Triton-kernel configurations swept, the fastest with each option: "
                    + "; ".join(f"{label} {us:.1f} us" for label, us in found) + ".", ""]
        ncu = ncu_summary("ncu_attention_ws_h200.txt")
        source = ncu_source_summary("ncu_attention_ws_sass_h200.csv.gz")
        out += [text for part in (ncu, source) if part for text in (part, "")]
        ws = [c for c in att["configs"] if c.get("kernel") == "ws" and "us" in c]
        if ws:
            out += ["The warp-specialised kernel (`engine/kernels/fp8_attention_ws.py`: a producer warp streams K and Vᵀ "
                    "tiles by TMA; a consumer warpgroup issues q·kᵀ of the next tile with P·V of this one, then that tile's softmax "
                    "(the compiled kernel waits for both products first); at block_m 64 two programs share an SM, at 128 one program runs two consumer warpgroups sharing each K/V tile) by "
                    "tile shape and pipeline depth: "
                    + "; ".join(f"{c['block_m']}x{c['block_n']}, {c['stages']} stages{', ping-pong' if c.get('pingpong') else ''}"
                                f"{', P shuffled (renamed_p=False)' if c.get('renamed_p') is False else ''}"
                                f"{', row maxima by the plain reduction (tree_max=False)' if c.get('tree_max') is False else ''}"
                                f"{', row sums on the tensor cores (row_sum=tensor)' if c.get('row_sum') == 'tensor' else ''}"
                                f"{WS_EXP2.get(c.get('exp2', 'mufu'), '')}"
                                f"{', output by TMA (tma_out=True)' if c.get('tma_out') else ''}: "
                                f"{c['us']:.1f} us" + (f" ({100 * c['rel_err']:.2f}% off exact)" if c.get('exp2') == 'e4m3_bits' else '')
                                for c in ws) + ". Ping-pong: the two consumer warpgroups of a 128-row program "
                    "issue their products in turns (FlashAttention-3's schedule), so one's softmax runs under the other's products. "
                    "P shuffled: the probabilities move between threads into the layout of the P·V product's FP8 operand at every "
                    "block, V's slots in their own order; the default renames P's columns in its registers instead and the cache "
                    "stores V's slots in the matching order (`pv_slot_order`), so nothing moves. Row maxima: by default a "
                    "tree over each thread's columns (depth 5); the plain reduction compiles into one chain of dependent "
                    "comparisons per row (same maxima, same output)."
                    + (" 2^x on the FMA units: the softmax's exponentials computed by a quadratic and an add into the "
                       "exponent bits (fp8_attention.py's `_exp2_fma`), about six FMA and integer instructions in the place "
                       "of one on the special-function unit." if any(c.get("exp2", "mufu") in ("fma", "mixed") for c in ws) else "")
                    + (" Row sums on the tensor cores: a P·1 product (8 columns of ones) beside P·V, added in FP32 each block, "
                       "in place of the softmax's adds. Log-linear e4m3 codes: 2^x written as the e4m3 code round(8x + 56 - 0.35) "
                       "by one FMA a probability, then one f16x2 conversion and one f16x2 max a pair (`e4m3_log_linear`; up to 7.5% off 2^x where e4m3's nearest value is 5.9% "
                       "off), so no special-function or conversion instruction per probability; its error against exact "
                       "attention is given with it, against the others' "
                       f"{100 * max(c['rel_err'] for c in ws if c.get('exp2', 'mufu') != 'e4m3_bits'):.2f}% at most (the "
                       f"fastest above is picked among those within {100 * ATTENTION_REL_ERR:.0f}%, log-linear P within "
                       f"{100 * ATTENTION_REL_ERR_LOG_LINEAR:.0f}%, the bound its test states, its change to the served clips "
                       "being within the rerun band: `docs/quality.md`)."
                       if any(c.get("row_sum") == "tensor" for c in ws) else "")
                    + (" Output by TMA: each consumer warpgroup's output tile written to shared memory and sent out by "
                       "one TMA store (whole lines; rows past the queries clipped by the copy engine) instead of each "
                       "thread storing its fragments; the same values bit for bit." if any(c.get("tma_out") for c in ws) else ""),
                    ""]
    pipe = load("pipeline_demo_h200.json")
    if pipe:
        out += ["## Step period with the decoder in its own process", "",
                f"Spec `{pipe['spec']}` (random weights, stand-in decoder), placement {pipe['placement']}. Hardware: {gpu}. "
                f"Median over {pipe['steps_timed']} steady-state steps, two steps in flight; latents reach the decoder "
                "process through CUDA IPC.", "",
                "Command: `python -m lab.bench pipeline --spec demo --json` (result: `docs/results/pipeline_demo_h200.json`)", "",
                "| period ms | diffusion ms | decode ms | period - diffusion ms | frames per second | real-time period ms |",
                "|---|---|---|---|---|---|",
                f"| {ms(pipe['period_ms'])} | {ms(pipe['diffusion_ms'])} | {ms(pipe['decode_ms'])} | "
                f"{pipe['period_minus_diffusion_ms']:.2f} | {pipe['fps']:.0f} | {ms(pipe['real_time_period_ms'])} |", ""]
    out += two_gpus()
    out += voice_loop()
    out += character_replies()
    out += demo_character(gpu)
    cache_gpu = load("cache_57b_tp3_h200.json")
    if cache_gpu:
        sh = cache_gpu["shape"]
        out += ["## Cache upkeep per step, GPU", "",
                f"57b shape, one rank at tensor-parallel degree 3: {sh['layers']} layers x {sh['heads']} heads x {sh['head_dim']}, "
                f"{sh['cache_slots']} slots, {sh['new_tokens']} new tokens, {sh['attention_calls_per_step']} attention calls a step. {gpu}.", "",
                "Command: `python -m lab.bench cache --device cuda --spec characters-57b --tp-shard 3 --json` "
                "(result: `docs/results/cache_57b_tp3_h200.json`)", "",
                "| naive ms | ring (PyTorch) ms | ring (Triton) ms | naive / Triton | reset rotation (Triton) ms |", "|---|---|---|---|---|",
                f"| {ms(cache_gpu['naive_ms'])} | {ms(cache_gpu['ring_ms'])} | {cache_gpu.get('ring_triton_ms', float('nan')):.2f} | "
                f"{cache_gpu.get('speedup_triton', float('nan')):.0f}x | {cache_gpu.get('reset_triton_ms', float('nan')):.2f} |", ""]
    cache = load("cache_demo_cpu.json")
    if cache:
        sh = cache["shape"]
        out += ["## Cache upkeep per step, CPU", "",
                f"Spec `{cache['spec']}`: {sh['layers']} layers x {sh['heads']} heads x {sh['head_dim']}, {sh['cache_slots']} slots, "
                f"{sh['new_tokens']} new tokens, {sh['attention_calls_per_step']} attention calls a step; {cache['device']}, torch {cache['torch']}.", "",
                "Command: `python -m lab.bench cache --device cpu --json` (result: `docs/results/cache_demo_cpu.json`)", "",
                "| naive ms | ring ms | speedup | reset rotation ms |", "|---|---|---|---|",
                f"| {ms(cache['naive_ms'])} | {ms(cache['ring_ms'])} | {cache['speedup']:.1f}x | {ms(cache['reset_ms'])} |", ""]
    (ROOT / "docs" / "benchmarks.md").write_text("\n".join(out))


if __name__ == "__main__":
    main()
