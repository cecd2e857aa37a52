# Sourced by tools/validate_ffi.sh and tools/ab_llama_step.sh (uses $PY and $JOBS):
#   build_tree SRC BUILD_DIR   the CUDA build of the tree SRC for sm_90 in BUILD_DIR (its log
#                              BUILD_DIR.log), its module copied into SRC/src/sifar_jax;
#                              prints "built SRC", or the log's tail and "BUILD FAILED: SRC"
build_tree() {
  local gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S "$1" -B "$2" "${gen[@]}" -DPython_EXECUTABLE="$(command -v "$PY")" -DSIFAR_ENABLE_CUDA=ON \
    -DSIFAR_CUDA_ARCHITECTURES=90-real -DCMAKE_BUILD_TYPE=Release >"$2.log" 2>&1 &&
    cmake --build "$2" -j "$JOBS" >>"$2.log" 2>&1 && cp "$2"/_sifar*.so "$1/src/sifar_jax/" &&
    echo "built $1" || { tail -20 "$2.log"; echo "BUILD FAILED: $1"; return 1; }
}
