"""Every onnxruntime the package admits runs exported models: the oldest admitted release, one from the middle (the
last before onnxruntime fixed its shape-inference context for absent optional inputs), the first release after that
fix (the first on which the library registers its shape-inference function) and a current one each load
the tiny preset, generate the same greedy tokens as the installed onnxruntime, match its logits, and give the same
logits from four threads on one Session as from sequential runs (before 1.30 an IOBinding keeps no reference to
the numpy buffers it was given, so every buffer bound for a run must be kept alive by the runtime itself).

Each release is installed once into build/ort-compat/<version> (pip, no dependencies) and run in a subprocess with
it first on the path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from model_fixtures import random_ids, rel_err, require_library
from testutil import onnxruntime_release

from dsv4_ort.runtime import Session

RELEASES = ["1.21.1", "1.23.2", "1.24.1", "1.26.0"]

_SCRIPT = textwrap.dedent("""
    import json, sys, threading
    import numpy as np
    import onnxruntime
    from dsv4_ort.runtime import Session

    model, ids_path, out_path = sys.argv[1:4]
    ids = np.load(ids_path)
    sess = Session(model, intra_op_threads=1)

    def drive(prompt, steps=12):
        state = sess.new_state(1)
        logits = sess.forward(prompt, state)
        rows, toks = [logits[0, -1]], []
        for _ in range(steps):
            toks.append(int(rows[-1].argmax()))
            logits = sess.forward(np.array([[toks[-1]]], np.int64), state)
            rows.append(logits[0, -1])
        return np.stack(rows), toks

    prompts = [np.ascontiguousarray(ids[i:i + 1, : 8 + 9 * i]) for i in range(4)]
    sequential = [drive(p) for p in prompts]
    concurrent = [None] * 4
    errors = []

    def worker(i):
        try:
            concurrent[i] = drive(prompts[i])
        except BaseException as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.save(out_path, np.stack([s[0] for s in sequential]))
    print(json.dumps({"version": onnxruntime.__version__, "tokens": [s[1] for s in sequential], "errors": errors,
                      "threads_equal": not errors and all(np.array_equal(a[0], b[0]) and a[1] == b[1]
                                                          for a, b in zip(sequential, concurrent))}))
""")


@pytest.fixture(scope="module")
def tiny(cache):
    require_library()
    return cache.export(("tiny",), logits="all", max_seq_len=256).parent


def _run(version: str | None, model: Path, ids_path: Path, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if version is not None:
        deps = Path(sys.modules["numpy"].__file__).parents[1]
        env["PYTHONPATH"] = f"{onnxruntime_release(version)}{os.pathsep}{deps}"
    r = subprocess.run([sys.executable, "-P", "-c", _SCRIPT, str(model), str(ids_path), str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, f"onnxruntime {version}: status {r.returncode}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def installed(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("ort-installed")
    ids = random_ids(Session(tiny).vocab_size, (4, 40), seed=3)
    np.save(d / "ids.npy", ids)
    return d / "ids.npy", _run(None, tiny, d / "ids.npy", d / "logits.npy"), np.load(d / "logits.npy")


@pytest.mark.parametrize("version", RELEASES)
def test_release_runs_exported_model(version, tiny, installed, tmp_path):
    ids_path, ref, ref_logits = installed
    got = _run(version, tiny, ids_path, tmp_path / "logits.npy")
    assert got["version"] == version
    assert got["tokens"] == ref["tokens"], version
    assert rel_err(np.load(tmp_path / "logits.npy"), ref_logits) < 1e-5, version
    assert got["threads_equal"], (version, got["errors"])


def test_too_old_release_is_named_by_session_and_info(tiny):
    """onnxruntime 1.20 (C API 20) is not admitted: Session and `dsv4-ort info` say so in one line."""
    deps = Path(sys.modules["numpy"].__file__).parents[1]
    env = dict(os.environ, PYTHONPATH=f"{onnxruntime_release('1.20.1')}{os.pathsep}{deps}")
    code = ("import sys\nfrom dsv4_ort.runtime import Session\ntry:\n    Session(sys.argv[1])\n"
            "except RuntimeError as e:\n    print(e)\n    sys.exit(2)\n")
    r = subprocess.run([sys.executable, "-P", "-c", code, str(tiny)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 2 and "onnxruntime 1.20.1 is too old" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-P", "-m", "dsv4_ort.cli", "info"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 1 and "onnxruntime 1.20.1 is too old" in r.stderr, r.stdout + r.stderr  # environment
