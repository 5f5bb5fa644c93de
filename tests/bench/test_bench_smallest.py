"""bench/suite.py end to end with llama.cpp present: the smallest weight option is timed beside native and again after
llama.cpp's runs, and compared with llama.cpp only. llama.cpp itself is stood in for (``_run_llama`` returns fixed
records), so this runs in seconds without it; the tiny preset stands in for the bench preset."""

import json

from dsv4_ort.bench import llamacpp, report, suite


def test_smallest_option_runs_twice_around_llama_cpp(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_ORT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(llamacpp, "available", lambda: None)  # "found"

    def fake_llama(s, settings, threads, log):
        return [{"impl": name, "kind": "decode", "context": ctx, "batch": 1, "tokens_per_s": 100.0,
                 "time": {"median_s": 0.01, "n": 1}} for name in ("llama.cpp q8_0", "llama.cpp Q4_K_M")
                for ctx in settings["contexts"]]

    monkeypatch.setattr(suite, "_run_llama", fake_llama)
    suite.run("smoke", out_dir=tmp_path / "out", kernels=False, baselines=["llama"], log=lambda msg: None)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert not results["errors"], results["errors"]
    runs = results["e2e"]["runs"]
    order = [r["impl"] for r in runs if r.get("kind") == "decode"]
    # native, the smallest option, llama.cpp, then both of ours again, in that order
    firsts = [order.index(i) for i in ("dsv4-ort", report.SMALLEST, "llama.cpp q8_0", report.AGAIN,
                                       report.SMALLEST_AGAIN)]
    assert firsts == sorted(firsts), order
    rat = results["ratios"]["e2e"]
    small = [r for r in rat if r["ours"] == report.SMALLEST]
    assert {r["baseline"] for r in small} == {"llama.cpp q8_0", "llama.cpp Q4_K_M"}
    assert all("speedup_again" in r and r["speedup_again"] > 0 for r in small)
    sm = results["e2e"]["smallest"]
    assert sm["quality"]["steps"] == suite.QUALITY_TOKENS and sm["quality"]["top1_agreement"] <= 1.0
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "Speed-up of the smallest weight option" in text and "Smallest weight option: `dsv4-ort export" in text
