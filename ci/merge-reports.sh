#!/usr/bin/env bash
# Merge conformance reports of several devices into one cross-device matrix (rows
# kernel/variant, a column per device fingerprint).
# Usage: ci/merge-reports.sh cpu.json cuda.json [more.json ...]
# Writes $OUT/matrix.md, $OUT/matrix.html and $OUT/matrix.json.
set -euo pipefail
if [ "$#" -lt 1 ]; then
    echo "usage: $0 REPORT.json [REPORT.json ...]" >&2
    exit 2
fi
out="${OUT:-.}"
mkdir -p "$out"
exec portable-kernels report merge "$@" \
    --markdown "$out/matrix.md" --html "$out/matrix.html" --json "$out/matrix.json"
