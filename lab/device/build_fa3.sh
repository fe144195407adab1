#!/usr/bin/env bash
# Build FlashAttention-3's forward pass for head size 128 in FP8 and bf16 (what lab/probes/fa3_attention_probe.py
# calls), in place in a flash-attention checkout, on a machine with nvcc (CUDA >= 12.3) and a CUDA build of
# PyTorch. FA3 has no wheel on PyPI; the engine does not use it, the probe compares it with the engine's kernel.
#   git clone --recursive https://github.com/Dao-AILab/flash-attention
#   bash lab/device/build_fa3.sh flash-attention            # about 2 minutes on 16 cores
#   PYTHONPATH=flash-attention/hopper python -m lab.probes.fa3_attention_probe
# Left out: the other head sizes, fp16, the backward pass, paged and appended KV, local and soft-capped attention,
# Ampere. Kept: variable lengths (`cache_seqlens`, the probe's last run), KV splits, clusters, packed GQA.
set -euo pipefail
src=${1:?usage: bash lab/device/build_fa3.sh FLASH_ATTENTION_CHECKOUT}
[[ -f $src/hopper/setup.py ]] || { echo "build_fa3: $src/hopper/setup.py not found: not a flash-attention checkout" >&2; exit 2; }
[[ -d $src/csrc/cutlass/include/cute ]] || {
  echo "build_fa3: $src/csrc/cutlass has no headers: clone with --recursive (or: git submodule update --init csrc/cutlass)" >&2; exit 2; }
command -v nvcc > /dev/null || { echo "build_fa3: nvcc not found (FA3 compiles its CUDA sources: install the CUDA toolkit)" >&2; exit 2; }
# One compile job per core and per 8 GB of memory (each FA3 source takes several GB to compile); MAX_JOBS overrides.
jobs=$(awk -v cores="$(nproc)" '/MemTotal/ {j = int($2 / 8388608); if (j > cores) j = cores; if (j < 1) j = 1; print j}' /proc/meminfo)
export FLASH_ATTENTION_OFFLINE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-$jobs} NVCC_THREADS=${NVCC_THREADS:-4}
for feature in BACKWARD PAGEDKV APPENDKV LOCAL SOFTCAP FP16 HDIM64 HDIM96 HDIM192 HDIM256 SM80 HDIMDIFF64 HDIMDIFF192; do
  export FLASH_ATTENTION_DISABLE_$feature=TRUE
done
cd "$src/hopper"
python3 setup.py build_ext --inplace
echo "build_fa3: built $(ls flash_attn_3/_C*.so); use PYTHONPATH=$PWD"
