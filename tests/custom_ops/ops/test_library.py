"""Library hygiene: exports, linkage, ISA capping, compatibility with old and new onnxruntime releases."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dsv4_ort
from testutil import available_isa_levels, library_info, onnxruntime_release

ROOT = Path(__file__).resolve().parents[3]


def test_only_register_custom_ops_is_exported():
    nm = shutil.which("nm")
    if nm is None:
        pytest.fail("nm (binutils) is required for this test")
    out = subprocess.run([nm, "-D", "--defined-only", dsv4_ort.get_library_path()], capture_output=True, text=True,
                         check=True).stdout
    functions = [line.split()[-1] for line in out.splitlines() if line.split()[1] in ("T", "W", "i")]
    assert functions == ["RegisterCustomOps"], out


def test_does_not_link_onnxruntime():
    out = subprocess.run(["readelf", "-d", dsv4_ort.get_library_path()], capture_output=True, text=True,
                         check=True).stdout
    assert "onnxruntime" not in out
    assert "libgomp" not in out  # threads come from the ORT intra-op pool only


@pytest.mark.parametrize("level", ["scalar", "avx2", "avx512", "amx"])
def test_isa_cap(level):
    info = library_info(level)
    order = dsv4_ort.ISA_LEVELS
    expect = order[min(order.index(level), order.index(info["isa_max"]))]
    assert info["isa"] == expect
    for fam, chosen in info["families"].items():
        assert order.index(chosen) <= order.index(expect), fam


def test_scalar_cap_uses_reference_everywhere():
    assert set(library_info("scalar")["families"].values()) == {"scalar"}


def test_families_use_their_best_variant():
    info = library_info()
    if "avx512" in available_isa_levels():
        assert info["families"]["moe_routing"] == "avx512"
        assert info["families"]["hyper_connection"] == "avx512"


def test_family_levels_say_why():
    """A family below the session's level is there by the CPU policy or by DSV4_ORT_KERNELS, and says so."""
    info = library_info()
    order = dsv4_ort.ISA_LEVELS
    assert set(info["family_source"]) == set(info["families"])
    assert info["cpu"]["vendor"] and info["cpu"]["family"] > 0
    for fam, level in info["families"].items():
        if info["family_source"][fam] == "cap":
            # the best variant at or below the cap (families without one at the cap fall back)
            assert order.index(level) <= order.index(info["isa"]), fam
        else:
            assert info["family_source"][fam] in ("cpu", "forced"), fam


def test_forced_family_levels():
    top = library_info()["isa"]
    info = dsv4_ort.library_info(kernels="linear=scalar, indexer=amx")
    assert info["families"]["linear"] == "scalar" and info["family_source"]["linear"] == "forced"
    order = dsv4_ort.ISA_LEVELS
    assert order.index(info["families"]["indexer"]) <= order.index(top)  # clamped to the cap
    assert info["family_source"]["indexer"] == "forced"
    capped = dsv4_ort.library_info("scalar", kernels="linear=avx512")
    assert capped["families"]["linear"] == "scalar"  # DSV4_ORT_ISA stays the ceiling
    for bad, needle in (("linear", "not family=level"), ("lineer=avx2", "unknown kernel family 'lineer'"),
                        ("linear=avx3", "'avx3' (for linear) is not an ISA level")):
        with pytest.raises(ValueError, match="DSV4_ORT_KERNELS") as e:
            dsv4_ort.library_info(kernels=bad)
        assert needle in str(e.value)


# the CPU-chosen switches: DSV4_ORT_KERNELS name, library_info key, whether AMD family 0x19 turns it on
SWITCHES = [("prefetch", "weight_prefetch", False),  # the rows path's weight prefetch: off on Zen 4
            ("bf16dot", "bf16_dot", True)]  # bf16 SparseAttention products on VDPBF16PS: on on Zen 4


@pytest.mark.parametrize("name,key,on_zen", SWITCHES)
def test_cpu_switches_follow_the_cpu_and_can_be_forced(name, key, on_zen):
    """Each switch is the CPU policy's choice (the default elsewhere) unless DSV4_ORT_KERNELS forces it."""
    info = library_info()
    zen = info["cpu"]["vendor"] == "AuthenticAMD" and info["cpu"]["family"] == 0x19
    assert info[key] is (on_zen if zen else not on_zen)
    assert info[f"{key}_source"] == ("cpu" if zen else "cap")
    for value in ("on", "off"):
        forced = dsv4_ort.library_info(kernels=f"{name}={value}")
        assert forced[key] is (value == "on") and forced[f"{key}_source"] == "forced"
    with pytest.raises(ValueError, match=f"{name}='sometimes' is neither on nor off"):
        dsv4_ort.library_info(kernels=f"{name}=sometimes")


def test_invalid_isa_value_lists_valid_ones():
    with pytest.raises(Exception) as e:
        dsv4_ort.library_info("sse9")
    assert "DSV4_ORT_ISA='sse9'" in str(e.value)
    assert "scalar, avx2, avx512, amx" in str(e.value)


SCRIPT = """
import sys, numpy
sys.path.insert(0, sys.argv[1])
import onnxruntime as ort
so = ort.SessionOptions()
try:
    so.register_custom_ops_library(sys.argv[2])
except Exception as e:
    print("ERROR", e)
    sys.exit(3)
print("OK", ort.__version__)
"""


@pytest.mark.parametrize("version,ok", [("1.21.1", True), ("1.20.1", False)])
def test_other_onnxruntime_releases(version, ok, tmp_path):
    target = onnxruntime_release(version)
    deps = Path(sys.modules["numpy"].__file__).parents[1]
    env = dict(os.environ, PYTHONPATH=f"{target}{os.pathsep}{deps}")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(target), dsv4_ort.get_library_path()], capture_output=True,
                       text=True, env=env, cwd=tmp_path)
    if ok:
        assert r.returncode == 0 and f"OK {version}" in r.stdout, r.stdout + r.stderr
    else:
        assert r.returncode == 3, r.stdout + r.stderr
        assert "needs ONNX Runtime API version 21" in r.stdout, r.stdout
