"""The dsv4-ort command line, through subprocess as a user runs it."""

import json
import os
import subprocess
import sys

import pytest


def dsv4(*args, env=None):
    exe = os.path.join(os.path.dirname(sys.executable), "dsv4-ort")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **(env or {})))


def test_info():
    r = dsv4("info")
    assert r.returncode == 0, r.stderr
    assert "onnxruntime" in r.stdout and "isa:" in r.stdout and "moe_routing" in r.stdout


def test_info_json_and_isa_cap():
    r = dsv4("info", "--json", "--isa", "scalar")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["isa"] == "scalar" and set(info["families"].values()) == {"scalar"}


def test_env_cap_and_invalid_env():
    r = dsv4("info", "--json", env={"DSV4_ORT_ISA": "avx2"})
    assert r.returncode == 0 and json.loads(r.stdout)["isa"] in ("scalar", "avx2")
    r = dsv4("info", env={"DSV4_ORT_ISA": "neon"})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "DSV4_ORT_ISA='neon'" in r.stderr and "scalar, avx2, avx512, amx" in r.stderr


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    return {"DSV4_ORT_CACHE": str(tmp_path_factory.mktemp("cache"))}


def test_run_exports_once_then_reuses(cache_env):
    r = dsv4("run", env=cache_env)
    assert r.returncode == 0, r.stderr
    assert "exporting the built-in tiny model" in r.stderr
    assert "generated ids: [" in r.stdout and "tokens/s" in r.stdout and "isa: " in r.stdout
    again = dsv4("run", "--isa", "scalar", env=cache_env)
    assert again.returncode == 0, again.stderr
    assert "exporting" not in again.stderr and "isa: scalar" in again.stdout
    ids = lambda out: [line for line in out.splitlines() if line.startswith("generated ids")]  # noqa: E731
    assert ids(r.stdout) == ids(again.stdout)  # greedy, deterministic, same at every ISA level


def test_export_and_generate(tmp_path, cache_env):
    out = tmp_path / "m"
    r = dsv4("export", "--preset", "tiny", str(out), "--quiet", "--max-seq-len", "128")
    assert r.returncode == 0, r.stderr
    g = dsv4("generate", str(out), "--ids", "0,5,7", "--max-new-tokens", "6", "--quiet")
    assert g.returncode == 0, g.stderr
    assert len(g.stdout.split()) == 6
    s1 = dsv4("generate", str(out), "--ids", "0,5,7", "--max-new-tokens", "6", "--temperature", "1", "--seed", "3")
    s2 = dsv4("generate", str(out), "--ids", "0,5,7", "--max-new-tokens", "6", "--temperature", "1", "--seed", "3")
    assert s1.returncode == 0 and s1.stdout == s2.stdout
    bad = dsv4("generate", str(out), "--ids", "0,999999")
    assert bad.returncode == 2 and "outside the vocabulary" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    nomodel = dsv4("generate", str(tmp_path / "missing"), "--ids", "1")
    assert nomodel.returncode == 2 and "does not exist" in nomodel.stderr
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "model.onnx").write_bytes(b"\0garbage")
    (tmp_path / "corrupt" / "dsv4_ort.json").write_text((out / "dsv4_ort.json").read_text())
    corrupt = dsv4("generate", str(tmp_path / "corrupt"), "--ids", "1")
    assert corrupt.returncode == 2 and len(corrupt.stderr.strip().splitlines()) == 1
    notext = dsv4("generate", str(out), "--prompt", "hello")
    assert notext.returncode == 2 and "tokenizer" in notext.stderr


@pytest.mark.parametrize("args", [["bogus"], ["run", "--isa", "sse9"], ["info", "--unknown"], [],
                                  ["generate", "x"], ["generate", "x", "--ids", "1", "--prompt", "a"],
                                  ["generate", "x", "--ids", "a,b"], ["export"], ["run", "--checkpoint", "/nonexistent"]])
def test_bad_arguments_exit_2(args):
    r = dsv4(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
