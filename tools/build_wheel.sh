#!/usr/bin/env bash
# Builds the sifar-jax wheel with the CUDA backend, for hosts without a CUDA
# toolkit (JAX from its CUDA wheels): the CUDA runtime is linked statically.
#
#   tools/build_wheel.sh [OUT_DIR]          # default: dist/ in the checkout
#
# Environment:
#   PYTHON                    the interpreter that builds (default python3); it
#                             needs `build` (and `auditwheel` for a manylinux tag).
#                             Python >= 3.12 gives one cp312-abi3 wheel for 3.12+;
#                             3.11 a cp311 wheel.
#   CUDA_HOME                 the CUDA toolkit (default /usr/local/cuda): nvcc 12.8+
#                             (sm_100); the wheel then needs a driver for that CUDA.
#   SIFAR_CUDA_ARCHITECTURES  default 90-real;100-real;100-virtual (CMakeLists.txt)
#   SIFAR_BUILD_ISOLATION=0   build in PYTHON's own environment instead of an
#                             isolated one (offline); it then compiles against that
#                             environment's jax headers, so use the oldest jax the
#                             wheel supports. pyproject.toml pins jax/jaxlib 0.10.2 for
#                             isolated builds: without isolation the dependency check
#                             is skipped (--skip-dependency-check), else `build` would
#                             stop at any other installed jax.
#
# Steps: `python -m build --wheel` (SIFAR_ENABLE_CUDA=ON, a fresh build folder),
# then `auditwheel repair` to a manylinux tag where auditwheel (with patchelf)
# is available, else the linux_x86_64 wheel is kept and the script says so;
# finally the wheel's files and the GPU code its module carries.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(realpath -m "${1:-$ROOT/dist}")"
PY="${PYTHON:-python3}"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
# nvcc, and the tools installed beside PYTHON (cmake, ninja, patchelf for auditwheel).
export PATH="$CUDA_HOME/bin:$("${PYTHON:-python3}" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
export SIFAR_ENABLE_CUDA=ON

command -v nvcc >/dev/null || { echo "build_wheel: no nvcc in $CUDA_HOME/bin or on PATH" >&2; exit 1; }
"$PY" -c "import build" 2>/dev/null || { echo "build_wheel: $PY lacks 'build' (pip install build)" >&2; exit 1; }
echo "build_wheel: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])'), $(nvcc --version | tail -1)"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"

args=(--wheel --outdir "$WORK/raw" -C "build-dir=$WORK/build")
[[ "${SIFAR_BUILD_ISOLATION:-1}" == 0 ]] && args+=(--no-isolation --skip-dependency-check)
t0=$(date +%s)
"$PY" -m build "${args[@]}" "$ROOT"
t1=$(date +%s)
raw="$(ls "$WORK"/raw/*.whl)"
echo "build_wheel: built $(basename "$raw") in $((t1 - t0)) s"

# manylinux: auditwheel checks the symbols the module uses and retags the
# wheel (nothing to graft: it needs only libc, libm, libstdc++, libgcc_s; the
# CUDA runtime is static and the driver is dlopen'ed).
wheel=""
if "$PY" -m auditwheel --version >/dev/null 2>&1; then
  "$PY" -m auditwheel show "$raw" || true
  if "$PY" -m auditwheel repair -w "$WORK/repaired" "$raw"; then
    wheel="$(ls "$WORK"/repaired/*.whl)"
  else
    echo "build_wheel: auditwheel repair failed (above; it needs patchelf): keeping the linux wheel"
  fi
else
  echo "build_wheel: auditwheel is not installed for $PY: keeping the linux wheel (not uploadable to PyPI)"
fi
t2=$(date +%s)
[[ -n "$wheel" ]] || wheel="$raw"
cp "$wheel" "$OUT/"
wheel="$OUT/$(basename "$wheel")"

echo
echo "build_wheel: $wheel ($(du -h "$wheel" | cut -f1), build $((t1 - t0)) s, repair $((t2 - t1)) s)"
"$PY" - "$wheel" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    infos = z.infolist()
    for i in infos:
        print(f"  {i.file_size:>10}  {i.filename}")
    tops = sorted({i.filename.split("/")[0] for i in infos if not i.filename.split("/")[0].endswith(".dist-info")})
    print(f"  top-level entries besides the metadata: {tops}")
    if tops != ["sifar_jax"]:
        sys.exit("build_wheel: the wheel must hold sifar_jax alone")
    if "sifar_jax/py.typed" not in z.namelist():
        sys.exit("build_wheel: sifar_jax/py.typed is missing")
EOF
"$PY" "$ROOT/tools/fatbin_archs.py" "$wheel"
