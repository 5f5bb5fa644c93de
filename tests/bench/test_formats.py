"""`dsv4-ort bench --formats --smoke`: the weight options of the tiny preset side by side."""

import json

from dsv4_ort.bench.formats import OPTIONS


def test_formats_smoke(tmp_path, monkeypatch, capsys):
    from dsv4_ort.cli import main

    monkeypatch.setenv("DSV4_ORT_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "--formats", "--smoke", "--quiet", "--threads", "1", "--out", str(tmp_path / "r")]) == 0
    result = json.loads((tmp_path / "r" / "formats.json").read_text())
    rows = {(r["head"], r["dense"], r["compute"]): r for r in result["rows"]}
    assert list(rows) == list(OPTIONS)
    native = rows[("native", "native", "fp32")]
    assert native["nmse"] == 0 and native["top1_agreement"] == 1
    assert 0 < rows[("fp8", "native", "fp32")]["nmse"] < 1e-2  # the head alone in FP8: a small change
    assert 0 < rows[("native", "native", "bf16")]["nmse"] < 1e-2  # bf16 products: a small change
    fp32 = [o for o in OPTIONS if o[2] == "fp32"]
    mb = [rows[o]["mb_per_token"] for o in fp32]
    assert mb == sorted(mb, reverse=True) and mb[-1] < mb[0]  # smaller formats read fewer bytes
    assert all(r["decode_tok_s"] > 0 and r["batch8_tok_s"] > 0 and r["prefill128_tok_s"] > 0 for r in rows.values())
    assert "| tiny | fp8 | fp4 | fp32 |" in (tmp_path / "r" / "formats.md").read_text()
