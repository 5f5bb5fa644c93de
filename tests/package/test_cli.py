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


def test_run():
    r = dsv4("run", "--tokens", "4")
    assert r.returncode == 0, r.stderr
    assert "ISA level" in r.stdout and "HcPre" in r.stdout and "MoeRouteTopK" in r.stdout


@pytest.mark.parametrize("args", [["bogus"], ["run", "--isa", "sse9"], ["info", "--unknown"], []])
def test_bad_arguments_exit_2(args):
    r = dsv4(*args)
    assert r.returncode == 2
