"""Shared test fixtures: the built library, ISA levels, tolerances, one-node ONNX models through onnxruntime."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from testutil import available_isa_levels, library_info


REPO = Path(__file__).resolve().parents[1]


def _stale_or_shadowed() -> str | None:
    """Why the dsv4_ort the tests would import is not this checkout's code, or None.

    The package is imported from the install (src layout: a checkout's root never shadows it). An install of other
    Python sources, or a custom-op library built before the checkout's C++ last changed, would test something else.
    """
    import dsv4_ort

    pkg = Path(dsv4_ort.__file__).resolve().parent
    src = REPO / "src" / "dsv4_ort"
    hint = "reinstall with `pip install '.[export,test]'`, or use the editable install of README's Development section"
    if pkg != src and src.is_dir():
        for f in sorted(src.rglob("*.py")):
            twin = pkg / f.relative_to(src)
            if not twin.is_file() or twin.read_bytes() != f.read_bytes():
                return f"dsv4_ort is imported from {pkg}, whose {f.relative_to(src)} differs from this checkout's; {hint}"
    if os.environ.get("DSV4_ORT_LIBRARY"):
        return None  # an explicit library (the sanitizer build, a C++ developer's build) is the one meant
    try:
        lib = Path(dsv4_ort.get_library_path())
    except FileNotFoundError as e:
        return f"{e}; {hint}"
    sources = [p for d in ("custom_ops", "src/dsv4_ort/export") for p in (REPO / d).rglob("*")
               if p.suffix in (".cc", ".h", ".inc", ".json", ".txt", ".lds")]
    newest = max(sources, key=lambda p: p.stat().st_mtime, default=None)
    if newest is not None and newest.stat().st_mtime > lib.stat().st_mtime + 1:
        return f"the custom-op library {lib} is older than {newest.relative_to(REPO)}; rebuild it: {hint}"
    return None


def pytest_configure(config):
    if os.environ.get("DSV4_ORT_SKIP_STALE_CHECK"):
        return
    import dsv4_ort

    rebuild = getattr(getattr(dsv4_ort, "__loader__", None), "rebuild", None)
    if callable(rebuild) and not os.environ.get("DSV4_ORT_LIBRARY"):
        _quietly(rebuild)  # an editable install (README, Development): bring the library up to date first


def _quietly(fn) -> None:
    """Runs fn with the process's stdout and stderr (the build's subprocesses included) in a file, shown on failure."""
    import sys
    import tempfile

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            fn()
        except BaseException:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    why = _stale_or_shadowed()
    if why:
        pytest.exit(f"dsv4_ort under test is not this checkout: {why}", returncode=4)


def pytest_report_header(config):
    try:
        info = library_info()
        return [f"dsv4_ort library: {info['library_path']}", f"ISA levels tested: {', '.join(available_isa_levels())}"]
    except Exception as e:  # the tests that need the library will fail with the reason
        return [f"dsv4_ort library unavailable: {e}"]


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The reference runs tiny tensors: extra torch threads only add synchronisation, which costs 10-100x on a
    2-core machine that onnxruntime's own pool is also using."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=available_isa_levels() if os.environ.get("DSV4_ORT_SKIP_LIBRARY") is None else [])
def isa(request):
    """Every ISA level this CPU supports (scalar, avx2, avx512, amx ...)."""
    return request.param


# Session-wide cache of random checkpoints, exports and reference models (tests/model_fixtures.py).
from model_fixtures import cache  # noqa: E402,F401
