#!/usr/bin/env bash
# Quick conformance run on the CPU (Triton's interpreter): every kernel x variant, the quick
# subset of shapes and dtypes. Writes $OUT/cpu.json and $OUT/cpu.md; exits non-zero on any
# failure. Usage: ci/conformance-cpu.sh [extra portable-kernels conformance options]
#   OUT=reports ci/conformance-cpu.sh --kernels softmax,matmul
# Full CPU run (about ten minutes on two cores): QUICK= ci/conformance-cpu.sh
set -euo pipefail
out="${OUT:-.}"
mkdir -p "$out"
quick=${QUICK---quick}
# The interpreter must be chosen before triton is imported; portable_kernels does it on a
# machine without a GPU, and PK_INTERPRET=1 does it on one with a GPU.
export PK_INTERPRET=1
exec portable-kernels conformance --device cpu $quick \
    --json "$out/cpu.json" --markdown "$out/cpu.md" "$@"
