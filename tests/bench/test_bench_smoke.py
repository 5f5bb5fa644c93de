"""The benchmark suite's smoke mode end to end (tiny shapes, the tiny preset): it must run in seconds, write a
complete results file and summary, and the README generator must render from it. The numbers are not checked."""

import json
import os
import subprocess
import sys
import time

import pytest


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, DSV4_ORT_CACHE=str(tmp_path_factory.mktemp("cache")))
    t0 = time.monotonic()
    exe = os.path.join(os.path.dirname(sys.executable), "dsv4-ort")
    r = subprocess.run([exe, "bench", "--smoke", "--out", str(out), "--quiet"], capture_output=True, text=True,
                       timeout=240, env=env, cwd=out)
    return r, out, time.monotonic() - t0


def test_smoke_runs_and_writes_results(smoke_run):
    r, out, seconds = smoke_run
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "results.json").is_file() and (out / "summary.md").is_file()
    assert seconds < 120, f"smoke mode took {seconds:.0f} s"


def test_results_schema(smoke_run):
    from dsv4_ort.bench import SCHEMA
    from dsv4_ort.bench.report import SMALLEST, validate

    _, out, _ = smoke_run
    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == SCHEMA and results["mode"] == "smoke"
    assert validate(results) == []
    assert not results["errors"], results["errors"]
    # machine limits
    bw = results["machine"]["bandwidth"]["all_threads"]
    assert bw["best"] > 0 and len(bw["samples"]) >= 2
    # every op family measured at least once by dsv4-ort, with time, throughput and a roofline fraction
    ours = [k for k in results["kernels"] if k["impl"] == "dsv4-ort" and "time" in k]
    groups = {k["group"] for k in ours}
    assert {"Linear", "MoE experts", "Attention", "Indexer", "Compressor", "Norm / RoPE", "mHC",
            "MoE routing"} <= groups, groups
    for k in ours:
        assert k["time"]["median_s"] > 0 and k["gbs"] >= 0 and k["gflops"] >= 0
        assert k["level"] in results["conditions"]["isa_caps"] or k["level"] in ("scalar", "avx2", "avx512", "amx")
        assert k["roofline"]["bound"] in ("memory", "compute") and k["roofline"]["fraction"] > 0
    assert {k["phase"] for k in ours} == {"decode", "prefill"}
    # end to end: prefill and decode of the tiny model, with the bytes accounting of the decode step
    runs = [r for r in results["e2e"]["runs"] if r["impl"] == "dsv4-ort" and "time" in r]
    assert {r["kind"] for r in runs} == {"prefill", "decode"}
    # the smallest weight option's decode beside it, with its quality against native
    small = [r for r in results["e2e"]["runs"] if r["impl"] == SMALLEST and "time" in r]
    assert small and all(r["kind"] == "decode" and r["tokens_per_s"] > 0 for r in small)
    sm = results["e2e"]["smallest"]
    assert (sm["head"], sm["dense"]) == ("fp4", "fp4") and 0 < sm["quality"]["nmse"] < 1
    assert sm["accounting"][0]["bytes"]["per_token"] < results["e2e"]["accounting"][0]["bytes"]["per_token"]
    acc = results["e2e"]["accounting"]
    assert acc and acc[0]["bytes"]["total"] > 0 and acc[0]["roofline_tokens_per_s"] > 0
    # the step's time outside the kernels (profiler) and thread scaling from one thread up
    o = results["e2e"]["overhead"]
    assert o["kernels_us"] > 0 and o["step_wall_us"] > 0 and 0 <= o["in_run_overhead_fraction"] < 1
    assert o["ops_us"] and "SparseAttention" in o["ops_us"]
    scaling = results["e2e"]["scaling"]
    assert scaling[0]["threads"] == 1 and scaling[0]["decode_efficiency"] == 1.0
    assert all(r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0 for r in scaling)


def test_summary_and_readme_render(smoke_run, tmp_path):
    from dsv4_ort.bench import readme

    _, out, _ = smoke_run
    summary = (out / "summary.md").read_text()
    assert "## Machine roofs" in summary and "## Kernels: decode" in summary and "## End to end" in summary
    target = tmp_path / "README.md"
    target.write_text("# x\n\n## Layout\n\ntext\n")
    assert readme.main([str(out / "results.json"), "--readme", str(target)]) == 0
    text = target.read_text()
    assert readme.BEGIN in text and readme.END in text and text.index("## Performance") < text.index("## Layout")
    assert readme.main([str(out / "results.json"), "--readme", str(target), "--check"]) == 0
    # idempotent: a second run replaces the block in place
    assert readme.main([str(out / "results.json"), "--readme", str(target)]) == 0
    assert target.read_text() == text


def test_cli_registration():
    """``dsv4-ort bench`` parses through the module's add_parser, as dsv4_ort.cli registers it."""
    import argparse

    from dsv4_ort.bench import cli

    p = argparse.ArgumentParser()
    cli.add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["bench", "--quick", "--isa", "scalar,avx2", "--threads", "2", "--no-e2e", "--plot"])
    assert args.quick and args.isa == ["scalar", "avx2"] and args.threads == 2 and not args.e2e and args.plot
    assert args.func is cli.cmd_bench
