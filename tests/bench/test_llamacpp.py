"""The optional llama.cpp baseline: discovery and llama-bench's JSON, with a stand-in llama-bench (the real one is
used by `dsv4-ort bench` when the machine has it)."""

import json
import stat

import pytest

from dsv4_ort.bench import llamacpp

ROWS = [
    {"build_commit": "abc123", "n_prompt": 128, "n_gen": 0, "n_depth": 256, "avg_ts": 95.5, "stddev_ts": 1.5},
    {"build_commit": "abc123", "n_prompt": 0, "n_gen": 16, "n_depth": 256, "avg_ts": 22.8, "stddev_ts": 0.3},
]


@pytest.fixture
def fake_bench(tmp_path, monkeypatch):
    exe = tmp_path / "llama-bench"
    log = tmp_path / "argv.json"
    exe.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {log}\ncat <<'EOF'\n{json.dumps(ROWS)}\nEOF\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("DSV4_ORT_LLAMA_BENCH", str(exe))
    return exe, log


def test_not_available_without_tools(monkeypatch, tmp_path):
    monkeypatch.delenv("DSV4_ORT_LLAMA_BENCH", raising=False)
    monkeypatch.delenv("DSV4_ORT_LLAMA_CPP", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert "llama-bench not found" in llamacpp.available()


def test_converter_dir_is_required(fake_bench, monkeypatch, tmp_path):
    monkeypatch.setenv("DSV4_ORT_LLAMA_CPP", str(tmp_path))  # no convert_hf_to_gguf.py there
    assert "converter not found" in llamacpp.available()
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    assert llamacpp.available() is None


def test_run_bench_parses_prefill_and_decode(fake_bench, tmp_path):
    exe, log = fake_bench
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    r = llamacpp.run_bench(gguf, threads=2, prompt=128, gen=16, depth=256, repetitions=2)
    assert r["prefill_tokens_per_s"] == 95.5 and r["prefill_tokens"] == 128
    assert r["decode_tokens_per_s"] == 22.8 and r["decode_steps"] == 16
    assert r["gguf_bytes"] == 64 and r["build"] == "abc123"
    argv = log.read_text().split()
    assert argv[argv.index("-t") + 1] == "2" and argv[argv.index("-d") + 1] == "256"
    assert argv[argv.index("-o") + 1] == "json"


def test_failing_llama_bench_is_an_error_naming_it(tmp_path, monkeypatch):
    exe = tmp_path / "llama-bench"
    exe.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    exe.chmod(0o755)
    monkeypatch.setenv("DSV4_ORT_LLAMA_BENCH", str(exe))
    with pytest.raises(RuntimeError, match="llama-bench failed: error: failed to load model"):
        llamacpp.run_bench(tmp_path / "m.gguf", threads=1)
