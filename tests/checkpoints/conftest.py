"""Fixtures shared by the checkpoint reader and converter tests."""

import pytest
from checkpoint_tampering import BOMB_SHAPE
from checkpoint_tampering import HEAD
from checkpoint_tampering import copy_fixture
from checkpoint_tampering import tamper_index


@pytest.fixture
def bomb_prefix(upstream_dir, tmp_path):
    """A fixture copy whose index declares a 19.2 GB head kernel."""
    prefix = copy_fixture(upstream_dir, tmp_path)
    tamper_index(prefix, HEAD, BOMB_SHAPE)
    return prefix
