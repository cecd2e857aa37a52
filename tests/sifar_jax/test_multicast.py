"""NVLink multicast (algorithm="multicast"): everything that can be checked
without ever executing multicast.

NO TEST HERE CREATES A MULTICAST OBJECT OR RUNS A multimem INSTRUCTION, on any
host. Multicast is forbidden on our GPU hosts (docs/design.md, Multicast). What runs:

- the Python and C++ guards, on explicit environments (pure functions);
- the C++ set-up entry point, ONLY under a process environment the guard
  refuses (checked by an interlock before every call), proving it refuses
  before any CUDA call (the extension's call counter stays 0);
- the set-up arithmetic (granularity rounding, offsets, slot layout, flag
  validation, line ownership) through pure functions of the extension;
- nvcc/ptxas/cuobjdump on the kernel source: the multimem.ld_reduce
  instructions are present in the PTX and the SASS (compiling is not running).

On a GPU host this whole module is safe to run: it only refuses.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sifar_jax
from sifar_jax import _testing, multicast
from sifar_jax._ext import lib as ext

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNEL = ROOT / "ffi" / "multicast" / "cuda_multicast.cu"
GUARD_VARS = (multicast.ENABLE_VAR, *multicast.DISABLING)
MiB = 1 << 20


# --------------------------------------------------------------- helpers --
@pytest.fixture
def clean_env(monkeypatch):
    """No guard variable set; each test sets exactly what it needs."""
    for var in GUARD_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _set_env(monkeypatch, env: dict[str, str]) -> None:
    for var in GUARD_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)


def _interlock() -> str:
    """Refuses to let a test reach the C++ set-up unless the process
    environment makes the guard refuse (CPU-only builds excepted: they have no
    CUDA code to reach)."""
    reason = multicast.refusal()
    if reason is None and ext.built_with_cuda():
        pytest.fail("interlock: the environment allows multicast; this test will not call set-up")
    return reason


def _refusing_envs():
    """Every process environment the guard must refuse: the opt-in missing or
    wrong, or any subset of the disabling variables set (as on our GPU hosts)."""
    envs = []
    for enable in (None, "0", "", "true", " 1", "1"):
        for k in range(len(multicast.DISABLING) + 1):
            for subset in itertools.combinations(multicast.DISABLING, k):
                env = {} if enable is None else {multicast.ENABLE_VAR: enable}
                env.update({v: multicast.DISABLING[v] for v in subset})
                if enable == "1" and not subset:
                    continue  # the one combination the environment allows
                envs.append(env)
    return envs


REFUSING = _refusing_envs()


def _id(env: dict[str, str]) -> str:
    return ",".join(f"{k}={v!r}" for k, v in env.items()) or "nothing-set"


# ----------------------------------------------------------------- guard --
def test_cpp_guard_uses_the_same_variables():
    enable, disabling = ext.multicast_guard_vars()
    assert enable == multicast.ENABLE_VAR
    assert disabling == multicast.DISABLING


def _env_cases():
    values = {  # per variable: values that disable and values that do not
        "NCCL_NVLS_ENABLE": (["0", " 0", "0\n"], ["1", "", "00", "no"]),
        "NVSHMEM_DISABLE_NVLS": (["1", "1 "], ["0", "", "true"]),
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": (["1", "\t1"], ["0", "", "yes"]),
    }
    cases = []
    for enable in (None, "1", "0", " 1", "1 ", "yes", ""):
        cases.append(({} if enable is None else {multicast.ENABLE_VAR: enable}, enable == "1"))
        for var, (off, on) in values.items():
            for v in off:
                env = {var: v} if enable is None else {multicast.ENABLE_VAR: enable, var: v}
                cases.append((env, False))
            for v in on:
                env = {var: v} if enable is None else {multicast.ENABLE_VAR: enable, var: v}
                cases.append((env, enable == "1"))
    # every subset of the disabling variables together
    for k in range(1, 4):
        for subset in itertools.combinations(values, k):
            env = {multicast.ENABLE_VAR: "1", **{v: values[v][0][0] for v in subset}}
            cases.append((env, False))
    return cases


@pytest.mark.parametrize("device_supports", [None, True, False])
@pytest.mark.parametrize("env,env_allows", _env_cases(), ids=lambda c: _id(c) if isinstance(c, dict) else str(c))
def test_python_and_cpp_guards_agree(env, env_allows, device_supports):
    allowed = env_allows and device_supports is not False
    py = multicast.refusal(environ=env, device_supports=device_supports)
    cpp = ext.multicast_refusal(env, device_supports)
    assert py == cpp  # one guard: the same rules and the same words
    assert (py is None) == allowed
    if not allowed:
        with pytest.raises(multicast.MulticastDisabledError, match="refused"):
            multicast.require_enabled(environ=env, device_supports=device_supports)
    else:
        multicast.require_enabled(environ=env, device_supports=device_supports)


def test_refusal_names_the_variable():
    for var, off in multicast.DISABLING.items():
        env = {multicast.ENABLE_VAR: "1", var: off}
        assert f"{var}={off}" in ext.multicast_refusal(env, None)
    assert "opt-in" in ext.multicast_refusal({}, None)
    assert "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED" in ext.multicast_refusal(
        {multicast.ENABLE_VAR: "1"}, False
    )


@pytest.mark.parametrize("env", REFUSING, ids=_id)
def test_cpp_setup_refuses_before_any_cuda_call(clean_env, env):
    """CreateMulticastGroup runs the guard first: every disabled combination
    is refused with the guard's reason and no CUDA call is ever made."""
    _set_env(clean_env, env)
    reason = _interlock()
    assert reason is not None
    before = multicast.counters()
    assert before["cuda_calls"] == 0 and before["setups"] == 0

    # The C++ set-up itself (no Python guard in front of it).
    with pytest.raises(multicast.MulticastDisabledError) as e:
        ext.multicast_probe_setup([0, 1], 64 * 1024)
    assert reason in str(e.value)
    # The C++ "here" guard, and the Python wrappers.
    assert ext.multicast_refusal_here([0, 1]) == reason
    assert multicast.refusal_here([0, 1]) == reason
    with pytest.raises(multicast.MulticastDisabledError):
        multicast.probe_setup([0, 1])

    after = multicast.counters()
    assert after["cuda_calls"] == 0, "a refused set-up reached CUDA"
    assert after["setups"] == 0
    assert after["refusals"] >= before["refusals"] + 2
    assert multicast.driver_calls() == 0


def test_cpu_only_build_refuses_even_when_enabled(clean_env):
    """Without the CUDA backend the set-up has nothing to reach: it refuses
    through the same guard even where the environment allows multicast."""
    if ext.built_with_cuda():  # decided BEFORE the environment is touched
        pytest.skip("CUDA build: an allowing environment is never used by these tests")
    _set_env(clean_env, {multicast.ENABLE_VAR: "1"})
    assert multicast.refusal() is None
    with pytest.raises(multicast.MulticastDisabledError, match="built without its CUDA backend"):
        ext.multicast_probe_setup([0, 1], 4096)
    assert "built without" in multicast.refusal_here([0, 1])
    assert multicast.counters()["cuda_calls"] == 0


@pytest.mark.parametrize("opt_in", [False, True], ids=["off", "opted-in"])
def test_sifar_psum_into_refuses_multicast(cpu_mesh, monkeypatch, opt_in):
    """Explicit buffers cannot serve multicast: a clear error at trace time,
    whatever the guard says (never a call that silently ignores its buffer).
    CPU devices only: no multicast set-up exists to be reached."""
    if opt_in:
        monkeypatch.setenv(multicast.ENABLE_VAR, "1")
    mesh = cpu_mesh(2, slot_bytes=4096)
    bufs = sifar_jax.make_buffers(mesh, "tp")
    spec = sifar_jax.buffer_spec(mesh)

    def body(x, a, b):
        return sifar_jax.sifar_psum_into(x, "tp", a, b, algorithm="multicast")[0]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), spec, spec), out_specs=P("tp")))
    with pytest.raises(ValueError, match="'multicast' does not support explicit buffers"):
        f.lower(jax.ShapeDtypeStruct((2, 8), jnp.float32), *bufs)
    assert multicast.driver_calls() == 0


def test_sifar_psum_multicast_never_reaches_cuda(cpu_mesh):
    """sifar_psum(algorithm="multicast") refuses at trace time on the CPU
    backend; "auto" does not pick it there; no multicast CUDA call is made."""
    mesh = cpu_mesh(2, slot_bytes=4096)
    x = jax.ShapeDtypeStruct((2, 8), jnp.float32)

    def lower(body):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))
        return f.lower(x)

    with pytest.raises((multicast.MulticastDisabledError, ValueError), match="multicast"):
        lower(lambda v: sifar_jax.sifar_psum(v, "tp", algorithm="multicast"))
    assert multicast.driver_calls() == 0


# ------------------------------------------------------------ arithmetic --
def test_round_up_and_lcm():
    ru = _testing.multicast_round_up
    for g in (1, 3, 16, 2 * MiB, 512 * MiB):
        assert ru(0, g) == 0
        assert ru(1, g) == g
        assert ru(g, g) == g
        assert ru(g + 1, g) == 2 * g
        assert ru(5 * g - 1, g) == (5 * g if g > 1 else 4)
    assert ru(10, 3) == 12
    with pytest.raises(ValueError):
        ru(1, 0)
    with pytest.raises(OverflowError):
        ru(2**64 - 2, 4)
    lcm = _testing.multicast_lcm
    assert lcm(2 * MiB, 512 * MiB) == 512 * MiB
    assert lcm(6, 4) == 12
    assert lcm(3 * MiB, 2 * MiB) == 6 * MiB
    with pytest.raises(ValueError):
        lcm(0, 2)
    with pytest.raises(OverflowError):
        lcm(2**63 + 1, 2**63 - 1)


GRANULARITIES = [  # (multicast minimum, multicast recommended, allocation)
    (2 * MiB, 2 * MiB, 2 * MiB),
    (2 * MiB, 512 * MiB, 2 * MiB),  # a recommended granularity far above the need
    (2 * MiB, 4 * MiB, 2 * MiB),
    (1 * MiB, 2 * MiB, 2 * MiB),  # allocation granularity coarser than the minimum
    (2 * MiB, 6 * MiB, 4 * MiB),  # not powers of two: lcm still legal
    (64 * 1024, 64 * 1024, 64 * 1024),
]
SLOTS = [16, 4096, 8192, 64 * 1024, 64 * 1024 + 16, 1 * MiB, 300 * MiB]


@pytest.mark.parametrize("grans", GRANULARITIES, ids=str)
@pytest.mark.parametrize("slot_bytes", SLOTS)
def test_layout_is_legal_and_disjoint(slot_bytes, grans):
    mc_min, mc_rec, mem = grans
    L = _testing.multicast_layout(slot_bytes, mc_min, mc_rec, mem)
    legal = np.lcm(mc_min, mem)
    best = np.lcm(legal, mc_rec)
    ru = lambda x, g: -(-x // g) * g  # noqa: E731
    # sizes: legal for the driver, big enough, and the documented choice
    assert L.need == _testing.multicast_need_bytes(slot_bytes)
    assert L.alloc_bytes >= L.need
    assert L.alloc_bytes % mc_min == 0 and L.alloc_bytes % mem == 0
    assert L.alloc_bytes % L.granularity == 0 and L.granularity % legal == 0
    assert L.recommended == (ru(L.need, best) <= 2 * ru(L.need, legal))
    if L.recommended:
        assert L.alloc_bytes % mc_rec == 0 and L.alloc_bytes == ru(L.need, best)
    else:
        assert L.alloc_bytes == ru(L.need, legal)
    # slot layout: two slots, each payload then per-block flags, 256-aligned
    nflag = 64 * _testing.multicast_flag_bytes()
    assert L.slot_bytes == slot_bytes
    assert L.payload == 0 and L.slot0 == 0
    for off in (L.slot0, L.slot_stride, L.payload, L.flags):
        assert off % 256 == 0
    assert L.flags >= L.payload + slot_bytes
    assert L.slot_stride >= L.flags + nflag
    assert L.need == L.slot0 + 2 * L.slot_stride


def test_layout_choice_of_granularity():
    # 64 KiB of payload with a 512 MiB recommended granularity: use the minimum.
    small = _testing.multicast_layout(64 * 1024, 2 * MiB, 512 * MiB, 2 * MiB)
    assert not small.recommended and small.alloc_bytes == 2 * MiB
    # 300 MiB slots (600 MiB needed): rounding to 512 MiB costs < 2x: recommended.
    big = _testing.multicast_layout(300 * MiB, 2 * MiB, 512 * MiB, 2 * MiB)
    assert big.recommended and big.alloc_bytes == 1024 * MiB
    for bad in ((0, 2 * MiB, 2 * MiB, 2 * MiB), (17, 2 * MiB, 2 * MiB, 2 * MiB),
                (4096, 0, 2 * MiB, 2 * MiB), (4096, 2 * MiB, 0, 2 * MiB),
                (4096, 2 * MiB, 2 * MiB, 0)):
        with pytest.raises(ValueError):
            _testing.multicast_layout(*bad)


def _next_epoch(e: int) -> int:  # protocol.h NextEpoch: skips 0 and 1 on wrap
    return 2 if e + 1 == 2**32 else e + 1


@pytest.mark.parametrize("slot_bytes", [4096, 64 * 1024 + 16])
def test_slot_parity_and_offsets(slot_bytes):
    L = _testing.multicast_layout(slot_bytes, 2 * MiB, 2 * MiB, 2 * MiB)
    lines = slot_bytes // 16
    for e in (1, 2, 3, 4, 2**31, 2**32 - 2, 2**32 - 1):
        base = _testing.multicast_slot_offset(L, e)
        assert base == L.slot0 + (e % 2) * L.slot_stride
        # consecutive epochs alternate slots, across the 32-bit wrap too
        assert _testing.multicast_slot_offset(L, _next_epoch(e)) != base
        assert _testing.multicast_line_offset(L, e, 0) == base + L.payload
        last = _testing.multicast_line_offset(L, e, lines - 1)
        assert last == base + L.payload + 16 * (lines - 1)
        assert last + 16 <= base + L.flags  # payload never runs into the flags
        flags = [_testing.multicast_flag_offset(L, e, b) for b in range(64)]
        assert flags[0] == base + L.flags
        assert all(f % 8 == 0 for f in flags)
        assert len(set(flags)) == 64
        assert max(flags) + 8 <= base + L.slot_stride
    # the two slots' flags are distinct words
    s0 = {_testing.multicast_flag_offset(L, 2, b) for b in range(64)}
    s1 = {_testing.multicast_flag_offset(L, 3, b) for b in range(64)}
    assert not s0 & s1
    assert max(s1) + 8 <= L.need <= L.alloc_bytes
    with pytest.raises(IndexError):
        _testing.multicast_flag_offset(L, 2, 64)


def test_flag_validation_is_exact():
    valid = _testing.multicast_flags_valid
    for n in range(1, 9):
        for e in (2, 3, 1000, 2**31, 2**32 - 1):
            # a stale flag is an older epoch of the same parity (or 0: never written)
            for stale in {0, max(e - 2, 0), max(e - 2000, 0), 2**32 - 2 if e % 2 == 0 else 2**32 - 1}:
                if stale == e or (stale and stale % 2 != e % 2):
                    continue
                for fresh in range(n + 1):
                    s = fresh * e + (n - fresh) * stale
                    assert valid(s, n, e) == (fresh == n), (n, e, stale, fresh)
    # where a 32-bit sum would alias (8 ranks, stale = e - 2**29), 64 bits do not
    e = 2**29 + 2
    stale = e - 2**29
    assert (8 * stale - 8 * e) % 2**32 == 0
    assert not valid(8 * stale, 8, e)
    assert valid(8 * e, 8, e)


@pytest.mark.parametrize(
    "lines", [0, 1, 255, 256, 257, 512, 64 * 256 - 1, 64 * 256, 64 * 256 + 1, 3 * 64 * 256 + 17, 100_000]
)
def test_line_ownership_matches_protocol(lines):
    """The kernel's iteration (replayed on the host) moves every line exactly
    once, in the block BlockOfLine (protocol.h) assigns it."""
    assert _testing.multicast_lines_per_block() == 256
    owners = np.asarray(_testing.multicast_line_owners(lines), dtype=np.int64)
    assert owners.shape == (lines,)
    if lines == 0:
        assert _testing.multicast_blocks(0) == 0
        return
    assert (owners >= 0).all(), "a line is moved by no thread (-1) or by several (-2)"
    expect = np.array([_testing.multicast_block_of_line(i) for i in range(lines)])
    np.testing.assert_array_equal(owners, expect)
    blocks = _testing.multicast_blocks(lines)
    assert 1 <= blocks <= 64 and owners.max() == blocks - 1


# --------------------------------------------------------------- the PTX --
def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "bin", name)):
            return os.path.join(root, "bin", name)
    return None


def _run(cmd: list[str]) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.fixture(scope="module")
def nvcc():
    path = _tool("nvcc")
    if path is None:
        pytest.skip("nvcc not found (PATH, $CUDA_HOME, /usr/local/cuda): cannot compile the kernel")
    return path


def _nvcc_cmd(nvcc, *extra):
    return [nvcc, "-std=c++17", "-arch=sm_90", "-DSIFAR_WITH_CUDA=1", "-I", str(ROOT / "ffi"), *extra]


@pytest.fixture(scope="module")
def ptx(nvcc, tmp_path_factory):
    out = tmp_path_factory.mktemp("mc") / "cuda_multicast.ptx"
    _run(_nvcc_cmd(nvcc, "-ptx", str(KERNEL), "-o", str(out)))
    return out.read_text()


@pytest.fixture(scope="module")
def cubin(nvcc, tmp_path_factory):
    out = tmp_path_factory.mktemp("mc") / "cuda_multicast.cubin"
    _run(_nvcc_cmd(nvcc, "-cubin", str(KERNEL), "-o", str(out)))
    return out


def _entries(ptx_text: str) -> dict[str, str]:
    """Kernel name -> its PTX body."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\S+)\s*\(", ptx_text):
        end = ptx_text.find("\n}", m.end())
        out[m.group(1)] = ptx_text[m.end() : end]
    return out


# instruction -> the element type (template argument) whose kernel must hold it
PAYLOAD_REDUCTIONS = {
    0: "multimem.ld_reduce.relaxed.sys.global.add.v4.f32",
    1: "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2",
    2: "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2",
}
EVERY_KERNEL = [
    "multimem.ld_reduce.relaxed.sys.global.add.u64",  # speculative flag sum
    "multimem.ld_reduce.acquire.sys.global.add.u64",  # validated flag sum (re-pull)
    "st.release.sys.global.u64",  # publishing the flag
    "fence.proxy.alias",  # unicast stores vs multicast loads of the same bytes
    "%globaltimer",  # bounded spin
]


def test_ptx_has_the_multimem_reductions(ptx):
    kernels = {k: v for k, v in _entries(ptx).items() if "MulticastAllReduceKernel" in k}
    assert len(kernels) == 3, sorted(_entries(ptx))
    for elem, instr in PAYLOAD_REDUCTIONS.items():
        [body] = [v for k, v in kernels.items() if f"ILi{elem}EE" in k]
        # 16-byte vectors: four 32-bit registers from one multicast address
        pat = re.escape(instr) + r"\s+\{%r\d+, %r\d+, %r\d+, %r\d+\}, \[%rd\d+\];"
        assert re.search(pat, body), f"{instr} missing from the elem={elem} kernel"
        for other in PAYLOAD_REDUCTIONS.values():
            if other != instr:
                assert other not in body
        for must in EVERY_KERNEL:
            assert must in body, f"{must} missing from the elem={elem} kernel"
    assert "cuMulticast" not in ptx  # host code stays host code


def test_ptxas_assembles_for_sm90(ptx, nvcc, cubin, tmp_path):
    """nvcc -cubin (done by the fixture) and ptxas on the PTX both succeed."""
    assert cubin.read_bytes()[:4] == b"\x7fELF"
    ptxas = _tool("ptxas")
    if ptxas is None:
        pytest.skip("ptxas not found next to nvcc")
    src = tmp_path / "mc.ptx"
    src.write_text(ptx)
    _run([ptxas, "-arch=sm_90", str(src), "-o", str(tmp_path / "mc_ptxas.cubin")])
    assert (tmp_path / "mc_ptxas.cubin").read_bytes()[:4] == b"\x7fELF"


_SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Za-z0-9_.]*)(?:\s|;)")


def _sass_by_function(text: str) -> dict[str, list[str]]:
    funcs: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"\s*Function\s*:\s*(\S+)", line)
        if m:
            current = m.group(1)
            funcs[current] = []
            continue
        if current is not None:
            op = _SASS_OP.search(line)
            if op:
                funcs[current].append(op.group(1))
    return funcs


def test_sass_has_the_multimem_reductions(nvcc, cubin, tmp_path):
    """The SASS opcode multimem.ld_reduce becomes is found by compiling two
    one-instruction probes (multimem.ld_reduce vs a plain load) and taking the
    opcodes only the first has; the kernels must contain it."""
    cuobjdump = _tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not found: the SASS check runs where it is installed")
    probe = tmp_path / "probe.cu"
    probe.write_text(
        "#include <cstdint>\n"
        'extern "C" __global__ void mm(const uint4* p, uint4* o) { uint4 v;\n'
        '  asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 '
        '{%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");\n'
        "  *o = v; }\n"
        'extern "C" __global__ void ld(const uint4* p, uint4* o) { uint4 v;\n'
        '  asm volatile("ld.relaxed.sys.global.v4.u32 '
        '{%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");\n'
        "  *o = v; }\n"
    )
    probe_cubin = tmp_path / "probe.cubin"
    _run([nvcc, "-arch=sm_90", "-cubin", str(probe), "-o", str(probe_cubin)])
    probe_sass = _sass_by_function(_run([cuobjdump, "-sass", str(probe_cubin)]))
    base = lambda op: op.split(".")[0]  # noqa: E731
    multimem_ops = {base(o) for o in probe_sass["mm"]} - {base(o) for o in probe_sass["ld"]}
    assert multimem_ops, f"no opcode specific to multimem.ld_reduce in {probe_sass}"  # LDGMC

    sass = _sass_by_function(_run([cuobjdump, "-sass", str(cubin)]))
    kernels = {k: ops for k, ops in sass.items() if "MulticastAllReduceKernel" in k}
    assert len(kernels) == 3, sorted(sass)
    payload_variants = {}
    for name, ops in kernels.items():
        variants = {o for o in ops if base(o) in multimem_ops}
        # the payload reduction and the flag reduction (e.g. LDGMC.E.F32ADD.BF16x8.RN.STRONG.SYS
        # and LDGMC.E.ADD.64.STRONG.SYS with CUDA 13.0)
        assert len(variants) >= 2, f"{name}: multimem reductions in its SASS: {sorted(variants)}"
        payload_variants[name] = frozenset(v for v in variants if ".64." not in v)
    # f32, bf16 and f16 kernels reduce with three different instructions
    assert len(set(payload_variants.values())) == 3, payload_variants
