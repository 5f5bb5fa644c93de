"""`dsv4-ort bench --speculative --smoke`: MTP step costs, generation with and without drafts, projections, and the
fitted block's acceptance, on the tiny preset."""

import json
import os
from pathlib import Path

from dsv4_ort.bench.speculative import PROJECTED_ACCEPTANCE, bytes_bound, projected_speedup


def test_speculative_smoke(tmp_path, monkeypatch):
    from dsv4_ort.cli import main
    from dsv4_ort.models.config import DeepseekV4Config
    from dsv4_ort.models.mtp_fit import cached_fit

    cached_fit(DeepseekV4Config.from_preset("tiny"))  # the fit the runtime tests share, in the default cache
    default = Path(os.environ.get("DSV4_ORT_CACHE") or Path.home() / ".cache" / "dsv4_ort")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "mtp_fit").symlink_to(default / "mtp_fit")  # the exports go to the test's own cache
    monkeypatch.setenv("DSV4_ORT_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "--speculative", "--smoke", "--quiet", "--threads", "1", "--out", str(tmp_path / "r")]) == 0
    r = json.loads((tmp_path / "r" / "speculative.json").read_text())
    c = r["costs"]["costs"]
    assert c["decode_s"] > 0 and all(c[f"verify_{k}_s"] > 0 and c[f"draft_{k}_s"] > 0 for k in (1, 2, 3))
    for part in (r["costs"], r["fitted_tiny"]):  # greedy tokens with drafts are the plain ones
        assert all(part["generation"][f"mtp_{k}"]["identical"] for k in (1, 2, 3))
    fitted = r["fitted_tiny"]["generation"]["mtp_1"]
    assert 0 < fitted["acceptance"] <= 1 and fitted["tokens_per_cycle"] > 1
    assert "| k | verify k+1 / decode |" in (tmp_path / "r" / "speculative.md").read_text()
    nb = r["costs"]["bytes"]  # a verify's tokens touch more experts than one token; a draft reads less than a step
    assert nb["decode"] < nb["verify_1"] < nb["verify_2"] < nb["verify_3"] and 0 < nb["draft"] < nb["decode"]
    assert r["costs"]["bytes_bound"]["2"]["0.8"] == bytes_bound(nb, 2, 0.8)


def test_projection():
    """A cycle of k drafts accepted with probability a each emits (1 - a^(k+1)) / (1 - a) tokens on average."""
    costs = {"decode_s": 1.0, "verify_2_s": 1.2, "draft_2_s": 0.2, "rollback_2_s": 0.1}
    assert abs(projected_speedup(costs, 2, 0.5) - 1.75 / 1.5) < 1e-12
    assert abs(projected_speedup(costs, 2, 1.0) - 3 / 1.5) < 1e-12
    assert PROJECTED_ACCEPTANCE == (0.6, 0.8, 0.9)


def test_bytes_bound():
    """The projection with step times proportional to bytes: k drafts read k draft steps, no rollback cost."""
    nbytes = {"decode": 100.0, "verify_2": 120.0, "draft": 10.0}
    assert abs(bytes_bound(nbytes, 2, 0.5) - 1.75 * 100 / 140) < 1e-12
    assert abs(bytes_bound(nbytes, 2, 1.0) - 3 * 100 / 140) < 1e-12
