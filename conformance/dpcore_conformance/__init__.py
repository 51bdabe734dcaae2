"""The dpcore conformance suite: one pytest suite that checks any registered backend does what
its ledger says. Run it with::

    pytest -p dpcore_conformance.plugin --pyargs dpcore_conformance --dpcore-backend NAME

or ``dpcore conformance NAME``. See ``docs/writing-backends.md``.
"""

from __future__ import annotations

import importlib.util
import sys


def run(backend: str, *pytest_args: str) -> int:
    """Run the suite against ``backend``; returns pytest's exit code."""
    if importlib.util.find_spec("pytest") is None:
        sys.stderr.write("the conformance suite needs pytest: pip install 'dpcore[conformance]'\n")
        return 4
    import pytest

    return int(pytest.main(["-p", "dpcore_conformance.plugin", "--pyargs", "dpcore_conformance",
                            "--dpcore-backend", backend, *pytest_args]))
