"""The kernel cases' comparisons (dsv4_ort.bench.cases): which baselines each linear case is measured beside."""

from dsv4_ort.bench import cases


def _by_key(cs):
    return {c.key: c for c in cs}


def test_product_twins_compare_matmulnbits_at_matching_products():
    cs = _by_key(cases.linear_cases([1], "decode"))
    assert {t[4] for t in cases.PRODUCT_TWINS} == {"fp4", "fp8"}
    for key, _, N, Kw, fmt, products in cases.PRODUCT_TWINS:
        c = cs[f"linear.{key}"]
        assert c.op == {"fp4": "LinearFp4", "fp8": "LinearFp8"}[fmt] and c.shape["N"] == N and c.shape["K"] == Kw
        assert c.attrs.get("compute", "fp32") == products
        if products == "bf16":
            # bf16 products beside MatMulNBits' int8 activations only, never beside fp32 MatMul / accuracy level 0
            assert c.ort_baselines == ("matmulnbits_int4",)
            assert c.torch_dtypes == ("bfloat16",)
        else:
            assert set(c.ort_baselines) == {"matmul_fp32", "matmulnbits_int4", "matmulnbits_int4_fp32"}
        # compulsory bytes: the FP4 codes and one scale byte per 32 columns; FP8 codes and one per 128 x 128
        if fmt == "fp4":
            assert c.cold_bytes == N * Kw // 2 + N * Kw // 32
        else:
            assert c.cold_bytes == N * Kw + (N // 128) * (Kw // 128) and c.attrs["block_size"] == 128


def test_product_twins_stay_out_of_quick_and_smoke():
    for kw in ({"quick": True}, {"smoke": True}):
        keys = {c.key for c in cases.linear_cases([1], "decode", **kw)}
        assert not keys & {f"linear.{t[0]}" for t in cases.PRODUCT_TWINS}
