"""examples/cpp (dsv4_generate, onnxruntime's C++ API) against the Python runtime on the tiny preset.

The example is configured and built into build/cpp-example, reusing earlier builds (the Debian packages are fetched
once into build/cpp-example/_deps). Its default build downloads Debian 13's libonnxruntime1.21 and libonnxruntime-dev
(and the runtime's dependencies) with apt-get; where that cannot happen (no apt-get, no access to the Debian archive)
the tests skip saying so, and only then.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from model_fixtures import random_ids, require_library

from dsv4_ort.runtime import Session

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "examples" / "cpp"
BUILD = ROOT / "build" / "cpp-example"
# examples/cpp/CMakeLists.txt starts its message with this when the Debian packages cannot be downloaded
UNAVAILABLE = "dsv4-example: Debian packages unavailable"
WHY_SKIP = "Debian's libonnxruntime1.21 cannot be obtained here"


def _tail(run: subprocess.CompletedProcess, n: int = 4000) -> str:
    return (run.stdout or "")[-n:] + (run.stderr or "")[-n:]


@pytest.fixture(scope="module")
def binary() -> Path:
    if shutil.which("apt-get") is None:
        pytest.skip(f"{WHY_SKIP}: apt-get not found (the example's default build downloads the package with "
                    "`apt-get download`; build it by hand with -DORT_ROOT=...)")
    bindir = os.path.dirname(sys.executable)  # cmake and ninja come with the test extra
    cmake = shutil.which("cmake", path=bindir) or shutil.which("cmake")
    ninja = shutil.which("ninja", path=bindir) or shutil.which("ninja")
    assert cmake is not None, "cmake not found: install the test extra (pip install '.[test]')"
    generator = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
    configure = subprocess.run([cmake, "-S", str(SOURCE), "-B", str(BUILD), *generator],
                               check=False, capture_output=True, text=True, timeout=600)
    if configure.returncode != 0:
        text = configure.stdout + configure.stderr
        if UNAVAILABLE in text:
            reason = " ".join(text[text.index(UNAVAILABLE) + len(UNAVAILABLE):].lstrip(": ").split())
            pytest.skip(f"{WHY_SKIP}: {reason[:600]}")
        pytest.fail("configuring examples/cpp failed:\n" + _tail(configure))
    build = subprocess.run([cmake, "--build", str(BUILD), "-j", "2"], check=False, capture_output=True, text=True,
                           timeout=600)
    assert build.returncode == 0, "building examples/cpp failed:\n" + _tail(build)
    path = BUILD / "dsv4_generate"
    assert path.is_file()
    return path


def generate(binary: Path, model_dir: Path, prompt, n: int, *extra: str) -> subprocess.CompletedProcess:
    """Runs the example with one intra-op thread (as the Python side here): stdout, stderr, exit status."""
    import dsv4_ort

    cmd = [str(binary), "--library", dsv4_ort.get_library_path(), "--threads", "1", "--max-new-tokens", str(n),
           *extra, str(model_dir), *map(str, prompt)]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)


def errors(run: subprocess.CompletedProcess) -> str:
    """stderr without the lines Debian's build of onnxruntime prints on every start: its shared libonnx registers the
    ONNX op schemas once more ("Schema error: Trying to register schema ... already registered"), harmless."""
    return "\n".join(line for line in run.stderr.splitlines() if line.strip() and not line.startswith("Schema error"))


def parse(run: subprocess.CompletedProcess) -> tuple[list, dict]:
    assert run.returncode == 0, run.stdout + errors(run)
    lines = run.stdout.splitlines()
    assert lines[0].startswith("tokens:"), run.stdout
    ids = [int(t) for t in lines[0].split()[1:]]
    speed = {}
    for line in lines[1:]:
        m = re.fullmatch(r"(prefill|decode): (\d+) tokens, ([\d.]+) ms, ([\d.]+) tokens/s", line)
        assert m, line
        speed[m[1]] = (int(m[2]), float(m[3]), float(m[4]))
    return ids, speed


@pytest.mark.parametrize("logits", ["last", "all"])
def test_greedy_ids_equal_the_python_runtime(binary, cache, logits):
    require_library()
    model = cache.export(("tiny",), logits=logits, max_seq_len=256).parent
    sess = Session(model, intra_op_threads=1)
    prompt = random_ids(sess.vocab_size, (13,), seed=31).tolist()  # 13 tokens: a compress boundary and a remainder
    ids, speed = parse(generate(binary, model, prompt, 40))
    assert ids == sess.generate(prompt, 40)
    assert speed["prefill"][0] == 13 and speed["decode"][0] == 39
    assert all(tps > 0 for _, _, tps in speed.values())


def test_single_token_prompt_and_zero_new_tokens(binary, cache):
    model = cache.export(("tiny",), logits="last", max_seq_len=256).parent
    sess = Session(model, intra_op_threads=1)
    assert parse(generate(binary, model, [7], 5))[0] == sess.generate([7], 5)
    assert parse(generate(binary, model, [7, 8], 0))[0] == []


def test_bad_input_and_mismatched_metadata_fail_with_a_message(binary, cache, tmp_path):
    model = cache.export(("tiny",), logits="last", max_seq_len=256).parent
    vocab = json.loads((model / "dsv4_ort.json").read_text())["config"]["vocab_size"]
    cases = [
        (generate(binary, model, [1, vocab], 4), f"token id {vocab} is outside the vocabulary"),
        (generate(binary, model, [1, 2], 255), "exceed the model's capacity of 256"),
        (generate(binary, model, ["x"], 4), "is not a non-negative integer"),
        (generate(binary, tmp_path, [1], 4), "cannot read"),
    ]
    # dsv4_ort.json of another export beside the graph
    other = tmp_path / "other"
    other.mkdir()
    for f in ("model.onnx", "model.onnx.data"):
        shutil.copy(model / f, other)
    meta = json.loads((model / "dsv4_ort.json").read_text())
    meta["export_id"] = "0" * 32
    (other / "dsv4_ort.json").write_text(json.dumps(meta))
    cases.append((generate(binary, other, [1], 4), "does not belong to this graph"))
    (other / "dsv4_ort.json").write_text(json.dumps(meta)[:-40])
    cases.append((generate(binary, other, [1], 4), "JSON error at byte"))
    for run, message in cases:
        assert run.returncode == 2 and run.stdout == "", run.stdout + errors(run)
        assert message in errors(run) and errors(run).startswith("dsv4_generate: "), errors(run)
