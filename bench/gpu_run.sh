#!/usr/bin/env bash
# One batch on the lent H200: the whole test suite, then the benchmarks; logs under $OUT.
# Usage (repo root, GPU machine, after the prelude in ../shared/gpu/README.md):
#   bash bench/gpu_run.sh [tests|bench|all]
set -uo pipefail
what=${1:-all}
out=${OUT:-/tmp/out}
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, cuda.bindings, cupy, numba; print('python', sys.version.split()[0], 'cuda-bindings', cuda.bindings.__version__, 'cupy', cupy.__version__, 'numba', numba.__version__)"
  lscpu | grep -E "Model name" ; date -u
} 2>&1 | tee "$out/env.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -ra -p no:cacheprovider --timeout 240 tests 2>&1 | tee "$out/gpu-tests.log" | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 150 python3 bench/alloc.py --out "$out/alloc.json" 2>&1 | tee "$out/alloc.txt"
  { timeout 60 python3 bench/stats_overhead.py; timeout 60 python3 bench/attribution_overhead.py;
    timeout 60 python3 bench/plugin_metrics.py --base cuda; } 2>&1 | tee "$out/overheads.txt"
  timeout 60 python3 bench/cupy_churn.py 2>&1 | tee "$out/cupy_churn.txt"
  timeout 240 python3 bench/dask_workload.py --json "$out/dask_workload.json" 2>&1 | tee "$out/dask_workload.txt"
fi
