#!/usr/bin/env bash
# make gpu-check [DRY_RUN=1] [OUT=DIR]: the prepared GPU check (mmspec/bench/gpu_check.py says what
# it runs). On the GPU machine python3 has its own torch, triton and transformers and no network:
# the wheels `make gpu-wheels` put in .whl/ (diffusers, transformers, importlib_metadata, and a
# setuptools new enough for an editable install) are installed over it, mmspec itself in editable
# mode, without build isolation (nothing to fetch).
# DRY_RUN=1 runs the same driver in this repository's .venv with every CUDA step skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check-out}}"
if [ "${DRY_RUN:-0}" = "1" ]; then
  py=.venv/bin/python
  exec "$py" -m mmspec.bench.gpu_check --dry-run --out "$out" ${STEPS:+--steps $STEPS}
fi
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
echo -n "gpu-check: packages before: "
for p in torch triton transformers diffusers accelerate safetensors scipy; do
  printf '%s ' "$p $("$py" -c "import importlib.metadata as m; print(m.version('$p'))" 2>/dev/null || echo missing)"
done; echo
if ls .whl/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-cache-dir --upgrade .whl/*.whl || exit 1
fi
if ! "$py" -c "import mmspec.pipelines, mmspec.kernels" 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
# STEPS="vlm-heavy pipeline:vlm" runs only those steps (the rest reported as not asked for)
exec "$py" -m mmspec.bench.gpu_check --out "$out" ${STEPS:+--steps $STEPS}
