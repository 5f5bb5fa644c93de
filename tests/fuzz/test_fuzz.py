"""Malformed inputs through every op of the table (tests/fuzz/opfuzz.py): the regression corpus, a seeded random
batch, and the huge-dimension sweep. Each runs in subprocesses, so a crash or a hang fails the test with the case
that caused it instead of killing pytest. Under tests/sanitize.sh the same tests run against the ASan+UBSan build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import opfuzz

HERE = Path(__file__).resolve().parent
SANITIZED = "asan" in os.environ.get("LD_PRELOAD", "")
TIMEOUT = 1800 if SANITIZED else 600


def _run_lines(args, timeout=TIMEOUT) -> tuple:
    """Runs opfuzz.py with `args`; returns (returncode, parsed JSON lines, stderr)."""
    proc = subprocess.run([sys.executable, str(HERE / "opfuzz.py"), *args], capture_output=True, text=True,
                          timeout=timeout)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, lines, proc.stderr


def _check_lines(rc, lines, stderr, what):
    started = [d for d in lines if d.get("phase") == "start"]
    done = [d for d in lines if "outcome" in d]
    if rc != 0 or len(done) < len(started):
        last = started[-1] if started else None
        pytest.fail(f"{what}: the process died (exit {rc}) while running {last}:\n"
                    f"{opfuzz.report_excerpt(stderr)}")
    bad = [d for d in done if d["outcome"] not in (opfuzz.OK, opfuzz.REJECTED, opfuzz.SKIPPED)]
    assert not bad, "\n".join(f"{d['file']} ({d.get('isa')}): {d['outcome']}: {d['message']}" for d in bad)
    return done


def test_corpus_files_are_small_and_valid():
    files = sorted((HERE / "corpus").glob("*.json"))
    assert len(files) >= len(opfuzz.GENERATORS)
    ops = set()
    for f in files:
        assert f.stat().st_size < 8192, f"{f.name} is not a small file"
        d = json.loads(f.read_text())
        case = opfuzz.Case.from_json(d)
        assert d["expect"] in (opfuzz.OK, opfuzz.REJECTED)
        ops.add(case.op)
    assert ops == set(opfuzz.GENERATORS), f"ops without corpus cases: {set(opfuzz.GENERATORS) - ops}"


def test_corpus_replays_with_the_recorded_outcome_at_every_isa_level():
    """Every saved case at every ISA level of this CPU: a clean result or an error naming the op, the outcome
    recorded in the file (validation does not depend on the ISA level), never a crash or sanitizer report."""
    rc, lines, stderr = _run_lines(["--replay", str(HERE / "corpus"), "--all-isa"])
    done = _check_lines(rc, lines, stderr, "corpus replay")
    expect = {f.name: json.loads(f.read_text())["expect"] for f in (HERE / "corpus").glob("*.json")}
    wrong = [f"{d['file']} ({d['isa']}): expected {expect[d['file']]}, got {d['outcome']}: {d['message']}"
             for d in done if d["outcome"] != expect[d["file"]]]
    assert not wrong, "\n".join(wrong)
    assert {d["file"] for d in done} == set(expect)


def test_huge_dimensions_allocate_nothing_absurd():
    """Empty tensors carrying huge dimensions (2^40, INT64_MAX) that agree with each other across the inputs, for
    every op: clean outcomes, no allocation failure inside the library, and the process stays small. The worker runs
    under a 2 GiB address-space limit, so a buffer sized from such a dimension would fail or be visible."""
    rc, lines, stderr = _run_lines(["--huge-sweep", "--mem-limit-mb", "2048"])
    done = _check_lines(rc, lines, stderr, "huge-dimension sweep")
    assert len(done) > 200
    assert {d["op"] for d in done} == set(opfuzz.GENERATORS)
    if not SANITIZED:  # ASan's shadow memory and quarantine dominate its RSS
        peak_mb = next(d["peak_rss_kb"] for d in lines if "peak_rss_kb" in d) / 1024
        assert peak_mb < 1024, f"peak RSS {peak_mb:.0f} MiB"


def test_random_malformed_cases():
    """A seeded batch of random cases (all ops, all mutation kinds, every ISA level): no crash, hang, sanitizer
    report, library allocation failure, or error that does not name its op."""
    cases = 1800 if SANITIZED else 3600
    result = opfuzz.fuzz(cases, seed=20240, jobs=2, hang_timeout=300 if SANITIZED else 60, log=lambda *_: None)
    for f in result["failures"]:
        pytest.fail(f"case {f['index']} of seed 20240 ({f['op']}, {f['kind']}, mutations {f['tags']}); reproduce "
                    f"with `python tests/fuzz/opfuzz.py --seed 20240 --start {f['index']} --cases 1 "
                    f"--save-crashes DIR`:\n{f['report']}")
    counts = {op: c for op, c in result["counts"].items()}
    bad = {op: {k: v for k, v in c.items() if k in (opfuzz.UNNAMED, opfuzz.OOM)} for op, c in counts.items()}
    assert not any(bad.values()), (bad, {k: v for k, v in result["samples"].items()
                                         if opfuzz.UNNAMED in k or opfuzz.OOM in k})
    assert set(counts) == set(opfuzz.GENERATORS)
    for op, c in counts.items():  # the mutations leave a share of cases that run, and reject others
        assert c.get(opfuzz.OK, 0) > 0 and c.get(opfuzz.REJECTED, 0) > 0, (op, c)
