# Sourced by the GPU scripts (gpu_offload.sh, gpu_cache_dit.sh) on the device machine, from the repository root:
# installs the carried wheels of .whlG (diffusers, av) and .whlP (pytest), or .whlA's packed folder (those and FA3),
# into /tmp/site once per machine, puts them and the tree on PYTHONPATH and records the GPU under $OUT.
# K6SERVE_GPU_SITE names another folder than /tmp/site (the CPU test of this script uses it).
set -u
: "${OUT:?set OUT to the folder for logs and JSON}"
site=${K6SERVE_GPU_SITE:-/tmp/site}
mkdir -p "$site"
if [ ! -d "$site/diffusers" ]; then
  if [ -f .whlA/site.tar.xz ]; then  # .whlG, .whlP and .whlH in one carry (scripts/gpu_wheels.sh)
    tar -C "$site" -xJf .whlA/site.tar.xz > "$OUT/install.log" 2>&1
  else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whlG/*.whl \
      .whlP/*.whl > "$OUT/install.log" 2>&1
  fi
fi
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
# The GPU host sets PYTHONDONTWRITEBYTECODE=1, so every process (and every spawned rank, which multiprocessing starts
# with -B) compiled torch's, diffusers' and transformers' sources again: 56% of a demo rank's start under py-spy
# (thirty-second session). The bytecode is cached under /tmp instead, for as long as the machine stays warm.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=/tmp/pycache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.csv" 2>&1
