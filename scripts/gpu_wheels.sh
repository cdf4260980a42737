#!/usr/bin/env bash
# Download the wheels the GPU machines lack (Python 3.12, torch and transformers preinstalled; no diffusers, PyAV,
# pytest, server packages or FA3, and no network) into git-ignored folders at the repository root, to be carried
# with a device call (at most 64 MiB per call: .whlG + .whlP + .whlS fit together, .whlH goes alone):
#   .whlG  diffusers 0.42.1, av 18 (cp311-abi3), zipp, importlib-metadata            ~41 MB
#   .whlP  pytest, pluggy, iniconfig                                                  ~0.4 MB
#   .whlS  the server: fastapi, uvicorn, httpx, python-multipart and their dependencies (fastapi 0.165 needs
#          opentelemetry-api and annotated-doc; pydantic 2.14 its exact pydantic-core and typing-extensions >= 4.16),
#          the openai SDK its tests drive the server with (without it tests/server/test_openai_sdk.py skips) and
#          openapi-spec-validator (tests/server/test_openapi.py validates the served document with it)
#                                                                                     ~8.4 MB
#   .whlH  fa3-fwd 0.0.3 (FA3 forward, sm_90a) and einops                              ~27 MB
#   .whlR  diffusers 0.42.1, zipp, importlib-metadata: .whlG without PyAV, to go beside .whlH   ~6.4 MB
#   .whlA  site.tar.xz: .whlG, .whlP and .whlH installed into one folder and packed with xz   ~36 MB
#          (the three as wheels are 69 MB, over one call's 64 MiB, so FA3 took a call of its own on a warm machine,
#          and a machine that went back between the two calls lost it; scripts/gpu_setup.sh unpacks .whlA when
#          carried: one call, with room for .whlS beside it)
# Install on the device: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whlG/*.whl ...
# then PYTHONPATH=/tmp/site:$PWD. Run here (PyPI reachable), from the repository root: bash scripts/gpu_wheels.sh
set -eu
grep -qx '.whl\*/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo '.whl*/' >> .git/info/exclude; }
# The device's Python and platforms, for the downloads and for the packed install below.
DEVICE=(--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
get() {  # folder, then pip's options and requirements
  local folder=$1; shift
  # Afresh: a folder downloaded into twice held two versions of one package (httpcore2 2.16.2 and 2.17.0), and the
  # device's `pip install .whlS/*.whl` refused the pair (forty-fourth session).
  rm -rf "$folder"
  python3 -m pip download -q "${DEVICE[@]}" -d "$folder" "$@"
}
# Without their dependencies: the device has torch, transformers, huggingface_hub, numpy, safetensors.
get .whlG --no-deps diffusers==0.42.1 "av==18.*" zipp importlib-metadata
get .whlP --no-deps pytest pluggy iniconfig
# With them, resolved for Python 3.12, so pydantic gets its exact pydantic-core and fastapi what it now requires.
get .whlS fastapi uvicorn httpx python-multipart openai openapi-spec-validator
get .whlH --no-deps fa3-fwd==0.0.3 einops
get .whlR --no-deps diffusers==0.42.1 zipp importlib-metadata
# Installed here for the device's Python 3.12 (av's and fa3-fwd's wheels are abi3, the rest pure Python), then packed.
rm -rf .whlA && mkdir -p .whlA
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile "${DEVICE[@]}" --target "$site" .whlG/*.whl .whlP/*.whl \
  .whlH/*.whl
tar -C "$site" -cf - . | xz -T0 -9 > .whlA/site.tar.xz
rm -rf "$site"
du -sh .whlG .whlP .whlS .whlH .whlR .whlA
