"""`dsv4-ort bench --formats --smoke`: the weight options of the tiny preset side by side."""

import json

import numpy as np

from dsv4_ort.bench.formats import OPTIONS, decode_speeds


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
    # int8 experts: bf16 products plus the experts' int8 inputs, another (small) change
    assert 0 < rows[("native", "native", "int8")]["nmse"] < 5e-2
    assert rows[("native", "native", "int8")]["nmse"] != rows[("native", "native", "bf16")]["nmse"]
    fp32 = [o for o in OPTIONS if o[2] == "fp32"]
    mb = [rows[o]["mb_per_token"] for o in fp32]
    assert mb == sorted(mb, reverse=True) and mb[-1] < mb[0]  # smaller formats read fewer bytes
    assert all(r["decode_tok_s"] > 0 and r["batch8_tok_s"] > 0 and r["prefill128_tok_s"] > 0 for r in rows.values())
    assert native["decode_vs_native"] == 1 and all(r["decode_vs_native"] > 0 for r in rows.values())
    assert "| tiny | fp8 | fp4 | fp32 |" in (tmp_path / "r" / "formats.md").read_text()


class _FakeSession:
    """Records the order of its decode steps; logits favour token 3."""
    vocab_size = 10

    def __init__(self, name, log):
        self.name, self.log = name, log

    def new_state(self, batch):
        return object()

    def forward(self, ids, state):
        self.log.append((self.name, ids.shape[1]))
        out = np.zeros((1, ids.shape[1], self.vocab_size), np.float32)
        out[..., 3] = 1
        return out


def test_decode_speeds_interleaves_sessions_round_by_round():
    log = []
    a, b = _FakeSession("a", log), _FakeSession("b", log)
    rates = decode_speeds([a, b], prompt_len=4, steps=2, repeats=3)
    assert len(rates) == 2 and all(r > 0 for r in rates)
    prompts = [name for name, s in log if s == 4]  # one prompt per session per round, order reversed every round
    assert prompts == ["a", "b", "b", "a", "a", "b"]
    assert sum(1 for name, s in log if s == 1 and name == "a") == 6  # steps x repeats decode steps each
