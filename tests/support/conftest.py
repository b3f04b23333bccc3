"""Fixtures for the support code's self-checks: two tiny HF models, built once for the package."""

from __future__ import annotations

import pytest

from tests.support.models import make_tiny_model


@pytest.fixture(scope="package")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("reference")


@pytest.fixture(scope="package")
def llama(work):
    return make_tiny_model(work / "llama", "llama", max_shard_size="40KB")


@pytest.fixture(scope="package")
def qwen3(work):
    return make_tiny_model(work / "qwen3", "qwen3", tie_word_embeddings=True, num_key_value_heads=1)
