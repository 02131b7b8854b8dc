#!/usr/bin/env bash
# One run on a GPU machine: install, run the test suite compiled, run the benchmarks, and
# leave logs and JSON under $OUT (or ./gpu-out). Prints a short summary last.
#   bash bench/gpu_run.sh [tests|fuzz|large|serial|bench|all|memcheck] [extra pytest args...]
# tests: the suite without the large-tensor tests and the fuzzer, in 16 pytest-xdist workers
#   (the whole suite in one go outlasts a 10-minute device call on a 16-core host); fuzz:
#   tests/test_fuzz.py alone, likewise (it compiles a new shape per example);
# large: tests/test_large.py alone, one process (each test holds tens of GB);
#   serial: the given test files (default: all) in one process, as a user's plain `pytest`
#   runs them, which catches state one test leaves for the next;
# memcheck: the kernel tests under compute-sanitizer (ci/memcheck-cuda.sh; minutes), alone.
set -uo pipefail
what=${1:-all}; shift || true
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PK_CACHE_DIR="$out/pk-cache"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
portable-kernels info >"$out/info.txt" 2>&1; tail -n 25 "$out/info.txt"
summary=()
run_pytest() {  # name, pytest arguments...
  local name=$1; shift
  local start=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider "$@" >"$out/$name.log" 2>&1
  local rc=$?
  summary+=("$name: pytest rc=$rc in $(( $(date +%s) - start ))s: $(tail -n 1 "$out/$name.log")")
  grep -E "^(FAILED|ERROR)" "$out/$name.log" | head -20
}
if [[ $what == tests || $what == all ]]; then
  run_pytest pytest tests -n 16 -m "not large" --ignore tests/test_fuzz.py "$@"
fi
if [[ $what == fuzz || $what == all ]]; then
  run_pytest fuzz tests/test_fuzz.py -n 16 "$@"
fi
if [[ $what == large ]]; then
  run_pytest large tests/test_large.py -m large --durations 20 "$@"
fi
if [[ $what == serial ]]; then
  [[ $# -gt 0 ]] || set -- tests -m "not large"
  run_pytest serial -p no:xdist "$@"
fi
if [[ $what == memcheck ]]; then
  start=$(date +%s)
  OUT="$out/memcheck" ci/memcheck-cuda.sh "$@"
  summary+=("memcheck rc=$? in $(( $(date +%s) - start ))s (logs: $out/memcheck)")
fi
if [[ $what == bench || $what == all ]]; then
  python3 bench/dispatch_overhead.py --json "$out/dispatch.json" 2>&1 | tee "$out/dispatch.txt"
  for b in bench/layers.py bench/matmul.py bench/flash_attn.py bench/flash_attn_memory.py \
           bench/serving_attention.py; do
    [[ -f $b ]] || continue
    name=$(basename "$b" .py)
    timeout 420 python3 "$b" --json "$out/$name.json" --plot "$out/$name-plots" >"$out/$name.txt" 2>&1
    summary+=("$b rc=$?")
    tail -n 40 "$out/$name.txt"
  done
fi
printf '%s\n' "${summary[@]}"
