#!/usr/bin/env bash
# Full conformance run on the CUDA GPUs of this machine (compiled Triton, never the
# interpreter): one pytest-xdist worker per GPU, their results merged into one report.
# Writes $OUT/cuda.json and $OUT/cuda.md; exits non-zero on any failure.
# Usage: ci/conformance-cuda.sh [extra portable-kernels conformance options]
#   WORKERS=1 ci/conformance-cuda.sh --kernels flash_attn      # one GPU
set -euo pipefail
out="${OUT:-.}"
mkdir -p "$out"
# triton 3.6's interpreter breaks with numpy >= 2.4: make sure nothing turns it on here.
unset TRITON_INTERPRET PK_INTERPRET
exec portable-kernels conformance --device cuda -n "${WORKERS:-auto}" \
    --json "$out/cuda.json" --markdown "$out/cuda.md" "$@"
