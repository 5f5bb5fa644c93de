"""Fixtures for the reference-model tests: small configs and randomly initialised models."""

import pytest
from reference_helpers import make_model

from dsv4_ort.models import DeepseekV4Config


@pytest.fixture(scope="session")
def tiny_config() -> DeepseekV4Config:
    """The `tiny` preset: SWA, CSA, HCA (ratio 128), CSA layers + SWA MTP; hash and score MoE."""
    return DeepseekV4Config.from_preset("tiny")


@pytest.fixture(scope="session")
def fast_config(tiny_config) -> DeepseekV4Config:
    """`tiny` with a generic HCA ratio of 16 and one more HCA layer, so short sequences emit entries."""
    return tiny_config.replace(num_hidden_layers=5, compress_ratios=[4, 0, 16, 4, 16, 0], num_hash_layers=1)


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    return make_model(tiny_config)


@pytest.fixture(scope="session")
def fast_model(fast_config):
    return make_model(fast_config, seed=1)
