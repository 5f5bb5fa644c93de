"""`dsv4-ort serve` as a process: SIGTERM / SIGINT end running streams with an error event and exit 0; the
one-line errors of a missing extra and of bad arguments."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

for _mod in ("starlette", "uvicorn", "httpx"):
    pytest.importorskip(_mod, reason=f"the server tests need {_mod} (pip install 'dsv4-ort[serve,test]')")

import httpx  # noqa: E402
from model_fixtures import require_library  # noqa: E402
from serverutil import ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def model(cache):
    require_library()
    return cache.export(("tiny",), logits="last", max_seq_len=1024).parent


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_running_streams_with_an_error_and_exits_cleanly(model, sig):
    srv = ServerProcess(model, "--max-batch", "2")
    try:
        with httpx.Client(timeout=60) as c:
            body = {"prompt": [3, 4], "max_tokens": 1000, "stream": True, "ignore_eos": True}
            with c.stream("POST", srv.url + "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                assert next(ln for ln in lines if ln.startswith("data: ")).startswith('data: {"id"')
                srv.proc.send_signal(sig)
                rest = [ln for ln in lines if ln.startswith("data: ")]
        events = [json.loads(ln[6:]) for ln in rest if ln != "data: [DONE]"]
        assert rest[-1] == "data: [DONE]"
        assert "shutting down" in events[-1]["error"]["message"]
        assert events[-1]["error"]["type"] == "server_error"
        assert srv.proc.wait(timeout=60) == 0, "".join(srv.stderr)
        assert "stopped" in "".join(srv.stderr)
    finally:
        srv.stop()


@pytest.mark.parametrize("flag", [None, "--no-batch-invariant"])
def test_batch_invariant_by_default(model, flag):
    """The server opens its model batch-invariant up to --max-batch rows unless told not to (the ready line says)."""
    srv = ServerProcess(model, "--max-batch", "3", *([flag] if flag else []))
    try:
        assert ("batch-invariant" in srv.ready_line) == (flag is None), srv.ready_line
        with httpx.Client(timeout=60) as c:
            assert c.get(srv.url + "/health").status_code == 200
    finally:
        srv.stop()


def _cli(*args, code: str | None = None, timeout: float = 120):
    exe = [sys.executable, "-P", "-c", code or "import sys; from dsv4_ort.cli import main; sys.exit(main())"]
    return subprocess.run(exe + list(args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_missing_extra_is_a_one_line_error(model):
    # starlette made unimportable, as in an installation without the serve extra
    code = "import sys; sys.modules['starlette'] = None; from dsv4_ort.cli import main; sys.exit(main())"
    r = _cli("serve", str(model), code=code)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "serve extra" in r.stderr and "pip install" in r.stderr


@pytest.mark.parametrize("args, what", [(["--port", "70000"], "--port"), (["--max-batch", "0"], "--max-batch"),
                                        (["--prefill-chunk", "x"], "--prefill-chunk"),
                                        (["--max-queue", "-1"], "--max-queue"),
                                        (["--admission-window", "-5"], "--admission-window"),
                                        (["--admission-window", "nan"], "--admission-window")])
def test_bad_arguments(model, args, what):
    r = _cli("serve", str(model), *args)
    assert r.returncode == 2 and what in r.stderr and r.stderr.count("\n") == 1


def test_missing_model_dir(tmp_path):
    r = _cli("serve", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "does not exist" in r.stderr and r.stderr.count("\n") == 1


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    from dsv4_ort.export import export_model

    require_library()
    return export_model(None, tmp_path_factory.mktemp("serve-mtp") / "tiny", preset="tiny", max_seq_len=512,
                        mtp=True, progress=False).parent


def test_speculative_mtp_serves_the_plain_greedy_tokens(mtp_model):
    """`serve --speculative mtp`: batch-invariant over the verify rows (the ready line says both), a greedy
    completion is the plain greedy continuation, /metrics counts drafted and accepted tokens."""
    from dsv4_ort.runtime import Session

    prompt = [7, 8, 9, 10, 11]
    want = Session(mtp_model, intra_op_threads=1, batch_invariant=6).generate(prompt, 40)
    srv = ServerProcess(mtp_model, "--max-batch", "2", "--speculative", "mtp", "--num-draft", "2")
    try:
        assert "batch-invariant" in srv.ready_line and "speculative mtp k=2" in srv.ready_line, srv.ready_line
        with httpx.Client(timeout=120) as c:
            bodies = [{"prompt": prompt, "max_tokens": 40, "ignore_eos": True, "temperature": 0},
                      {"prompt": prompt[:3], "max_tokens": 25, "ignore_eos": True, "temperature": 0.9, "seed": 3}]
            out = [c.post(srv.url + "/v1/completions", json=b).json() for b in bodies]
            metrics = c.get(srv.url + "/metrics").text
        assert out[0]["usage"]["completion_tokens"] == 40 and out[1]["usage"]["completion_tokens"] == 25
        assert out[0]["choices"][0]["text"] == " ".join(map(str, want))  # no tokenizer: the text is the ids
        assert "dsv4_ort_spec_draft_tokens_total" in metrics and "dsv4_ort_spec_accepted_tokens_total" in metrics
    finally:
        srv.stop()


def test_speculative_needs_an_mtp_export(model):
    r = _cli("serve", str(model), "--speculative", "mtp")
    assert r.returncode == 2 and "no MTP graph" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    r = _cli("serve", str(model), "--speculative", "mtp", "--num-draft", "4")
    assert r.returncode == 2 and "num_draft must be <= 3" in r.stderr and r.stderr.count("\n") == 1, r.stderr


@pytest.fixture(scope="module")
def staged_model(tmp_path_factory, cache):
    """The tiny preset exported as one graph and in two pipeline stages (export --stages 2)."""
    from dsv4_ort.export import export_model

    require_library()
    ck = cache.checkpoint("tiny")
    root = tmp_path_factory.mktemp("serve-stages")
    one = export_model(ck, root / "one", logits="last", max_seq_len=256, progress=False).parent
    return one, export_model(ck, root / "staged", logits="last", max_seq_len=256, progress=False, stages=2).parent


def _greedy_completions(srv, prompts, max_tokens):
    """Greedy completions of ``prompts`` sent together (one thread each), as lists of token ids."""
    from concurrent.futures import ThreadPoolExecutor

    def one(p):
        with httpx.Client(timeout=120) as c:
            r = c.post(srv.url + "/v1/completions",
                       json={"prompt": p, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        return [int(t) for t in r.json()["choices"][0]["text"].split()]  # no tokenizer: the text is the ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_serve_pipeline_stages_in_process_and_on_ray(staged_model):
    """`serve` on a 2-stage export, its stages in the server's process and then as Ray actors (`--ray ADDRESS`
    of a Ray instance this test starts on loopback): requests decoding together get the single graph's greedy
    tokens, and the actors go away with the server."""
    ray = pytest.importorskip("ray", reason="the Ray backend needs ray (pip install 'dsv4-ort[cluster]')")
    from dsv4_ort.runtime import Session
    from dsv4_ort.runtime.pipeline import start_local_ray

    one, staged = staged_model
    prompts = [[7, 8, 9, 10, 11], [3, 4], [12, 13, 14]]
    sess = Session(one, intra_op_threads=1, batch_invariant=4)
    want = [sess.generate(p, 12) for p in prompts]

    srv = ServerProcess(staged, "--max-batch", "4")
    try:
        assert _greedy_completions(srv, prompts, 12) == want
    finally:
        assert srv.stop() == 0

    if ray.is_initialized():
        ray.shutdown()
    start_local_ray(3, object_store_memory=128 << 20)
    try:
        address = ray.get_runtime_context().gcs_address
        srv = ServerProcess(staged, "--max-batch", "4", "--ray", address)
        try:
            with httpx.Client(timeout=30) as c:
                assert c.get(srv.url + "/health").status_code == 200
            assert _greedy_completions(srv, prompts, 12) == want
            assert ray.available_resources().get("CPU", 0) == 1  # one actor per stage, a CPU each
        finally:
            assert srv.stop() == 0
        deadline = time.monotonic() + 30
        while ray.available_resources().get("CPU", 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ray.available_resources().get("CPU", 0) == 3
    finally:
        ray.shutdown()
