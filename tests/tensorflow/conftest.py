"""TensorFlow backend tests: skipped as a whole when TensorFlow is not installed."""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
pytest.importorskip("tensorflow")
pytest.importorskip("keras")
