#!/usr/bin/env bash
# Validates the ffi layer on ONE GPU (issue 38, "after the ffi change"), from the repository
# root, everything written under $OUT. Steps, in order (default: all):
#   build     this tree (BUILD_BEFORE=0: only it) and the base commit's (BEFORE_TAR, `git archive` of it, default
#             .before/base-71ea98f.tar.gz), CUDA for sm_90, both in .validate/ (the base tree
#             gets this tree's ffi/bindings/testing_gpu.cc: the same harness, its own kernels)
#   tests     every GPU test one GPU runs (bench/gpu_host_run.sh's selection, and matvec's)
#   stress    STRESS_CALLS skewed all-reduces (every portable algorithm, 16 B..64 KB, 4 dtypes;
#             the sizes over 8 KB in every 4th round) over virtual ranks N = 2, 4, 8 on the GPU
#             (one N at a time), checked bit for bit against the rank-order reference, within
#             STRESS_S seconds (it stops there and says so);
#             then STRESS_MP_CALLS data-dependent ones over two processes sharing the GPU
#   sanitize  compute-sanitizer memcheck, racecheck, synccheck on the all-reduce kernels (every
#             portable algorithm) and the fused kernel (rows in a block, a cluster, wide rows)
#   ab        kernel-level latency (VirtualRanks.time_repeated: (t(R) - t(1)) / (R - 1)) per
#             algorithm and N, before and after alternating AB_ROUNDS times; an A/B table last
# Multicast is never run: only portable algorithms are named, and its switches are forced off.
#   OUT=/tmp/out bash tools/validate_ffi.sh [steps...]
# One 10-minute device call holds "build tests sanitize ab"; 10M stress calls take a call of
# their own and more ("BUILD_BEFORE=0 ... build stress" with STRESS_S near 480 reaches about
# 9M: the counts of calls on the same commit add up). Each call builds again (a cold machine).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/validate-ffi}; PY=${PYTHON:-python3}; W=$PWD/.validate; B=$W/before
BEFORE_TAR=${BEFORE_TAR:-.before/base-71ea98f.tar.gz}
STRESS_CALLS=${STRESS_CALLS:-10000000}; STRESS_S=${STRESS_S:-200}; STRESS_MP_CALLS=${STRESS_MP_CALLS:-10000}
AB_ROUNDS=${AB_ROUNDS:-3}; JOBS=${JOBS:-$(nproc)}  # BUDGET_S: later steps skipped past it
mkdir -p "$OUT" "$W"; LOG=$OUT/validate.log; T0=$(date +%s)
log() { echo "=== +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
quiet() { grep -v "^[WI][0-9]\{4\}\|^\[[0-9]\] [WI][0-9]\{4\}" | tee -a "$LOG"; }
steps=("$@"); [[ ${#steps[@]} -eq 0 ]] && steps=(build tests stress sanitize ab)

source tools/build_tree.sh  # build_tree SRC BUILD_DIR
pytest_() { timeout --kill-after=10 "${TESTS_TIMEOUT:-300}" env PYTHONPATH="$PWD/src:$PWD" \
  "$PY" -m pytest -q -rs -p no:cacheprovider "$@" 2>&1 | quiet | tail -25; }

for step in "${steps[@]}"; do
  if (( $(date +%s) - T0 > ${BUDGET_S:-540} - 60 )); then  # one device call: 600 s
    log "$step: SKIPPED, under a minute of the ${BUDGET_S:-540} s budget left"; continue
  fi
  need=(src/sifar_jax/_sifar*.so); [[ $step == ab ]] && need+=("$B"/src/sifar_jax/_sifar*.so)
  if [[ $step != build ]] && ! ls "${need[@]}" >/dev/null 2>&1; then
    log "$step: SKIPPED, no built module in ${need[*]} (run the build step)"; continue
  fi
  case $step in
build)
  if [[ ${BUILD_BEFORE:-1} == 0 ]]; then  # only this tree (every step but ab)
    log "build: this tree"; build_tree "$PWD" "$W/build-after" 2>&1 | tee -a "$LOG"; continue
  fi
  log "build: this tree and $BEFORE_TAR"
  rm -rf "$B" && mkdir -p "$B" && tar -xzf "$BEFORE_TAR" -C "$B" || { log "no $BEFORE_TAR"; continue; }
  cp ffi/bindings/testing_gpu.cc "$B/ffi/bindings/testing_gpu.cc"
  JOBS=$(( JOBS / 2 > 0 ? JOBS / 2 : 1 ))
  build_tree "$PWD" "$W/build-after" 2>&1 | tee -a "$LOG" & build_tree "$B" "$W/build-before" 2>&1 | tee -a "$LOG"
  wait ;;
tests)
  log "tests: GPU tests of one GPU"
  pytest_ -m "not slow" tests/sifar_jax/test_gpu.py tests/sifar_jax/test_buffers.py
  pytest_ tests/sifar_jax/test_ordering.py tests/sifar_jax/test_fused.py tests/sifar_jax/test_transforms.py \
    tests/sifar_jax/test_multiprocess.py tests/sifar_jax/test_matvec.py -k gpu
  pytest_ tests/sifar_jax/test_fp8_matvec.py -k gpu ;;  # its own timeout and summary line
stress)
  log "stress: $STRESS_CALLS over virtual ranks (at most ${STRESS_S} s), then $STRESS_MP_CALLS over 2 processes"
  # One VirtualRanks at a time: each sizes its grids to the SMs it alone would have, so
  # instances run side by side leave a barrier algorithm's rank unscheduled behind spinning
  # peers of another instance (a threaded version timed out at every N).
  STRESS_CALLS=$STRESS_CALLS STRESS_S=$STRESS_S timeout $(( STRESS_S + 120 )) "$PY" - <<'PY' 2>&1 | quiet
import os, sys, time, numpy as np, ml_dtypes
sys.path.insert(0, "src/sifar_jax"); import _sifar
ALGS = {a["name"]: a["id"] for a in _sifar.algorithms() if a["portable"]}
DT = [(np.dtype(ml_dtypes.bfloat16), 1), (np.dtype(np.float32), 0), (np.dtype(np.float16), 2), (np.dtype(np.int32), 3)]
SIZES = (16, 1008, 4112, 8192, 16384, 32768, 65536)
want_calls, budget = int(os.environ["STRESS_CALLS"]), float(os.environ["STRESS_S"])
def batch(rng, k, n, nbytes, dt):  # inputs (k, n, count) and the rank-order sums, tiled per rank
    c = nbytes // dt.itemsize
    if dt == np.int32:
        x = rng.integers(-2**31, 2**31, (k, n, c), dtype=np.int64).astype(np.int32)
        s = x.astype(np.int64).sum(1).astype(np.uint32).view(np.int32)
    else:
        x = (rng.standard_normal((k, n, c), dtype=np.float32) * np.float32(2.0) ** rng.integers(-6, 7, (k, n, c))).astype(dt)
        s = x[:, 0].astype(np.float32)
        for r in range(1, n): s = (s + x[:, r].astype(np.float32)).astype(np.float32)
        s = s.astype(dt)
    return x.tobytes(), np.repeat(s[:, None], n, 1).tobytes()
tot = dict(calls=0, bad_outputs=0, failures=0, retries=0, timeouts=0)
def one(n, want, t_end):  # N virtual ranks on the GPU, alone: want all-reduces or until t_end
    k, rng = 1024 // n, np.random.default_rng(n)
    mk = lambda: _sifar.testing.VirtualRanks(0, n, 64 * 1024, 10.0)
    vr = mk(); vr.set_skew(2000, n)
    data = {(b, j): batch(rng, k, n, b, DT[(i + j) % 4][0]) + (DT[(i + j) % 4][1],) for i, b in enumerate(SIZES) for j in (0, 1)}
    calls, rnd = 0, 0
    while calls < want and time.time() < t_end:
        for alg, a in ALGS.items():
            for b in SIZES:
                if b > vr.max_bytes(a) or (b > 8192 and rnd % 4): continue  # large: every 4th round
                x, want_out, elem = data[(b, rnd % 2)]
                out, failure, c, retried, timeouts = vr.run(a, elem, x, b, k)
                calls += k; tot["retries"] += retried; tot["timeouts"] += timeouts
                if out != want_out:
                    g, w = np.frombuffer(out, np.uint8).reshape(k, n, b), np.frombuffer(want_out, np.uint8).reshape(k, n, b)
                    tot["bad_outputs"] += int((g != w).any(2).sum())
                if failure or timeouts:
                    tot["failures"] += 1; print(f"N={n} {alg} {b} B: {failure or timeouts}")
                    vr.close(); vr = mk(); vr.set_skew(2000, n)
        rnd += 1
    vr.close(); tot["calls"] += calls
    print(f"virtual ranks N={n}: {calls} skewed all-reduces", flush=True)
t0 = time.time()
for i, n in enumerate((2, 4, 8)):  # each N its share of what is left of the calls and the time
    left = max(0.0, t0 + budget - time.time())
    one(n, (want_calls - tot["calls"]) // (3 - i), time.time() + left / (3 - i))
print(f"N = 2, 4, 8 one after another in {time.time() - t0:.0f} s")
print("STRESS virtual ranks:", tot, "(mismatching (call, rank) outputs: bad_outputs)")
print("STRESS", "PASS" if tot["bad_outputs"] == tot["failures"] == 0 < tot["calls"] else "FAIL",
      f"{tot['calls']} of {want_calls} asked" + ("" if tot["calls"] >= want_calls else " (time cap)"))
PY
  cat >"$W/stress_mp.py" <<'PY'
import os, sys, numpy as np
import sifar_jax
from sifar_jax import distributed, testing
distributed.initialize()
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("tp",)); sifar_jax.init(mesh); n = mesh.shape["tp"]
def stress(alg, size, steps):  # test_gpu.py's stress_fn: data-dependent calls, checked on the device
    def body(c):
        r, i = jax.lax.axis_index("tp"), jnp.arange(size, dtype=jnp.int32)
        def step(k, carry):
            prev, bad = carry
            base = 3 * prev + 7 * i + k + 11 * c[0]
            got = sifar_jax.sifar_psum(((base + 5 * r) % 31 + 1).astype(jnp.bfloat16), "tp", algorithm=alg).astype(jnp.int32)
            return got, bad + jnp.sum(got != sum((base + 5 * q) % 31 + 1 for q in range(n)), dtype=jnp.int32)
        return jax.lax.fori_loop(0, steps, step, (jnp.zeros(size, jnp.int32), jnp.int32(0)))[1][None]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P("tp")))
algs = list(sifar_jax.algorithms.PORTABLE); sizes = (8, 4096, 32768); steps = 200
fns = {(a, s): stress(a, s, steps) for a in algs for s in sizes}
calls, bad, it = 0, 0, 0
with testing.inject_skew(2):
    while calls < int(os.environ["STRESS_MP_CALLS"]):
        for (a, s), f in fns.items():
            c = jax.make_array_from_callback((1,), NamedSharding(mesh, P()), lambda _: np.int32([it]))
            bad += int(np.asarray(f(c).addressable_shards[0].data).sum()); calls += steps; it += 1
sifar_jax.check()
print(f"STRESS 2 processes: {calls} skewed all-reduces, {bad} mismatching elements", "PASS" if bad == 0 else "FAIL")
PY
  timeout 400 env PYTHONPATH="$PWD/src:$PWD" STRESS_MP_CALLS=$STRESS_MP_CALLS "$PY" -m sifar_jax.launch -n 2 \
    --share-gpu --timeout 360 -- "$PY" "$W/stress_mp.py" 2>&1 | quiet | grep -v "^\[.\] *$" | tail -8 ;;
sanitize)
  log "sanitize: memcheck racecheck synccheck (virtual ranks, N = 2)"
  read -r -d '' CODE <<'PY'
import sys, numpy as np, ml_dtypes
sys.path.insert(0, "src/sifar_jax"); import _sifar
vr, bf = _sifar.testing.VirtualRanks(0, 2, 256 * 1024, 60.0), np.dtype(ml_dtypes.bfloat16)
rng, fails = np.random.default_rng(0), []
for a in (a for a in _sifar.algorithms() if a["portable"]):
    for nbytes in (1008, 8192):
        x = rng.standard_normal(4 * 2 * nbytes // 2).astype(bf)
        r = vr.run(a["id"], 1, x.tobytes(), nbytes, 4)
        if r[1] or r[4]: fails.append(f"{a['name']} {nbytes} B: {r[1] or r[4]}")
for hidden, rows in ((64, 3), (4096, 2), (8192, 1), (16384, 1), (40960, 1)):  # a block, clusters, wide
    x, res, w = (rng.standard_normal(s).astype(bf) for s in (4 * 2 * rows * hidden, rows * hidden, hidden))
    r = vr.run_fused(1, x.tobytes(), res.tobytes(), w.tobytes(), hidden, rows, 1e-6, 4)
    if r[2] or r[5]: fails.append(f"fused hidden={hidden} rows={rows}: {r[2] or r[5]}")
vr.close(); print("sanitize harness:", "; ".join(fails) or "every call ran"); sys.exit(1 if fails else 0)
PY
  for tool in memcheck racecheck synccheck; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 7 "$PY" -c "$CODE" 2>&1 | quiet | tail -4
    log "sanitize $tool: exit status ${PIPESTATUS[0]} (0: clean)"
  done ;;
ab)
  log "ab: kernel-level latency, before and after, $AB_ROUNDS rounds alternating"
  read -r -d '' CODE <<'PY'
import json, sys, numpy as np
tree, tag = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree + "/src/sifar_jax"); import _sifar
R, S = 2000, 21
def lat(t1, tr): return (np.median(tr) - np.median(t1)) / (R - 1) * 1e6
for n in (2, 4, 8):
    vr = _sifar.testing.VirtualRanks(0, n, 64 * 1024, 10.0)
    for a in (a for a in _sifar.algorithms() if a["portable"]):
        for nbytes in (8192, 32768):
            if nbytes > vr.max_bytes(a["id"]): continue
            t = [vr.time_repeated(a["id"], 1, nbytes, r, S) for r in (1, R)]
            print(json.dumps(dict(tag=tag, n=n, op=a["name"], kb=nbytes // 1024, us=lat(*t))))
    for hidden in (4096, 8192):
        t = [vr.time_fused_repeated(1, hidden, 1, r, S) for r in (1, R)]
        print(json.dumps(dict(tag=tag, n=n, op="fused", kb=hidden * 2 // 1024, us=lat(*t))))
    vr.close()
PY
  : >"$OUT/ab.jsonl"
  for r in $(seq "$AB_ROUNDS"); do for t in before after; do
    tree=$([[ $t == before ]] && echo "$B" || echo "$PWD")
    timeout 200 "$PY" -c "$CODE" "$tree" "$t" >>"$OUT/ab.jsonl" 2>>"$LOG" || log "ab $t round $r: failed"
  done; done
  "$PY" - "$OUT/ab.jsonl" <<'PY' | tee "$OUT/ab.md" | tee -a "$LOG"
import json, sys, collections, statistics as st
d = collections.defaultdict(lambda: collections.defaultdict(list))
for ln in open(sys.argv[1]):
    r = json.loads(ln); d[(r["n"], r["op"], r["kb"])][r["tag"]].append(r["us"])
print("| N | kernel | KB | before us (rounds) | after us (rounds) | after/before |\n|---|---|---|---|---|---|")
for (n, op, kb), v in sorted(d.items()):
    b, a = v.get("before", []), v.get("after", [])
    f = lambda xs: " ".join(f"{x:.3f}" for x in xs) or "-"
    ratio = f"{st.median(a) / st.median(b):.3f}" if a and b and st.median(b) > 0 else "-"
    print(f"| {n} | {op} | {kb} | {f(b)} | {f(a)} | {ratio} |")
PY
  ;;
*) log "unknown step $step (build tests stress sanitize ab)" ;;
esac; done
log "done"
