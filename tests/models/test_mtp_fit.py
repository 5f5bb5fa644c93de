"""models/mtp_fit.py: the MTP self-distillation is deterministic, moves only mtp.0.* tensors, lowers its loss, and
its cache returns the same arrays."""

from __future__ import annotations

import numpy as np


def test_fit_is_deterministic_and_cached(tmp_path):
    from dsv4_ort.models.config import DeepseekV4Config
    from dsv4_ort.models.mtp_fit import cached_fit, fit_mtp

    cfg = DeepseekV4Config.from_preset("tiny")
    kw = dict(steps=6, n_seq=8, seq_len=16, batch=4)
    a, rep = fit_mtp(cfg, **kw)
    b, _ = fit_mtp(cfg, **kw)
    assert sorted(a) == sorted(b) and all(n.startswith("mtp.0.") for n in a)
    assert "mtp.0.e_proj.weight" in a and "mtp.0.ffn.experts.0.w1.weight" in a
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)
    assert rep["last_loss"] < rep["first_loss"]
    c, _ = cached_fit(cfg, cache_dir=tmp_path, **kw)
    d, _ = cached_fit(cfg, cache_dir=tmp_path, **kw)  # from the file
    assert len(list((tmp_path / "mtp_fit").glob("*.npz"))) == 1
    for n in a:
        np.testing.assert_array_equal(c[n], a[n])
        np.testing.assert_array_equal(d[n], a[n])
