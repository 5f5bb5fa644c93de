"""Helpers shared by the whole test suite: the tolerance table and what the built library reports."""

from __future__ import annotations

import functools

# One tolerance table for the whole suite (see README "Testing"). Indices (top-k, routing) are compared exactly,
# on inputs built to be tie-free.
TOLERANCES = {
    "float32": dict(rtol=1e-5, atol=1e-5),
    "float32_reduction": dict(rtol=1e-4, atol=1e-5),  # long reductions / iterative normalisation (Sinkhorn)
    "bfloat16": dict(rtol=1.6e-2, atol=1e-2),
}


def tol(kind: str) -> dict:
    return TOLERANCES[kind]


@functools.lru_cache(maxsize=None)
def library_info(isa: str | None = None) -> dict:
    import dsv4_ort

    return dsv4_ort.library_info(isa)


def available_isa_levels() -> list:
    """The levels to test: every level this CPU has, up to the DSV4_ORT_ISA cap when one is set."""
    import dsv4_ort

    top = library_info()["isa"]  # = isa_max unless DSV4_ORT_ISA caps it
    return list(dsv4_ort.ISA_LEVELS[: dsv4_ort.ISA_LEVELS.index(top) + 1])


def release(package: str, version: str, module: str | None = None):
    """Installs package==version (no dependencies) into a cached folder outside site-packages (build/compat/) and
    returns it; put it first on PYTHONPATH of a subprocess to run that release instead of the installed one."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    target = Path(__file__).resolve().parents[1] / "build" / "compat" / package / version
    if not (target / (module or package)).is_dir():
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        f"{package}=={version}"], check=True, timeout=600)
    return target


def onnxruntime_release(version: str):
    """:func:`release` of onnxruntime."""
    return release("onnxruntime", version)
