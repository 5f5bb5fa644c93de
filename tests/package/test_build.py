"""Build rules: where the ONNX Runtime headers come from, and what happens when they cannot be found."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def cmake_exe() -> str:
    exe = shutil.which("cmake", path=str(Path(sys.executable).parent)) or shutil.which("cmake")
    if exe is None:
        pytest.fail("cmake not found (it comes with the test extra)")
    return exe


def configure(tmp_path, *defs):
    """Configures the project; returns (exit status, all output with CMake's line wrapping removed)."""
    r = subprocess.run([cmake_exe(), "-S", str(ROOT), "-B", str(tmp_path / "b"), *defs], capture_output=True,
                       text=True, timeout=300)
    return r.returncode, " ".join((r.stdout + r.stderr).split())


def test_missing_header_dir_explains_how_to_provide_headers(tmp_path):
    rc, text = configure(tmp_path, f"-DORT_INCLUDE_DIR={tmp_path / 'nowhere'}")
    assert rc != 0
    assert "does not contain onnxruntime_c_api.h" in text
    assert "DSV4_ORT_HEADERS_DEB" in text and "ORT_INCLUDE_DIR" in text and "libonnxruntime-dev" in text


def test_wrong_package_hash_is_rejected(tmp_path):
    fake = tmp_path / "libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb"
    fake.write_bytes(b"!<arch>\nnot the package")
    rc, text = configure(tmp_path, f"-DDSV4_ORT_HEADERS_DEB={fake}")
    assert rc != 0 and "expected 14f7d959" in text


def test_old_headers_are_rejected(tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "onnxruntime_c_api.h").write_text("#define ORT_API_VERSION 16\n")
    (inc / "onnxruntime_cxx_api.h").write_text("\n")
    rc, text = configure(tmp_path, f"-DORT_INCLUDE_DIR={inc}")
    assert rc != 0 and "API version '16'" in text


def test_headers_are_not_committed_and_no_native_flags():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not [f for f in files if Path(f).name.startswith("onnxruntime_") and f.endswith(".h")]
    build_files = [ROOT / "CMakeLists.txt", ROOT / "custom_ops" / "CMakeLists.txt", ROOT / "pyproject.toml"]
    for f in build_files:
        text = f.read_text()
        assert "-march=native" not in text and "http://" not in text and "https://" not in text, f
