# Sourced by tools/sanitize_*.sh: sanitize_command CMD... runs CMD under compute-sanitizer's
# memcheck, racecheck and synccheck in turn, prints each tool's summary, and returns 1 if any
# tool reported an error (or the command failed), else 0; SANITIZE_LOG=FILE keeps each tool's
# whole report there (only its last lines are printed). sanitize_python CODE: the same for a
# Python snippet (run by $PYTHON, default python3). Sourcing it sets what every case runs with:
# the checkout's sources importable, every buffer its own allocation
# (XLA_PYTHON_CLIENT_ALLOCATOR=platform, so memcheck sees an access past any of them), no
# command buffers, NVLink multicast off.
export PYTHONPATH="${PYTHONPATH:-}:src:." XLA_PYTHON_CLIENT_ALLOCATOR=platform
export XLA_FLAGS="--xla_gpu_enable_command_buffer="
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
sanitize_command() {
  local tool rc fail=0
  for tool in memcheck racecheck synccheck; do
    echo "=== compute-sanitizer --tool $tool"
    compute-sanitizer --tool "$tool" --error-exitcode 7 "$@" 2>&1 \
      | tee -a "${SANITIZE_LOG:-/dev/null}" | grep -v "^[WIE][0-9]\{4\}" | tail -4
    rc=${PIPESTATUS[0]}
    echo "$tool exit status $rc"
    [ "$rc" -eq 0 ] || fail=1
  done
  return $fail
}

sanitize_python() {
  sanitize_command "${PYTHON:-python3}" -c "$1"
}
