"""`dsv4-ort bench --pipeline --smoke`: the tiny preset in 2 stages in-process and on a loopback Ray, and the
Flash / Pro sizing table computed from those figures."""

import json

import pytest

pytest.importorskip("ray", reason="the pipeline bench needs ray (pip install 'dsv4-ort[cluster]')")


def test_pipeline_smoke(tmp_path, monkeypatch):
    from dsv4_ort.cli import main

    monkeypatch.setenv("DSV4_ORT_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "--pipeline", "--smoke", "--quiet", "--out", str(tmp_path / "r")]) == 0
    r = json.loads((tmp_path / "r" / "pipeline.json").read_text())
    m, s = r["measured"], r["sizing"]
    assert m["boundary_bytes_per_token"] == 4 * 256 * 4  # tiny: hc_mult 4 x hidden 256 float32
    rows = {(row["preset"], row["nodes"]): row for row in s["rows"]}
    assert set(rows) == {(p, n) for p in ("flash", "pro") for n in (2, 4, 8)}
    for p in ("flash", "pro"):  # more nodes: less memory per stage, the same boundary bytes
        mem = [rows[p, n]["stage_bytes_max"] for n in (2, 4, 8)]
        assert mem == sorted(mem, reverse=True) and mem[-1] < mem[0] / 3
        assert {rows[p, n]["boundary_bytes_per_token"] for n in (2, 4, 8)} == {4 * (4096 if p == "flash" else 7168) * 4}
        assert all(0 < rows[p, n]["decode_tok_s"] <= rows[p, n]["decode_tok_s_no_network"] for n in (2, 4, 8))
    assert "| flash | 8 |" in (tmp_path / "r" / "pipeline.md").read_text()
