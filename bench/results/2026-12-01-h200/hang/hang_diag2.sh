python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy gpu/py_spy*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/gpu PYTHONUNBUFFERED=1
export R=$OUT/diag2; mkdir -p $R
cat /proc/sys/kernel/yama/ptrace_scope > $R/env.txt 2>&1
( while true; do date +%T; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; sleep 2; done ) > $R/smi.txt 2>&1 &
timeout ${SUITE_S:-280} python3 -m pytest -v -rfE --tb=short -p xdist -p hangwatch -n 16 --timeout 100 -p no:cacheprovider tests \
  --deselect tests/test_multi_gpu_dask.py > $R/suite.log 2>&1
echo "rc=$?" >> $R/env.txt; kill %1
grep -E "(FAILED|ERROR) " $R/suite.log > $R/failed.txt; tail -3 $R/suite.log >> $R/env.txt
cd $OUT && tar czf diag2.tgz diag2
