"""`sifar_jax.info()` and `python -m sifar_jax.info` (issue 26, item 2) on
XLA:CPU host devices: the report runs, holds what a bug report needs, and
agrees with the library's own answers."""

from __future__ import annotations

import io
import os
import pathlib
import subprocess
import sys

import sifar_jax
from sifar_jax import multicast
from sifar_jax.info import format_info  # sifar_jax.info itself is the function

ROOT = pathlib.Path(__file__).resolve().parents[2]
KEYS = {"versions", "build", "devices", "gpus", "peer_access", "multicast", "communicators",
        "fallback_axes"}


def test_info_reports_the_build_versions_and_devices():
    out = io.StringIO()
    d = sifar_jax.info(file=out)
    assert set(d) == KEYS
    assert d["build"]["backends"] == sifar_jax.build_info()["backends"]
    assert d["versions"]["sifar_jax"] == sifar_jax.__version__
    import jax

    assert d["versions"]["jax"] == jax.__version__
    assert sum(k["count"] for k in d["devices"]["kinds"]) == len(jax.devices())
    if jax.default_backend() == "cpu":
        assert d["gpus"] == [] and d["peer_access"] == "n/a (no CUDA GPUs)"
    text = out.getvalue()
    for title in ("versions:", "build:", "devices:", "peer access:", "multicast:",
                  "communicators:"):
        assert title in text, text


def test_info_quiet_prints_nothing(capsys):
    sifar_jax.info(quiet=True)
    assert capsys.readouterr().out == ""
    sifar_jax.info()
    assert "build:" in capsys.readouterr().out


def test_info_lists_each_communicators_workspace(cpu_mesh):
    mesh = cpu_mesh(shape=(2, 4), axis_names=("dp", "tp"), init=False)
    sifar_jax.init(mesh, slot_bytes=8192, products=())  # the axes' own (products: init's default)
    d = sifar_jax.info(quiet=True)
    by_axis = {c["axis"]: c for c in d["communicators"]}
    assert set(by_axis) == {"dp", "tp"}
    for c in sifar_jax.communicators():
        got = by_axis[c.axis_name]
        assert got["ranks"] == c.nranks and got["lanes"] == c.lanes
        assert got["slot_bytes"] == 8192
        want = sifar_jax.workspace_bytes(8192, c.nranks, c.lanes)
        assert got["workspace_bytes_per_device"] == want
        assert got["workspace_bytes_total"] == want * 8  # every device, once per axis
    assert by_axis["tp"]["devices"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    text = format_info(d)
    assert "axis 'tp'" in text and "8192 B, 4 lanes" in text, text


def test_info_reports_the_multicast_guard(monkeypatch):
    for var in (multicast.ENABLE_VAR, *multicast.DISABLING):
        monkeypatch.delenv(var, raising=False)
    d = sifar_jax.info(quiet=True)["multicast"]
    assert d["allowed"] is False and d["refusal"] == multicast.refusal()
    assert d["opt_in"] == multicast.ENABLE_VAR and d["set_in_environment"] == {}
    var, off = next(iter(multicast.DISABLING.items()))
    monkeypatch.setenv(var, str(off))
    d = sifar_jax.info(quiet=True)["multicast"]
    assert d["allowed"] is False and d["set_in_environment"] == {var: str(off)}


def test_cli_exits_0_and_prints_the_report():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "sifar_jax.info"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "build:" in r.stdout and "peer access:" in r.stdout and "2 x cpu" in r.stdout, r.stdout
    assert "RuntimeWarning" not in r.stderr, r.stderr  # runpy: imported twice
