"""Builds and runs the C++ kernel tests (every ISA variant vs the scalar reference, AMX through tile emulation).

The binary is configured without the ONNX Runtime headers (DSV4_BUILD_LIBRARY=OFF) in build/kernel-tests, reusing
earlier builds. Each C++ test becomes one pytest item.
"""

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BUILD = ROOT / "build" / "kernel-tests"


@functools.lru_cache(maxsize=None)
def kernel_test_binary() -> Path:
    # cmake and ninja come with the test extra (PyPI) into the environment's bin folder; else from the PATH.
    bindir = os.path.dirname(sys.executable)
    cmake_exe = shutil.which("cmake", path=bindir) or shutil.which("cmake")
    ninja = shutil.which("ninja", path=bindir) or shutil.which("ninja")
    if cmake_exe is None:
        raise RuntimeError("cmake not found: install the test extra (pip install '.[test]')")
    generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
    r = subprocess.run([cmake_exe, "-S", str(ROOT), "-B", str(BUILD), *generator, "-DCMAKE_BUILD_TYPE=Release",
                        "-DDSV4_BUILD_LIBRARY=OFF", "-DDSV4_BUILD_TESTS=ON"], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("configuring the kernel tests failed:\n" + r.stdout[-4000:] + r.stderr[-4000:])
    r = subprocess.run([cmake_exe, "--build", str(BUILD), "--target", "dsv4_kernel_tests", "-j", "2"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("building the kernel tests failed:\n" + r.stdout[-6000:] + r.stderr[-6000:])
    return BUILD / "tests" / "custom_ops" / "dsv4_kernel_tests"


def _list_tests():
    try:
        out = subprocess.run([str(kernel_test_binary()), "--list"], capture_output=True, text=True, check=True).stdout
    except Exception:  # test_kernel_build reports the failure
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def test_kernel_build():
    assert kernel_test_binary().exists()


@pytest.mark.parametrize("name", _list_tests())
def test_kernel(name):
    r = subprocess.run([str(kernel_test_binary()), "--exact", name], capture_output=True, text=True)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-4000:]
    assert "1 passed, 0 failed" in r.stdout
