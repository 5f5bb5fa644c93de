"""The whole end-to-end suite (tests/runtime) under DSV4_ORT_ISA=avx2 and =scalar: what a CPU without AVX512 (or
without AVX2) runs. The cap is read when a session registers the library, so the nested pytest sees only the capped
level everywhere: its report header must name it, and every test must pass."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from testutil import available_isa_levels

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("level", [lv for lv in ("avx2", "scalar") if lv in available_isa_levels()])
def test_runtime_suite_passes_under_the_cap(level, tmp_path):
    # -P: the source tree's dsv4_ort/ folder must not shadow the installed package.
    env = dict(os.environ, DSV4_ORT_ISA=level, DSV4_ORT_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-P", "-m", "pytest", "-p", "no:cacheprovider", "tests/runtime"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert f"ISA levels tested: {', '.join(available_isa_levels()[: available_isa_levels().index(level) + 1])}" \
        in out, out[:2000]
    summary = out.strip().splitlines()[-1]
    # known failures (xfail) are allowed; failures, errors and skips are not
    assert re.search(r"\d+ passed", summary) and not re.search(r"\b\d+ (failed|skipped|errors?)\b", summary), summary
