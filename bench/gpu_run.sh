#!/usr/bin/env bash
# One batch on the lent H200: the whole test suite, then the benchmarks, logs under $OUT.
# Usage (from the repo root, on the GPU machine, after the prelude in ../shared/gpu/README.md):
#   bash bench/gpu_run.sh [tests|bench|all]
set -uo pipefail
what=${1:-all}
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import cuda.bindings, cupy, numba; print('cuda-bindings', cuda.bindings.__version__, 'cupy', cupy.__version__, 'numba', numba.__version__)" | tee -a "$out/gpu.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -ra -p no:cacheprovider tests 2>&1 | tee "$out/gpu-tests.log" | tail -60
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in bench/alloc.py bench/cupy_churn.py bench/stats_overhead.py bench/dask_workload.py; do
    [ -f "$b" ] || continue
    echo "== $b"
    timeout 240 python3 "$b" 2>&1 | tee "$out/$(basename "$b" .py).txt"
  done
fi
