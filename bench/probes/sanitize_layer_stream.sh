#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck and synccheck on layer_stream.cu's persistent kernel
# with the attention phase (attention_phase.cuh): its 2-layer check alone (--sanitize), on one
# Hopper GPU. The probe prints its error against the float64 reference as usual.
#   bash bench/probes/sanitize_layer_stream.sh [--pos P]   (from the repository root; nvcc on PATH)
set -uo pipefail
bin=${TMPDIR:-/tmp}/layer_stream_sanitize
nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo bench/probes/layer_stream.cu -o "$bin" || exit 1
source "$(dirname "$0")/sanitize_run.sh"
sanitize_command "$bin" --sanitize "$@"
