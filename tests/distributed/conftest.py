"""The transformers references of the parity tests, shared with the multi-process tests."""

from tests.models.test_parity import references  # noqa: F401 - a fixture
