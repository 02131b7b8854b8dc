#!/usr/bin/env bash
# The compiled kernels under compute-sanitizer's memcheck: out-of-bounds and misaligned
# memory accesses that a numerical test can miss (an overrun that reads what happens to be
# there, or writes outside the output the test compares).
#
# First a control kernel with a known overrun (ci/memcheck_control.py) must be reported, so
# that a clean run means something; then pytest runs the given test files (default: every
# kernel family's, forward and backward, odd shapes, every sm_90 config) and the sanitizer
# must report no error in any process. Slow: kernels run many times slower under memcheck.
# Writes $OUT/memcheck-control.log and $OUT/memcheck.log; exits non-zero on any error.
# Usage: ci/memcheck-cuda.sh [pytest files and options]   (on a CUDA machine)
set -uo pipefail
out="${OUT:-.}"
mkdir -p "$out"
sanitizer="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
# triton 3.6's interpreter breaks with numpy >= 2.4: make sure nothing turns it on here.
unset TRITON_INTERPRET PK_INTERPRET
# With PyTorch's caching allocator an overrun that lands inside a cached segment is not
# reported; with the cache off every tensor is its own allocation.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
memcheck=("$sanitizer" --tool memcheck --target-processes all --print-limit 20)

"${memcheck[@]}" python3 ci/memcheck_control.py >"$out/memcheck-control.log" 2>&1
# memcheck stops the kernel at its first bad access (the read), and the context with it.
if ! grep -q "Invalid __global__ read" "$out/memcheck-control.log"; then
  echo "memcheck-cuda: the sanitizer did not report the control kernel's overrun; a clean" \
       "run would prove nothing (see $out/memcheck-control.log)" >&2
  tail -n 20 "$out/memcheck-control.log" >&2
  exit 2
fi
echo "memcheck-cuda: control overrun reported"

if [[ $# -eq 0 ]]; then
  set -- tests/test_flash_attn.py tests/test_flash_attn_hopper.py tests/test_flash_attn_gluon.py \
         tests/test_matmul.py tests/test_matmul_gluon.py tests/test_grouped_matmul.py \
         tests/test_layer_norm.py tests/test_softmax.py tests/test_dropout.py \
         tests/test_vector_add.py tests/test_asin.py tests/test_counters.py
fi
# ci/memcheck_plugin.py: the autotuner launches each config once, untimed.
PYTHONPATH="ci${PYTHONPATH:+:$PYTHONPATH}" "${memcheck[@]}" python3 -m pytest -v -p no:cacheprovider \
    -p memcheck_plugin --durations 10 "$@" >"$out/memcheck.log" 2>&1
status=$?
# One summary for the whole process tree (pytest-xdist workers included).
summaries=$(grep -c "ERROR SUMMARY" "$out/memcheck.log")
errors=$(grep -o "ERROR SUMMARY: [0-9]* error" "$out/memcheck.log" | awk '{n += $3} END {print n + 0}')
grep -E "^========= (Invalid|Misaligned|Program hit|Saved host backtrace|    at )" "$out/memcheck.log" \
  | grep -v "Saved host backtrace" | sort | uniq -c | sort -rn | head -n 30
grep -E "^(FAILED|ERROR) " "$out/memcheck.log" | head -n 20
echo "memcheck-cuda: pytest: $(grep -E '=+ .*(passed|failed|error).* in ' "$out/memcheck.log" | tail -n 1)"
if [[ $summaries -eq 0 ]]; then
  echo "memcheck-cuda: the sanitizer printed no summary (did it run to the end?)" >&2
  exit 2
fi
echo "memcheck-cuda: $errors sanitizer error(s)"
[[ $status -eq 0 && $errors -eq 0 ]]
