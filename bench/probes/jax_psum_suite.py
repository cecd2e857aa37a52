"""JAX's own psum tests, with sifar_jax.sifar_psum swapped in for lax.psum.

Does `sifar_psum` behave as `lax.psum` where JAX's test suite looks? This copies
JAX's test files for the installed jax version (tag `jax-v<version>`) into a
temporary directory, rewrites every `lax.psum` / `jax.lax.psum` in them to a
`psum` that sets sifar_jax up for the enclosing shard_map's mesh and calls
`sifar_psum` (bench/probes/jax_psum_swap.py, copied as `_sifar_swap.py`), keeps
the tests whose body or decorators call it (the rest are renamed so that pytest
does not collect them), and runs pytest on them on 8 XLA:CPU devices with JAX's
own pytest settings (warnings are errors). The default files are those of
JAX's tests/ whose tests call lax.psum (shard_map, pmap, which this jax runs as
a shard_map, vmap and named axes, custom derivatives, control flow, roofline, ...).
mpi4jax's allreduce tests are not among them: they test MPI semantics (e.g.
the transpose of an all-reduce is the identity), not lax.psum's.

It prints pass / fail / error / skip counts (over every test collected, and
over those that called the swapped psum: other parameterizations of a kept
method may not, e.g. pmax's), in how many passing tests sifar really summed (and
in how many every call fell back to lax.psum, with the reasons), and every
failure with its first line, marked:

* "expected" with the reason, for the failures triaged as inspecting the jaxpr
  for JAX's psum primitive (EXPECTED below; sifar's primitive is
  `sifar_allreduce`);
* "names psum" for any other test whose source holds a string naming a psum
  primitive (e.g. 'psum_invariant'): probably the same kind, to triage;
* "UNEXPECTED" otherwise.

    python -m bench.probes.jax_psum_suite                       # clones jax at the tag
    python -m bench.probes.jax_psum_suite --jax-git /path/to/jax/.git
    python -m bench.probes.jax_psum_suite --files shard_map_test.py -k unreduced

Exit status: 0 when every failure is an expected one, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SWAP_MODULE = "_sifar_swap"
DEFAULT_FILES = ("shard_map_test.py", "pmap_test.py", "api_test.py", "batching_test.py",
                 "custom_api_test.py", "lax_control_flow_test.py", "checkify_test.py",
                 "pjit_test.py", "shard_alike_test.py", "memories_test.py",
                 "async_collectives_test.py", "roofline_test.py", "compilation_cache_test.py",
                 "custom_partitioning_test.py")

# lax.psum and jax.lax.psum, as a call or as a value; not psum_scatter, psum_p, ...
PSUM_REF = re.compile(r"(?<![\w.])(?:jax\.)?lax\.psum(?![\w])")
# A string literal that is a psum primitive's name: the test inspects a jaxpr.
PSUM_NAME = re.compile(r"""(['"])\w*psum\w*\1""")

# Failures triaged as inspecting the jaxpr for JAX's psum primitive (jax 0.10.2).
EXPECTED = {
    "shard_map_test.ShardMapTest.test_rewrite_scan":
        "asserts the scan body's first equation is the primitive named 'psum_invariant'",
    "roofline_test.RooflineTest.test_matmul_psum":
        "roofline's cost rules are keyed by JAX's psum primitive (psum_invariant_p); "
        "sifar_allreduce has none, so no ICI bytes are counted for it",
}

CONFTEST = '''"""Written by bench/probes/jax_psum_suite.py: sifar_jax set up per test."""
import os

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()

import pytest  # noqa: E402

import _sifar_swap  # noqa: E402


@pytest.fixture(autouse=True)
def _sifar_per_test(request):
    _sifar_swap.start_test()
    yield
    _sifar_swap.end_test(request.node.nodeid)
'''


# JAX's own pytest settings (its pyproject.toml at the tag): its markers, warnings as errors.
PYTEST_INI = """[pytest]
markers =
    multiaccelerator: indicates that a test can make use of and possibly requires multiple accelerators
    SlurmMultiNodeGpuTest: mark a test for Slurm multinode GPU nightly CI
filterwarnings =
    error
    ignore:Transparent hugepages
    ignore:jax.cloud_tpu_init was deprecated
"""


def jax_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import jax; print(jax.__version__)"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


JAX_URL = "https://github.com/jax-ml/jax.git"


def read_tests(files, ref: str, jax_git: str | None, jax_tests: str | None,
               work: Path, url: str = JAX_URL) -> dict[str, str]:
    """The text of tests/<file> at `ref`, from a git dir, a directory, or a clone."""
    if jax_tests:
        return {f: (Path(jax_tests) / f).read_text() for f in files}
    if not jax_git:
        clone = work / "jax-src"
        print(f"cloning {url} at {ref} ...", flush=True)
        subprocess.run(["git", "clone", "-q", "--depth", "1", "--branch", ref, url, str(clone)],
                       check=True)
        jax_git = str(clone / ".git")
    return {f: subprocess.run(["git", f"--git-dir={jax_git}", "show", f"{ref}:tests/{f}"],
                              capture_output=True, text=True, check=True).stdout
            for f in files}


def swap(text: str) -> tuple[str, int]:
    """Every lax.psum -> _sifar_swap.psum, and the import of _sifar_swap."""
    text, n = PSUM_REF.subn(f"{SWAP_MODULE}.psum", text)
    lines = text.splitlines(keepends=True)
    at = next((i + 1 for i, line in enumerate(lines) if line.startswith("from __future__")), 0)
    lines.insert(at, f"import {SWAP_MODULE}  # sifar_psum in lax.psum's place\n")
    return "".join(lines), n


def select(text: str) -> tuple[str, list[str], dict[str, bool]]:
    """Keeps the test methods that call the swapped psum (in their body or
    decorators): the others get a name pytest does not collect. Returns the
    text, the kept Class.method names, and for each whether it names a psum
    primitive in a string."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    kept, names_psum, drop = [], {}, []
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test")):
                continue
            start = min([fn.lineno] + [d.lineno for d in fn.decorator_list]) - 1
            source = "".join(lines[start:fn.end_lineno])
            if f"{SWAP_MODULE}.psum" in source:
                kept.append(f"{cls.name}.{fn.name}")
                names_psum[f"{cls.name}.{fn.name}"] = bool(PSUM_NAME.search(source))
            else:
                drop.append(fn.lineno - 1)
    for i in drop:  # the `def` line of each test not kept
        lines[i] = re.sub(r"\bdef test", "def _not_psum_test", lines[i], count=1)
    return "".join(lines), kept, names_psum


def base_name(testcase_name: str, kept: list[str]) -> str | None:
    """The kept method a (parameterized) test case comes from: the longest
    kept name it starts with."""
    cls, _, name = testcase_name.rpartition(".")
    cls = cls.rpartition(".")[2]
    hits = [k for k in kept if k.startswith(cls + ".") and name.startswith(k.split(".")[1])]
    return max(hits, key=len) if hits else None


def parse_junit(path: Path) -> list[dict]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip().splitlines()
                message = message[0][:200] if message else ""
                break
        file = case.get("file") or case.get("classname", "").split(".")[0] + ".py"
        cases.append({"id": f"{case.get('classname')}.{case.get('name')}", "file": file,
                      "name": case.get("name"), "outcome": outcome, "message": message})
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jax-git", help="a git dir of jax-ml/jax holding the tag jax-v<version> "
                    "(default: a shallow clone from GitHub)")
    ap.add_argument("--jax-url", default=JAX_URL, help="where to clone jax from (default: %(default)s)")
    ap.add_argument("--jax-tests", help="a directory holding the test files instead")
    ap.add_argument("--ref", help="the git ref to read (default jax-v<installed version>)")
    ap.add_argument("--files", nargs="+", default=list(DEFAULT_FILES),
                    help=f"test files under tests/ (default: {' '.join(DEFAULT_FILES)})")
    ap.add_argument("-k", dest="keyword", help="passed to pytest -k")
    ap.add_argument("--keep", help="write the swapped files here (and keep them) instead of a "
                    "temporary directory")
    ap.add_argument("--json", help="write every test's outcome and swap record here")
    args = ap.parse_args(argv)

    version = jax_version()
    ref = args.ref or f"jax-v{version}"
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="jax_psum_suite_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        texts = read_tests(args.files, ref, args.jax_git, args.jax_tests, work, args.jax_url)
        kept_by_file, names_psum = {}, {}
        for name, text in texts.items():
            text, n = swap(text)
            text, kept, named = select(text)
            (work / name).write_text(text)
            kept_by_file[name] = kept
            names_psum.update({f"{name}::{k}": v for k, v in named.items()})
            print(f"{name}: {n} lax.psum references swapped; {len(kept)} test methods call it")
        shutil.copy(Path(__file__).with_name("jax_psum_swap.py"), work / f"{SWAP_MODULE}.py")
        (work / "conftest.py").write_text(CONFTEST)
        (work / "pytest.ini").write_text(PYTEST_INI)

        log, junit = work / "swap_log.jsonl", work / "junit.xml"
        log.unlink(missing_ok=True)
        env = dict(os.environ, SIFAR_SWAP_LOG=str(log), JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(work)]))
        env.setdefault("SIFAR_TIMEOUT_S", "30")  # 8 ranks on a few shared cores
        env.setdefault("SIFAR_JAX_NO_COMPILE_CACHE", "1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}", "-o", "junit_family=xunit1", *args.files]
        if args.keyword:
            cmd += ["-k", args.keyword]
        print("running:", " ".join(cmd), f"(in {work})", flush=True)
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        tail = proc.stdout.strip().splitlines()[-3:]
        if not junit.exists():
            print(proc.stdout[-4000:], proc.stderr[-4000:])
            return 1
        return report(parse_junit(junit), log, kept_by_file, names_psum, version, ref, tail,
                      args.json)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def report(cases, log: Path, kept_by_file, names_psum, version, ref, tail, json_path) -> int:
    records = {}
    if log.exists():
        for line in log.read_text().splitlines():
            r = json.loads(line)
            file, _, rest = r["test"].partition("::")
            records[file.removesuffix(".py") + "." + rest.replace("::", ".")] = r
    for c in cases:
        c["swap"] = records.get(c["id"], {})
    called = [c for c in cases if c["swap"].get("swapped_calls", 0) > 0]
    import sifar_jax  # noqa: PLC0415 - only to say which one ran

    def counts(group) -> str:
        n = collections.Counter(c["outcome"] for c in group)
        return (f"{len(group)} tests: " +
                ", ".join(f"{n[k]} {k}" for k in ("passed", "failed", "error", "skipped")))

    print(f"\njax {version} (tests at {ref}), sifar_jax from {Path(sifar_jax.__file__).parent}")
    print("pytest:", " / ".join(tail[-1:]))
    print("collected:", counts(cases))
    print("called the swapped psum:", counts(called))
    served = fell_back = local = 0
    reasons: collections.Counter = collections.Counter()
    for c in called:
        r = c["swap"]
        if c["outcome"] != "passed":
            continue
        if r.get("sifar_ran", 0) > 0 or r.get("sifar_traced", 0) > 0:
            served += 1
        elif r.get("fallbacks"):
            fell_back += 1
            reasons.update(r["fallbacks"])
        else:
            local += 1
    print(f"of those passing: sifar summed in {served}; every call fell back to lax.psum in "
          f"{fell_back}; lax.psum with no communication to do in {local} (vmap axes, axes of "
          f"one device, constants, an unbound axis's error, axes not manual here)")
    for reason, n in reasons.most_common():
        print(f"  {n:4d} x {reason}")
    guessed = [c["name"] for c in cases if c["swap"].get("guessed_meshes")]
    if guessed:
        print(f"meshes guessed from the abstract mesh in {len(guessed)} tests")
    unexpected = 0
    for c in cases:
        if c["outcome"] in ("failed", "error"):
            file = next((f for f in kept_by_file if c["id"].startswith(f[:-3] + ".")), "")
            base = base_name(c["id"], kept_by_file.get(file, []))
            if c["id"] in EXPECTED:
                mark = f"expected: {EXPECTED[c['id']]}"
            else:
                unexpected += 1
                mark = ("names psum" if names_psum.get(f"{file}::{base}", False)
                        else "UNEXPECTED")
            print(f"  {c['outcome'].upper():6s} {c['id']}: {c['message']}\n"
                  f"         [{mark}]")
    for test in EXPECTED:
        hit = [c for c in cases if c["id"] == test]
        if hit and hit[0]["outcome"] == "passed":
            print(f"  now passes (was expected to fail): {test}")
    if json_path:
        Path(json_path).write_text(json.dumps(cases, indent=1))
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
