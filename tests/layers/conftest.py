"""Fixtures shared by the layer tests."""

import pytest
from tiny_configs import vmoe_16px_classifier


@pytest.fixture(scope="module")
def classifier():
    """`tiny_configs.vmoe_16px_classifier()`, one per test module."""
    return vmoe_16px_classifier()
