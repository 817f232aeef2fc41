"""Engine tests use the model fixtures from tests/conftest.py."""
