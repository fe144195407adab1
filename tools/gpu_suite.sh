#!/usr/bin/env bash
# On a CUDA machine with torch + triton (no install needed): the GPU tests, then the GPU
# benchmarks. Results go to $OUT (default ./out): gpu.txt, pytest_gpu.txt, *.json.
#   bash tools/gpu_suite.sh [tests|attention|step|cache|pipeline|all|allreduce|soak|compare]...
# soak and compare (the demo character's reliability and numerics verdicts) run only when named.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"; } > "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
parts=${*:-all}
run() { echo "== $*" >&2; "$@"; }
for part in $parts; do
  if [[ $part == tests || $part == all ]]; then
    run python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_cache.py tests/test_session.py tests/test_parallel.py 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -5
  fi
  if [[ $part == attention || $part == all ]]; then
    run python3 -m engine.bench attention --tp-shard 3 --json > "$OUT/attention_tp3.json" && python3 -c "import json;r=json.load(open('$OUT/attention_tp3.json'));print({k:r[k] for k in ('sdpa_bf16_us','speedup','fp8_tflops','sdpa_tflops')}, r['fp8_best'])"
  fi
  if [[ $part == step || $part == all ]]; then
    run python3 -m engine.bench step --spec characters-57b --tp-shard 3 --json ${STEP_ARGS:-} > "$OUT/step_tp3.json" && cat "$OUT/step_tp3.json"
  fi
  if [[ $part == cache || $part == all ]]; then
    run python3 -m engine.bench cache --device cuda --spec characters-57b --tp-shard 3 --json > "$OUT/cache_tp3.json" && cat "$OUT/cache_tp3.json"
  fi
  if [[ $part == pipeline || $part == all ]]; then
    run python3 -m engine.bench pipeline --spec demo --json > "$OUT/pipeline_demo.json" && cat "$OUT/pipeline_demo.json"
  fi
  if [[ $part == allreduce ]]; then  # needs 2+ GPUs
    run python3 -m engine.bench allreduce --json > "$OUT/allreduce_57b.json" && cat "$OUT/allreduce_57b.json"
  fi
  if [[ $part == soak ]]; then  # the serving path in real time, scripted turns; SOAK_SECONDS (default 600)
    run python3 -m engine.soak --spec demo --config cuda-graph --seconds "${SOAK_SECONDS:-600}" --trace "$OUT/soak_trace.jsonl" --json \
      > "$OUT/soak_demo.json" && python3 -c "import json;r=json.load(open('$OUT/soak_demo.json'));print({k:v for k,v in r.items() if not isinstance(v,(list,dict))})"
  fi
  if [[ $part == compare ]]; then  # every GPU fast path against the rerun band; COMPARE_CLIPS (default 24)
    run python3 -m engine.quality compare --spec demo --a reference --b fp8-cache --b fp8-attention --b cuda-graph --b fp8-gemm \
      --clips "${COMPARE_CLIPS:-24}" --clip-seconds 4 --json > "$OUT/compare_demo.json" \
      && python3 -c "import json;r=json.load(open('$OUT/compare_demo.json'));[print(c['b'],c['diff_b_minus_a'],c['verdict']) for c in r['comparisons']]"
  fi
done
