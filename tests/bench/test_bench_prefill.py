"""`dsv4-ort bench --prefill --smoke`: prefill, time to first token (one call and chunked) and batched decode in both
compute modes on the tiny preset, with roof fractions from the model's FLOPs."""

import json

import pytest

from dsv4_ort.bench.prefill import MODES, SMOKE, decode_flops, prefill_flops


def test_prefill_smoke(tmp_path, monkeypatch):
    from dsv4_ort.cli import main

    monkeypatch.setenv("DSV4_ORT_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "--prefill", "--smoke", "--quiet", "--threads", "1", "--out", str(tmp_path / "r")]) == 0
    r = json.loads((tmp_path / "r" / "prefill.json").read_text())
    assert set(r["modes"]) == set(MODES) and r["roofs_gflops"]["fp32"] > 0
    for m in r["modes"].values():
        assert [p["tokens"] for p in m["prefill"]] == list(SMOKE["prefill"])
        assert all(p["tokens_per_s"] > 0 and 0 < p["roof_fraction"] < 1 for p in m["prefill"])
        assert [t["tokens"] for t in m["ttft"]] == list(SMOKE["ttft"])
        assert all(t["one_call_s"] > 0 and t["chunked_s"] > 0 for t in m["ttft"])
        assert [d["batch"] for d in m["decode"]] == list(SMOKE["batches"]) and m["decode"][0]["vs_batch1"] == 1
        # batched decode against the compute roof: one token's FLOPs cap tokens/s at every batch size
        assert m["decode_token_gflops"] > 0 and m["decode_ceiling_vs_batch1"] > 1
        for d in m["decode"]:
            assert 0 < d["roof_fraction"] < 1
            assert d["tokens_per_s"] < m["decode_ceiling_tokens_per_s"]
            assert d["roof_fraction"] == pytest.approx(d["tokens_per_s"] / m["decode_ceiling_tokens_per_s"])
    md = (tmp_path / "r" / "prefill.md").read_text()
    assert "| prefill tokens | fp32 tok/s" in md and "| decode rows (context 64) |" in md
    assert "Compute ceiling of batched decode" in md


def test_prefill_flops_grow_with_the_prompt(tmp_path, monkeypatch):
    """Linear in the weights' multiply-adds, plus attention that grows with every position's visible keys."""
    from dsv4_ort.bench.prefill import export

    monkeypatch.setenv("DSV4_ORT_CACHE", str(tmp_path / "cache"))
    d = export("tiny", "fp32", 256, lambda msg: None)
    from dsv4_ort.bench.e2e import inventory, weight_costs
    from dsv4_ort.runtime.session import read_metadata

    f16, f32, f64 = (prefill_flops(d, s) for s in (16, 32, 64))
    assert 0 < f16 < f32 < f64 and f64 >= 4 * f16  # attention per token grows with the position
    params = weight_costs(inventory(d), read_metadata(d)["config"])["params_per_token"]
    assert f16 > 2 * params * 16 and f16 == pytest.approx(2 * params * 16, rel=0.5)


def test_decode_flops_are_one_prefill_token(tmp_path, monkeypatch):
    """One decoded token at position p costs what the prefill of p + 1 tokens adds over p tokens."""
    from dsv4_ort.bench.prefill import export

    monkeypatch.setenv("DSV4_ORT_CACHE", str(tmp_path / "cache"))
    d = export("tiny", "fp32", 256, lambda msg: None)
    for p in (0, 17, 100):
        assert decode_flops(d, p) == pytest.approx(prefill_flops(d, p + 1) - prefill_flops(d, p))
