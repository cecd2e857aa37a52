"""algorithm="auto" chooses by size from measurements (sifar_jax.autotable).

* the built-in table is the one bench/results/allreduce-2xH200.json measured;
* lookups at bucket edges and per group size; where a table applies;
* a table file round trip, and the files it refuses;
* init(mesh, auto_table=PATH) and $SIFAR_AUTO_TABLE: auto runs the table's
  algorithm per payload, hands larger payloads to lax.psum without a warning,
  while a named algorithm still raises where it cannot serve;
* bench.allreduce --write-auto-table writes a valid table on the CPU demo (its
  numbers mean nothing there: the format and the rule are what is tested).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import sifar_jax
from bench import common
from sifar_jax import autotable, plan

REPO = common.REPO_ROOT
KB = 1024


@pytest.fixture
def fresh(monkeypatch):
    """No table given, $SIFAR_AUTO_TABLE unset and unread, warnings fresh."""
    monkeypatch.setattr(autotable, "_state", {"given": None, "env": None, "env_read": False})
    monkeypatch.delenv(autotable.ENV, raising=False)
    monkeypatch.setattr(plan, "warned", set())


def cpu_table(rows) -> autotable.Table:
    return autotable.Table("cpu", rows, source="test")


# ----------------------------------------------------------------- the table --
def test_builtin_table_is_what_was_measured_on_h200():
    data = json.loads((REPO / "bench/results/allreduce-2xH200.json").read_text())
    assert "H200" in data["env"]["device_kind"]
    rebuilt = autotable.from_records(data["records"], "cuda")
    assert rebuilt.rows == autotable.BUILTIN.rows
    # sifar beat lax.psum (and every other algorithm) at each measured size.
    jit = {(r["algorithm"], r["bytes"]): r["us_median"] for r in data["records"]
           if r["level"] == "jit" and r["tp"] == 2}
    for max_bytes, choice in autotable.BUILTIN.rows[2]:
        assert choice == "sifar" and jit[("sifar", max_bytes)] < jit[("lax.psum", max_bytes)]


def test_lookup_at_bucket_edges_and_group_sizes():
    t = autotable.BUILTIN
    for nbytes in (16, 4 * KB, 4 * KB + 16, 8 * KB, 40 * KB, 64 * KB):
        assert t.lookup(2, nbytes) == "sifar", nbytes
    # past the largest measured size the built-in table keeps the rule before tables (the
    # slot decides: nothing was measured there); a table from a sweep says lax.psum there
    assert t.lookup(2, 64 * KB + 16) is None and t.lookup(2, 64 << 20) is None
    swept = dataclasses.replace(t, past_last=autotable.PSUM)
    assert swept.lookup(2, 64 * KB + 16) == autotable.PSUM
    assert t.lookup(4, 4 * KB) is None and t.lookup(8, 64 * KB) is None  # not measured

    mixed = cpu_table({2: ((4 * KB, "oneshot"), (16 * KB, "sifar"), (64 * KB, "psum")),
                       4: ((16 * KB, "twoshot"),)})
    assert [mixed.lookup(2, b) for b in (16, 4 * KB, 4 * KB + 16, 16 * KB, 16 * KB + 16,
                                         64 * KB, 64 * KB + 16)] == [
        "oneshot", "oneshot", "sifar", "sifar", "psum", "psum", "psum"]
    assert mixed.lookup(4, 16 * KB) == "twoshot" and mixed.lookup(4, 16 * KB + 16) == "psum"
    assert mixed.lookup(8, 16) is None


def test_where_a_table_applies():
    t = autotable.BUILTIN
    assert t.applies_to("cuda", "NVIDIA H200") and t.applies_to("cuda", "NVIDIA H100 80GB HBM3")
    assert not t.applies_to("cuda", "NVIDIA A100-SXM4-80GB")
    assert not t.applies_to("cpu", "cpu")
    assert cpu_table({2: ((64, "sifar"),)}).applies_to("cpu", "cpu")


def test_file_round_trip_and_refusals(tmp_path):
    t = autotable.Table("cpu", {2: ((4 * KB, "sifar"), (64 * KB, "psum")), 8: ((KB, "oneshot"),)},
                        device_kinds=("cpu",), source="a test")
    path = autotable.write(t, tmp_path / "auto.json")
    assert autotable.load(path) == t
    kept = dataclasses.replace(t, past_last=None)
    assert autotable.load(autotable.write(kept, tmp_path / "kept.json")) == kept
    data = json.loads((tmp_path / "auto.json").read_text())
    assert data["schema"] == autotable.SCHEMA
    bad = {"schema": "nope"}
    for change, match in ((bad, "not an auto table"),
                          ({"platform": "tpu"}, "platform"),
                          ({"entries": []}, "no entries"),
                          ({"entries": [{"nranks": 2, "max_bytes": 64, "choice": "multicast"}]},
                           "chooses 'multicast'"),
                          ({"entries": [{"nranks": 2, "max_bytes": -1, "choice": "sifar"}]},
                           "positive integers")):
        (tmp_path / "bad.json").write_text(json.dumps({**data, **change}))
        with pytest.raises(ValueError, match=match):
            autotable.load(tmp_path / "bad.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        autotable.load(tmp_path / "bad.json")


def test_records_to_table_picks_the_fastest_and_psum_above_the_slot():
    def rec(alg, nbytes, us, level="jit", tp=2):
        return {"algorithm": alg, "level": level, "tp": tp, "bytes": nbytes, "us_median": us}

    records = [rec("sifar", 4 * KB, 3.0), rec("oneshot", 4 * KB, 2.0), rec("lax.psum", 4 * KB, 9.0),
               rec("sifar", 1 << 20, 30.0), rec("lax.psum", 1 << 20, 20.0),
               rec("sifar", 128 * KB, 4.0), rec("lax.psum", 128 * KB, 15.0),  # past the slot
               rec("sifar", 8 * KB, None), rec("lax.psum", 8 * KB, 9.0),  # sifar unresolved
               rec("multicast", 16 * KB, 0.1), rec("sifar", 16 * KB, 1.0, level="kernel"),
               rec("twoshot", 4 * KB, 5.0, tp=4), rec("lax.psum", 4 * KB, 4.0, tp=4)]
    t = autotable.from_records(records, "cpu")
    assert t.rows == {2: ((4 * KB, "oneshot"), (8 * KB, "psum"), (128 * KB, "psum"),
                          (1 << 20, "psum")),
                      4: ((4 * KB, "psum"),)}
    with pytest.raises(ValueError, match="no resolved"):
        autotable.from_records([rec("sifar", 4 * KB, None)], "cpu")


# ----------------------------------------------------------- auto in a trace --
def _sizes_fn(mesh, sizes, algorithm="auto"):
    """One float32 sifar_psum per size (bytes), in one jitted shard_map."""
    def body(*xs):
        return tuple(sifar_jax.sifar_psum(x[0], "tp", algorithm=algorithm)[None] for x in xs)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"),) * len(sizes),
                                 out_specs=(P("tp"),) * len(sizes)))


def _inputs(n, sizes):
    rng = np.random.default_rng(0)
    return [rng.integers(-8, 9, (n, b // 4)).astype(np.float32) for b in sizes]


def _calls() -> dict:
    return {name: s["calls"] for name, s in sifar_jax.stats().items()}


def test_init_auto_table_chooses_per_size_and_psum_is_not_a_warning(cpu_mesh, fresh, tmp_path):
    """A CPU table: oneshot up to 256 B, sifar up to 2 KB, lax.psum above (past
    its largest size), also above the 4 KB slot: no warning for any of it,
    and every sum exact. A named algorithm still raises past the slot."""
    path = autotable.write(cpu_table({2: ((256, "oneshot"), (2 * KB, "sifar"))}),
                           tmp_path / "auto.json")
    mesh = cpu_mesh(2, slot_bytes=4 * KB, init=False)
    sifar_jax.init(mesh, slot_bytes=4 * KB, auto_table=path)
    sizes = [64, 256, 272, 2 * KB, 2 * KB + 16, 16 * KB]
    xs = _inputs(2, sizes)
    before = _calls()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = jax.block_until_ready(_sizes_fn(mesh, sizes)(*xs))
    after = _calls()
    assert after["oneshot"] - before["oneshot"] == 2 * 2  # 64 and 256 bytes, on each rank
    assert after["sifar"] - before["sifar"] == 2 * 2  # 272 and 2048 bytes
    for out, x in zip(outs, xs):
        np.testing.assert_array_equal(np.asarray(out)[0], x.sum(0))
    with pytest.raises(ValueError, match=r"algorithm='sifar'.*exceeds the 4096-byte slot"):
        _sizes_fn(mesh, [16 * KB], "sifar").lower(*_inputs(2, [16 * KB]))


def test_table_choice_past_the_slot_is_quiet(cpu_mesh, fresh):
    """A table that gives a size to ours while the slot is too small: under
    "auto" lax.psum runs it without a warning (the reason is in
    allreduce_choice); a named algorithm still raises."""
    autotable.use(cpu_table({2: ((64 * KB, "sifar"),)}))
    mesh = cpu_mesh(2, slot_bytes=4 * KB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _sizes_fn(mesh, [8 * KB]).lower(*_inputs(2, [8 * KB]))
    choice = sifar_jax.allreduce_choice((8 * KB // 4,), np.float32, "tp")
    assert not choice.sifar and "exceeds the 4096-byte slot" in choice.reason, choice
    with pytest.raises(ValueError, match="exceeds the 4096-byte slot"):
        _sizes_fn(mesh, [8 * KB], "sifar").lower(*_inputs(2, [8 * KB]))


def test_env_table_and_vmap_and_fused_follow_it(cpu_mesh, fresh, tmp_path, monkeypatch):
    """$SIFAR_AUTO_TABLE: read at the first lookup. A vmapped call chooses by
    its stacked size; psum_add_rmsnorm hands a payload the table gives to
    lax.psum to the unfused composition, without a warning."""
    path = autotable.write(cpu_table({2: ((1 * KB, "sifar"),)}), tmp_path / "env.json")
    monkeypatch.setenv(autotable.ENV, str(path))
    mesh = cpu_mesh(2, slot_bytes=64 * KB)

    def body(x, r, w):
        v = x[0]  # (4, 64) float32: 256 B a row, 1 KB stacked
        small = jax.vmap(lambda u: sifar_jax.sifar_psum(u, "tp"))(v)
        big = jax.vmap(lambda u: sifar_jax.sifar_psum(u, "tp"))(jnp.tile(v, (1, 2)))  # 2 KB
        normed, res = sifar_jax.psum_add_rmsnorm(jnp.tile(v, (1, 2)), r, w, "tp", eps=1e-5)
        return small[None], big[None], normed[None], res[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()),
                              out_specs=(P("tp"),) * 4))
    x = _inputs(2, [1 * KB])[0].reshape(2, 4, 64)
    r, w = np.ones((4, 128), np.float32), np.ones(128, np.float32)
    before = _calls()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = f.lower(x, r, w).as_text()
        small, big, normed, res = jax.device_get(f(x, r, w))
    assert sifar_jax._ext.TARGETS.psum_add_rmsnorm not in text  # 4 KB: lax.psum's, unfused
    assert _calls()["sifar"] - before["sifar"] == 2  # the 1 KB stacked call only
    np.testing.assert_array_equal(small[0], x.sum(0))
    np.testing.assert_array_equal(big[0], np.tile(x.sum(0), (1, 2)))
    np.testing.assert_array_equal(res[0], r + np.tile(x.sum(0), (1, 2)))


def test_no_table_for_the_cpu_keeps_the_rule_before_tables(cpu_mesh, fresh):
    """The built-in table is the GPUs': on the CPU auto runs sifar up to the
    slot and hands larger payloads to lax.psum, quietly."""
    mesh = cpu_mesh(2, slot_bytes=4 * KB)
    assert autotable.table_for(sifar_jax.communicators("tp")[0]) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _sizes_fn(mesh, [8 * KB]).lower(*_inputs(2, [8 * KB]))
    assert sifar_jax.allreduce_choice((4 * KB // 4,), np.float32, "tp").sifar
    assert not sifar_jax.allreduce_choice((8 * KB // 4,), np.float32, "tp").sifar


# ----------------------------------------------------------------- the bench --
def test_bench_writes_a_table_init_loads(tmp_path, cpu_mesh, fresh):
    out = tmp_path / "out"
    path = tmp_path / "auto.json"
    cmd = [sys.executable, "-m", "bench.allreduce", "--quick", "--sizes", "4,8", "--peers", "none",
           "--no-trace", "--levels", "jit", "--algorithms", "sifar,oneshot,lax.psum",
           "--out", str(out), "--write-auto-table", str(path)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = autotable.load(path)
    assert table.platform == "cpu" and table.applies_to("cpu", jax.devices("cpu")[0].device_kind)
    (json_path,) = out.glob("allreduce-*.json")
    records = json.loads(json_path.read_text())["records"]
    # Each row: the fastest resolved median at that size, ours or lax.psum's.
    fastest = {}
    for rec in records:
        if rec["level"] == "jit" and rec["us_median"] is not None:
            key = (rec["tp"], rec["bytes"])
            if key not in fastest or rec["us_median"] < fastest[key][0]:
                fastest[key] = (rec["us_median"], rec["algorithm"])
    want = {}
    for (n, b), (_, alg) in sorted(fastest.items()):
        want.setdefault(n, []).append((b, "psum" if alg == "lax.psum" else alg))
    assert table.rows == {n: tuple(v) for n, v in want.items()}
    mesh = cpu_mesh(2, init=False)
    sifar_jax.init(mesh, auto_table=path)
    assert autotable.table_for(sifar_jax.communicators("tp")[0]) == table
