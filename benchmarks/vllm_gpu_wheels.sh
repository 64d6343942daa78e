#!/usr/bin/env bash
# Prepare vLLM 0.24.0 (verl's pin; it requires torch 2.11.0), TRL 1.16 and datasets for a GPU machine that has
# Python 3.12, torch 2.11 (CUDA) and transformers >= 5.5.3 but no package index: every wheel, installed here
# into one site folder for CPython 3.12 on x86-64 Linux, packed with xz and cut into parts of 58 MiB.
#
#   bash benchmarks/vllm_gpu_wheels.sh OUT_DIR          # OUT_DIR/site.00, site.01, ... (about 220 MB in all)
#
# On the GPU machine, with the parts gathered in /tmp/parts and this checkout as the working directory:
#   cat /tmp/parts/site.* > /tmp/site.tar.xz
#   python3 -c "import tarfile; tarfile.open('/tmp/site.tar.xz').extractall('/tmp/vsite')"
#   export PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0
#   python3 -m pip install --no-deps --no-build-isolation -e . && bash benchmarks/gpu_check.sh OUT
# (flashinfer is not in the set: its sampler is switched off; attention uses vLLM's own flash-attention.)
set -euo pipefail
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
plat=""
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 \
           manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  plat="$plat --platform ${tag}_x86_64"
done
target="--only-binary=:all: --python-version 3.12 --implementation cp $plat"
# vLLM 0.24.0 and what it imports that a CUDA + PyTorch image lacks (pydantic-extra-types: mistral_common, which
# transformers imports for any processor once it is importable); TRL, datasets and theirs for the TRL runs
python3 -m pip download -q --no-deps $target -d "$work/wheels" \
  vllm==0.24.0 blake3 cachetools pydantic pydantic-core annotated-types typing-inspection "fastapi<0.137,>=0.133" \
  "starlette>=1.0.1" "openai==2.8.1" distro jiter sniffio prometheus-fastapi-instrumentator "lm-format-enforcer==0.11.3" \
  interegular "llguidance<1.8,>=1.7" "outlines_core==0.2.14" "diskcache==5.6.3" "lark==1.2.2" xgrammar apache-tvm-ffi \
  partial-json-parser jsonschema jsonschema-specifications referencing rpds-py pyzmq msgspec mistral_common pycountry \
  "compressed-tensors==0.17.0" "depyf==0.20.0" astor dill watchfiles python-json-logger pybase64 cbor2 ijson setproctitle \
  openai-harmony gguf mcp httpx-sse pydantic-settings python-dotenv sse-starlette python-multipart anthropic \
  docstring-parser pydantic-extra-types "trl==1.16.*" datasets multiprocess
python3 -m pip install -q --no-deps --no-compile $target --target "$work/site" "$work"/wheels/*.whl
tar cf - -C "$work/site" . | xz -9e -T0 >"$work/site.tar.xz"
split -b 58m -d "$work/site.tar.xz" "$out/site."
ls -la "$out"
