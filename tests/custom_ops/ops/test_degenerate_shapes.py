"""Empty reductions and empty weights at every ISA level: a Linear with K = 0 and MoE experts with I = 0 give
zeros (found by the fuzzer: K = 0 divided by zero in the AMX tile path, and a huge expert count of empty weights
made the op and the kernels allocate per-expert buffers)."""

import numpy as np
import pytest
from onnx_helpers import bf16, fp8_e4m3, run_op


def _x(dtype, shape):
    x = np.zeros(shape, np.float32)
    return bf16(x) if dtype == "bfloat16" else x


@pytest.mark.parametrize("dtype", ["float", "bfloat16"])
@pytest.mark.parametrize("rows, groups", [(1, 1), (6, 3), (40, 1)])
def test_linear_with_no_columns_is_zero(isa, dtype, rows, groups):
    (y,) = run_op("Linear", {"x": _x(dtype, (2, rows, 0)), "weight": np.ones((5 * groups, 0), np.float32)},
                  {"groups": groups} if groups != 1 else {}, isa=isa)
    assert y.shape == (2, rows, 5 * groups) and not y.any()


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_quantised_linear_with_no_columns_is_zero(isa, fmt):
    x = np.zeros((6, 0), np.float32)
    if fmt == "fp8":
        inputs = {"x": x, "weight": fp8_e4m3(np.zeros((64, 0), np.uint8)), "scale": np.ones((1, 0), np.float32)}
        (y,) = run_op("LinearFp8", inputs, isa=isa)
    else:
        inputs = {"x": x, "weight": np.zeros((64, 0), np.uint8), "scale": np.zeros((64, 0), np.uint8)}
        (y,) = run_op("LinearFp4", inputs, isa=isa)
    assert y.shape == (6, 64) and not y.any()


@pytest.mark.parametrize("experts", [3, 2 ** 40])
def test_moe_experts_without_intermediate_units_is_zero(isa, experts):
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    inputs = {"x": x, "weights": np.full((4, 2), 0.5, np.float32),
              "indices": np.array([[0, 1], [2, 0], [1, 1], [2, 2]], np.int64),
              "w1": np.zeros((experts, 0, 8), np.float32), "w2": np.zeros((experts, 8, 0), np.float32),
              "w3": np.zeros((experts, 0, 8), np.float32)}
    (y,) = run_op("MoeExperts", inputs, isa=isa)
    assert y.shape == (4, 8) and not y.any()


def test_moe_experts_bf16_without_intermediate_units_is_zero(isa):
    x = bf16(np.ones((3, 8), np.float32))
    inputs = {"x": x, "w1": bf16(np.zeros((1, 0, 8), np.float32)), "w2": bf16(np.zeros((1, 8, 0), np.float32)),
              "w3": bf16(np.zeros((1, 0, 8), np.float32))}
    (y,) = run_op("MoeExperts", inputs, isa=isa)
    assert y.shape == (3, 8) and not y.any()
