#!/usr/bin/env bash
# On a CUDA machine with torch + triton (no install needed): the GPU tests, then the GPU
# benchmarks. Results go to $OUT (default ./out): gpu.txt, pytest_gpu.txt, *.json.
#   bash lab/device/gpu_suite.sh [tests|attention|attention-ncu|attention-ncu-source|attention-cudnn|attention-fa3|step|cache|pipeline|all|allreduce|x2|session2|soak|soak-start|soak-collect|compare|compare-x2|app|character|step-move]...
# soak and compare (the demo character's reliability and numerics verdicts) run only when named; so do the
# two-GPU parts (x2: tests and benchmarks; session2: a demo session with the decoder on GPU 1; compare-x2:
# the tensor-parallel and fused all-reduce paths against the rerun band).
# A 10-minute soak outlasts one device call: soak-start leaves it running detached (setsid) and
# soak-collect, in the next call on the same machine, waits for it and copies its report to $OUT.
set -uo pipefail
parts=${*:-all}
known=" tests attention attention-ncu attention-ncu-source attention-cudnn attention-fa3 step cache pipeline all allreduce x2 session2 soak soak-start soak-collect compare compare-x2 app character drift step-move "
for part in $parts; do  # a misspelt part would otherwise run nothing and exit 0
  [[ $known == *" $part "* ]] || { echo "gpu_suite.sh: unknown part '$part'; parts:$known" >&2; exit 2; }
done
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"; } > "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
run() { echo "== $*" >&2; "$@"; }
for part in $parts; do
  if [[ $part == tests || $part == all ]]; then
    run python3 -m pytest -q -p no:cacheprovider tests/kernels tests/test_cache.py tests/test_session.py tests/test_parallel.py tests/test_gpu_energy.py 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -5
  fi
  if [[ $part == attention || $part == all ]]; then
    run python3 -m lab.bench attention --tp-shard 3 --json > "$OUT/attention_tp3.json" && python3 -c "import json;r=json.load(open('$OUT/attention_tp3.json'));print({k:r[k] for k in ('sdpa_bf16_us','speedup','fp8_tflops','sdpa_tflops')}, r['fp8_best'])"
  fi
  if [[ $part == attention-cudnn ]]; then  # cuDNN's FP8 SDPA beside ours; needs `pip install nvidia-cudnn-frontend`
    run python -m lab.probes.cudnn_attention_probe > "$OUT/cudnn_fp8_attention.json" && head -c 600 "$OUT/cudnn_fp8_attention.json"
  fi
  if [[ $part == attention-fa3 ]]; then  # FlashAttention-3's FP8 path beside ours; FA3_SRC: a flash-attention checkout
    # (with csrc/cutlass) or a .tar.xz of one, built here by lab/device/build_fa3.sh (FA3 has no wheel on PyPI)
    src=${FA3_SRC:?attention-fa3 needs FA3_SRC}
    if [[ -f $src ]]; then rm -rf /tmp/fa3_src && mkdir -p /tmp/fa3_src && tar -xJf "$src" -C /tmp/fa3_src && src=/tmp/fa3_src; fi
    if run bash lab/device/build_fa3.sh "$src" > "$OUT/fa3_build.log" 2>&1; then
      PYTHONPATH="$src/hopper:$PYTHONPATH" run python -m lab.probes.fa3_attention_probe > "$OUT/fa3_fp8_attention.json" \
        && head -c 600 "$OUT/fa3_fp8_attention.json"
    else
      tail -20 "$OUT/fa3_build.log"
    fi
  fi
  if [[ $part == step || $part == all ]]; then  # with the GPU's clock and power sampled throughout, and a per-kernel profile
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active \
      --format=csv -lms 250 > "$OUT/step_smi.csv" & smi=$!
    run python -m lab.probes.step_profile > "$OUT/step_profile_tp3.json" && head -c 400 "$OUT/step_profile_tp3.json"
    run python -m lab.probes.step_profile --graph > "$OUT/step_timeline_tp3.json" && head -c 400 "$OUT/step_timeline_tp3.json"
    run python3 -m lab.bench step --spec characters-57b --tp-shard 3 --json ${STEP_ARGS:-} > "$OUT/step_tp3.json" && cat "$OUT/step_tp3.json"
    kill $smi
  fi
  if [[ $part == cache || $part == all ]]; then
    run python3 -m lab.bench cache --device cuda --spec characters-57b --tp-shard 3 --json > "$OUT/cache_tp3.json" && cat "$OUT/cache_tp3.json"
  fi
  if [[ $part == pipeline || $part == all ]]; then
    run python3 -m lab.bench pipeline --spec demo --json > "$OUT/pipeline_demo.json" && cat "$OUT/pipeline_demo.json"
  fi
  if [[ $part == allreduce ]]; then  # needs 2+ GPUs
    run python3 -m lab.bench allreduce --json > "$OUT/allreduce_57b.json" && cat "$OUT/allreduce_57b.json"
  fi
  if [[ $part == soak ]]; then  # the serving path in real time, scripted turns; SOAK_SECONDS (default 600)
    run python3 -m lab.soak --spec demo --config cuda-graph --seconds "${SOAK_SECONDS:-600}" --trace "$OUT/soak_trace.jsonl" --json \
      > "$OUT/soak_demo.json" && python3 -c "import json;r=json.load(open('$OUT/soak_demo.json'));print({k:v for k,v in r.items() if not isinstance(v,(list,dict))})"
  fi
  if [[ $part == character ]]; then  # the shipped characters on this GPU: lip sync and per-frame motion (5 clips of
    # data/eval.wav), listening; then the step with the shipped decoder and with it less its per-frame mouth (the
    # decoder before it, and no blend of each step's first frame: every other weight is the same), in turns, in this one call
    for spec in demo demo-cpu; do
      run python3 -m lab.quality lipsync --spec $spec --audio data/eval.wav --device cuda --clips 5 --json > "$OUT/lipsync_${spec}_h200.json"
    done
    run python3 -m lab.quality listen --spec demo --audio data/eval.wav --device cuda --json > "$OUT/listen_demo_h200.json"
    before=$(mktemp -d) && cp assets/demo.pt assets/demo.pt.sha256 "$before/" && python3 -c "
import sys; from dataclasses import replace; from engine.codec import build_codec, load_codec, save_codec; from engine.config import get_spec
spec = get_spec('demo'); shipped = load_codec(spec, 'assets/demo-codec.pt')
codec = build_codec(spec, cfg=replace(shipped.cfg, mouth_dims=0))
codec.load_state_dict({k: v for k, v in shipped.state_dict().items() if not k.startswith('decoder.mouth.')})
save_codec(codec, sys.argv[1])" "$before/demo-codec.pt" || exit 1
    for turn in 1 2; do
      run python3 -m lab.soak --spec demo --config cuda-graph --seconds "${SOAK_SECONDS:-60}" --json > "$OUT/soak_demo_mouth_$turn.json"
      run python3 -m lab.soak --spec demo --config cuda-graph,group_blend=0 --seconds "${SOAK_SECONDS:-60}" --weights "$before/demo.pt" --json \
        > "$OUT/soak_demo_before_$turn.json"
    done
  fi
  if [[ $part == drift ]]; then  # 10 minutes of the demo character offline: the first minute against the last
    run python3 -m lab.quality drift --spec demo --minutes 10 --json > "$OUT/drift_demo_h200.json" \
      && python3 -c "import json;r=json.load(open('$OUT/drift_demo_h200.json'));print(r['drift'], r['steps_per_second'])"
  fi
  if [[ $part == step-move ]]; then  # the 57b rank step of this tree and of the tree before engine/'s structure move,
    # in turns, in one call; BEFORE_TAR: `git archive 22f459a engine tools | gzip > data/before-move.tar.gz`, carried
    before=$(mktemp -d) && tar -xzf "${BEFORE_TAR:?step-move needs BEFORE_TAR}" -C "$before" || exit 1
    for turn in 1 2; do
      run python3 -m lab.bench step --spec characters-57b --tp-shard 3 --json > "$OUT/step_57b_tp3_now_$turn.json"
      (cd "$before" && PYTHONPATH="$before" run python3 -m engine.bench step --spec characters-57b --tp-shard 3 --json) \
        > "$OUT/step_57b_tp3_before_$turn.json"
    done
  fi
  if [[ $part == x2 ]]; then  # two GPUs: correctness, the step with communication, the fused all-reduce, the decoder's own GPU
    run python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemm_allreduce.py tests/test_distributed.py -k "two_gpus or one_rank" \
      2>&1 | tee "$OUT/pytest_gpu_x2.txt" | tail -3
    run python3 -m lab.bench step --spec characters-57b --world 2 --json > "$OUT/step_57b_x2.json" && cat "$OUT/step_57b_x2.json"
    run python3 -m lab.bench allreduce --json > "$OUT/allreduce_57b_x2.json" && tail -c 600 "$OUT/allreduce_57b_x2.json"
    run python3 -m lab.bench pipeline --spec demo --gpus 0,1 --decoder-gpu 1 --json > "$OUT/pipeline_demo_x2.json" && cat "$OUT/pipeline_demo_x2.json"
  fi
  if [[ $part == session2 ]]; then  # the trained demo character, diffusion on GPU 0, decoder on GPU 1; SESSION_SECONDS (default 300)
    run python3 -m lab.soak --spec demo --config cuda-graph,processes=true,decoder_gpu=1 --seconds "${SESSION_SECONDS:-300}" \
      --trace "$OUT/session_x2_trace.jsonl" --json > "$OUT/session_demo_x2.json" \
      && python3 -c "import json;r=json.load(open('$OUT/session_demo_x2.json'));print({k:v for k,v in r.items() if not isinstance(v,(list,dict))})"
  fi
  if [[ $part == soak-start ]]; then
    mkdir -p /tmp/talkloop_soak && rm -f /tmp/talkloop_soak/*
    setsid nohup python3 -m lab.soak --spec demo --config cuda-graph --seconds "${SOAK_SECONDS:-600}" \
      --trace /tmp/talkloop_soak/soak_trace.jsonl --json > /tmp/talkloop_soak/soak_demo.json 2> /tmp/talkloop_soak/soak.err < /dev/null &
    sleep 20; tail -3 /tmp/talkloop_soak/soak.err; head -3 /tmp/talkloop_soak/soak_trace.jsonl  # started, or why not
  fi
  if [[ $part == soak-collect ]]; then
    while pgrep -f "lab.soak --spec demo --config cuda-graph --seconds" > /dev/null; do sleep 5; done
    cp /tmp/talkloop_soak/* "$OUT/" && tail -3 "$OUT/soak.err"
    python3 -c "import json;r=json.load(open('$OUT/soak_demo.json'));print({k:v for k,v in r.items() if not isinstance(v,(list,dict))})"
  fi
  if [[ $part == compare ]]; then  # every GPU fast path against the rerun band; COMPARE_CLIPS (default 24)
    run python3 -m lab.quality compare --spec demo --a reference --b fp8-cache --b fp8-attention --b cuda-graph --b fp8-gemm --b fp8-gemm-fast \
      --clips "${COMPARE_CLIPS:-24}" --clip-seconds 4 --json > "$OUT/compare_demo.json" \
      && python3 -c "import json;r=json.load(open('$OUT/compare_demo.json'));[print(c['b'],c['diff_b_minus_a'],c['verdict']) for c in r['comparisons']]"
  fi
  if [[ $part == app ]]; then  # the whole app and a browser on this GPU; first carry lab/device/app_carry.sh's parts to /tmp/parts
    rm -rf /tmp/app-files /tmp/site && python3 lab/device/carry_parts.py assemble --store /tmp/parts --out /tmp/app-files > /dev/null \
      && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/app-files/*.whl \
      && rm -rf /tmp/chromium && python3 lab/device/carry_parts.py unpack-debs /tmp/app-files/*.deb --into /tmp/chromium || exit 1
    # The carried libraries for the browser alone (a wrapper sets them), not for this Python and its torch.
    # Fontconfig must find the carried fonts, or Skia aborts the browser at its first text.
    printf '<?xml version="1.0"?>\n<fontconfig><dir>/tmp/chromium/usr/share/fonts</dir><cachedir>/tmp/chromium/fc-cache</cachedir></fontconfig>\n' > /tmp/chromium/fonts.conf
    printf '#!/bin/sh\nexport LD_LIBRARY_PATH=/tmp/chromium/usr/lib/x86_64-linux-gnu:/tmp/chromium/usr/lib/x86_64-linux-gnu/pulseaudio:/tmp/chromium/lib/x86_64-linux-gnu FONTCONFIG_FILE=/tmp/chromium/fonts.conf\nexec /tmp/chromium/usr/lib/chromium/chromium-headless-shell "$@"\n' > /tmp/chromium/shell
    chmod +x /tmp/chromium/shell
    if ls /tmp/app-files/llama_cpp_python-*.tar.gz > /dev/null 2>&1; then  # the language model's runtime, built here
      # LLM_CUDA=1: llama.cpp built for this GPU (about 4.5 min on 16 cores), so the app puts the model on it
      cuda_args=$([[ ${LLM_CUDA:-0} == 1 ]] && echo "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90")
      PATH=/usr/local/cuda/bin:$PATH CMAKE_ARGS="-DLLAVA_BUILD=OFF $cuda_args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
        /tmp/app-files/llama_cpp_python-*.tar.gz || exit 1
      mkdir -p /tmp/talkloop-cache && mv /tmp/app-files/*.gguf /tmp/talkloop-cache/ 2>/dev/null
    fi
    export TALKLOOP_CACHE=/tmp/talkloop-cache
    TALKLOOP_CHROMIUM=/tmp/chromium/shell HF_HUB_OFFLINE=1 run python3 lab/device/with_site.py --first /tmp/site lab.app_bench ${APP_ARGS:---device cuda} \
      --utterances "${APP_UTTERANCES:-5}" --json > "$OUT/app_bench_demo_h200.json" && cat "$OUT/app_bench_demo_h200.json"
  fi
  # Nsight Compute on one call of the warp-specialised attention kernel (these parts run only when named)
  ncu_call=(-k regex:_attn_ws_kernel --launch-skip 2 --launch-count 1)
  probe=(env PYTHONPATH=. python -m lab.probes.attn_probe '[{"kernel":"ws","block_m":64,"block_n":128,"stages":3}]')
  if [[ $part == attention-ncu ]]; then
    run ncu "${ncu_call[@]}" --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats "${probe[@]}" > "$OUT/ncu_attention_ws.txt" 2>&1
  fi
  if [[ $part == attention-ncu-source ]]; then  # per-instruction stall samples, as CSV (lab/probes/ncu_sass_summary.py)
    run ncu "${ncu_call[@]}" --section SourceCounters --section WarpStateStats --section SpeedOfLight \
      --section ComputeWorkloadAnalysis -o /tmp/attn_src -f "${probe[@]}" > /dev/null \
      && ncu -i /tmp/attn_src.ncu-rep --page source --csv --print-source sass | gzip -9 > "$OUT/ncu_attention_ws_sass.csv.gz"
  fi
  if [[ $part == compare-x2 ]]; then  # two GPUs: tensor parallel, fused GEMM + all-reduce; COMPARE_CLIPS (default 12: an engine start per clip)
    run python3 -m lab.quality compare --spec demo --a fp8-attention --b fp8-attention,tp=2 \
      --b fp8-attention,tp=2,fused_allreduce=true --clips "${COMPARE_CLIPS:-12}" --clip-seconds 4 --json > "$OUT/compare_demo_x2.json" \
      && python3 -c "import json;r=json.load(open('$OUT/compare_demo_x2.json'));[print(c['b'],c['diff_b_minus_a'],c['verdict']) for c in r['comparisons']]"
  fi
done
