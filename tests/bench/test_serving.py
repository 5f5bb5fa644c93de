"""The serving case of ``dsv4-ort bench``: a real server on loopback, concurrent streaming clients, consistent
figures, nothing left running; and the percentile helper."""

from __future__ import annotations

import pytest

for _mod in ("starlette", "uvicorn"):
    pytest.importorskip(_mod, reason=f"the serving bench needs {_mod} (pip install 'dsv4-ort[serve]')")

from model_fixtures import require_library  # noqa: E402

from dsv4_ort.bench import serving  # noqa: E402


def test_percentile():
    assert serving.percentile([3, 1, 2, 4], 50) == 2.5
    assert serving.percentile([5], 99) == 5
    assert serving.percentile(range(101), 99) == 99
    assert serving.percentile([0, 10], 99) == pytest.approx(9.9)


def test_serving_rounds_on_tiny(cache, tmp_path, monkeypatch):
    require_library()
    model = cache.export(("tiny",), logits="last", max_seq_len=256).parent
    order = []
    measure = serving.measure

    def counted(host, port, clients, **kw):
        if kw["max_tokens"] == 6:  # not the warm-up
            order.append(clients)
        return measure(host, port, clients, **kw)

    monkeypatch.setattr(serving, "measure", counted)
    result = serving.run("tiny", clients=(1, 2), prompt_tokens=12, max_tokens=6, threads=1, model_dir=model,
                         rounds=2, log=lambda m: None, timeout=120)
    assert result["server_exit"] == 0 and result["max_batch"] == 2 and result["rounds"] == 2
    assert order == [1, 2, 2, 1]  # the second round runs the counts in reverse
    for row, n in zip(result["rows"], (1, 2)):
        # pooled over both rounds; ignore_eos: every token is generated
        assert row["clients"] == n and row["output_tokens"] == 2 * n * 6 and "samples" not in row
        assert row["output_tok_s"] > 0 and 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
        assert 0 < row["itl_ms"]["p50"] <= row["itl_ms"]["p99"]
        rounds = [rr[(1, 2).index(n)] for rr in result["round_rows"]]
        assert [r["output_tokens"] for r in rounds] == [n * 6, n * 6]
        assert row["wall_s"] == pytest.approx(sum(r["wall_s"] for r in rounds))
    assert len(result["round_ratios"]) == 2
    serving.write(result, tmp_path)
    md = (tmp_path / "serving.md").read_text()
    assert "| clients | output tok/s |" in md and md.count("\n| ") == 3  # the header and two rows
    ratio = result["rows"][1]["output_tok_s"] / result["rows"][0]["output_tok_s"]
    assert f"2 clients against 1: output tokens/s {ratio:.2f}x, ITL p99" in md and "(per round: " in md
    with pytest.raises(ValueError, match="rounds"):
        serving.run("tiny", clients=(1,), model_dir=model, rounds=0, log=lambda m: None)


def test_pooled_rounds_join_the_samples():
    a = serving.summarize(1, 10, 2.0, [0.1], [0.01, 0.03])
    b = serving.summarize(1, 10, 3.0, [0.3], [0.02])
    row = serving.pooled([a, b])
    assert row["output_tokens"] == 20 and row["wall_s"] == 5.0 and row["output_tok_s"] == 4.0
    assert row["itl_ms"]["p50"] == pytest.approx(20.0) and row["ttft_ms"]["p50"] == pytest.approx(200.0)
