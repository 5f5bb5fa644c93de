"""bench/report.py: the speed-ups over llama.cpp, given as a range over our decode measured before and right after
its runs (the AGAIN records), and how the summary prints them."""
from dsv4_ort.bench import report


def _run(impl, tps, **kw):
    return {"impl": impl, "kind": "decode", "context": 256, "batch": 1, "tokens_per_s": tps,
            "time": {"median_s": 1.0 / tps}, **kw}


def test_speedup_over_llama_cpp_is_a_range_over_both_of_our_runs():
    runs = [_run("dsv4-ort", 30.0, isa_cap="avx512"), _run("llama.cpp q8_0", 25.0), _run("torch_fp32", 3.0),
            _run(report.AGAIN, 36.0, isa_cap="avx512")]
    rat = report.ratios({"e2e": {"runs": runs}})["e2e"]
    by = {r["baseline"]: r for r in rat}
    assert set(by) == {"llama.cpp q8_0", "torch_fp32"}  # our second run is no baseline
    assert abs(by["llama.cpp q8_0"]["speedup"] - 1.2) < 1e-12
    assert abs(by["llama.cpp q8_0"]["speedup_again"] - 1.44) < 1e-12
    assert "speedup_again" not in by["torch_fp32"]
    text = "\n".join(report.e2e_md({"e2e": {"runs": runs}, "ratios": {"e2e": rat}}))
    assert "llama.cpp q8_0 decode ctx 256 b1 x1.20 / x1.44" in text
    assert report.AGAIN in text  # its own column in the decode table


def test_the_second_run_is_no_prefill_column():
    runs = [_run("dsv4-ort", 30.0), _run("llama.cpp q8_0", 25.0), _run(report.AGAIN, 36.0),
            {"impl": "dsv4-ort", "kind": "prefill", "tokens": 128, "batch": 1, "tokens_per_s": 140.0,
             "time": {"median_s": 0.9}}]
    lines = report.e2e_md({"e2e": {"runs": runs}})
    prefill_header = next(line for line in lines if line.startswith("| prompt tokens"))
    decode_header = next(line for line in lines if line.startswith("| context"))
    assert report.AGAIN not in prefill_header and report.AGAIN in decode_header


def test_without_a_second_run_the_speedup_is_one_figure():
    runs = [_run("dsv4-ort", 30.0), _run("llama.cpp q8_0", 25.0)]
    rat = report.ratios({"e2e": {"runs": runs}})["e2e"]
    text = "\n".join(report.e2e_md({"e2e": {"runs": runs}, "ratios": {"e2e": rat}}))
    assert "x1.20" in text and " / x" not in text and "before / after" not in text


def test_the_smallest_weight_option_is_compared_with_llama_cpp_only():
    runs = [_run("dsv4-ort", 30.0), _run("llama.cpp Q4_K_M", 40.0), _run("torch_fp32", 3.0),
            _run(report.SMALLEST, 50.0), _run(report.SMALLEST_AGAIN, 44.0), _run(report.AGAIN, 32.0)]
    rat = report.ratios({"e2e": {"runs": runs}})["e2e"]
    small = [r for r in rat if r["ours"] == report.SMALLEST]
    assert [r["baseline"] for r in small] == ["llama.cpp Q4_K_M"]  # not torch: a different model's quality
    assert abs(small[0]["speedup"] - 1.25) < 1e-12 and abs(small[0]["speedup_again"] - 1.1) < 1e-12
    native = {r["baseline"]: r for r in rat if r["ours"] == "dsv4-ort"}
    assert set(native) == {"llama.cpp Q4_K_M", "torch_fp32"}  # neither of the smallest option's runs is a baseline
    assert abs(native["llama.cpp Q4_K_M"]["speedup_again"] - 0.8) < 1e-12
    e2e = {"runs": runs, "smallest": {"head": "fp4", "dense": "fp4", "weight_bytes": 9e8,
                                      "quality": {"nmse": 0.18, "top1_agreement": 0.25, "steps": 32},
                                      "accounting": [{"context": 256, "bytes": {"per_token": 4.3e8}}]}}
    text = "\n".join(report.e2e_md({"e2e": e2e, "ratios": {"e2e": rat}}))
    assert f"Speed-up of the smallest weight option (`{report.SMALLEST}`): llama.cpp Q4_K_M decode ctx 256 b1 " \
           "x1.25 / x1.10" in text
    assert "--head fp4 --dense fp4` (0.90 GB, 430 MB read per token at context 256)" in text
    assert "logit NMSE 1.8e-01, top-1 agreement 0.250" in text
