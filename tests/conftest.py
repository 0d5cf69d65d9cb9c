"""Shared test set-up. Each backend's tests run in their own process (dev/test.sh)."""

import keras
import pytest


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend: {keras.backend.backend()}"


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    keras.backend.clear_session()
    yield
