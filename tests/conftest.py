"""Shared test fixtures: the built library, ISA levels, tolerances, one-node ONNX models through onnxruntime."""

from __future__ import annotations

import os

import pytest
from testutil import available_isa_levels, library_info


def pytest_report_header(config):
    try:
        info = library_info()
        return [f"dsv4_ort library: {info['library_path']}", f"ISA levels tested: {', '.join(available_isa_levels())}"]
    except Exception as e:  # the tests that need the library will fail with the reason
        return [f"dsv4_ort library unavailable: {e}"]


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The reference runs tiny tensors: extra torch threads only add synchronisation, which costs 10-100x on a
    2-core machine that onnxruntime's own pool is also using."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=available_isa_levels() if os.environ.get("DSV4_ORT_SKIP_LIBRARY") is None else [])
def isa(request):
    """Every ISA level this CPU supports (scalar, avx2, avx512, amx ...)."""
    return request.param


# Session-wide cache of random checkpoints, exports and reference models (tests/model_fixtures.py).
from model_fixtures import cache  # noqa: E402,F401
