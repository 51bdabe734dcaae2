"""`dpcore conformance NAME` runs the suite and returns pytest's status; a backend that
cannot be had is one error, naming what to install."""

import os
import subprocess
import sys

import pytest


def dpcore(*args):
    return subprocess.run([sys.executable, "-m", "dpcore.cli", *args], capture_output=True,
                          text=True, timeout=600)


def test_conformance_command_runs_the_suite_on_a_backend():
    out = dpcore("conformance", "numpy", "-p", "no:cacheprovider")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dpcore backend: numpy" in out.stdout
    assert "passed" in out.stdout and "skipped" in out.stdout  # no per-example gradients


def test_conformance_command_names_an_unknown_backend():
    out = dpcore("conformance", "nope")
    assert out.returncode == 2
    assert out.stderr.startswith("dpcore: error: no backend named 'nope'")
    assert len(out.stderr.strip().splitlines()) == 1


def test_conformance_command_needs_only_a_backend_name():
    out = dpcore("conformance")
    assert out.returncode == 2
    assert out.stderr.strip().endswith("the following arguments are required: NAME"), out.stderr


def hiding(modules, *args):
    """``dpcore *args`` in a process where ``modules`` look uninstalled (``find_spec`` finds
    them not, as dpcore's registry asks it)."""
    code = ("import importlib.util as u, sys; find = u.find_spec; "
            f"u.find_spec = lambda name, *a: None if name in {tuple(modules)!r} else "
            "find(name, *a); from dpcore.cli import main; sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=600)


def test_an_unavailable_backend_is_named_with_what_to_install():
    """dpcore's own backends name their extra; another distribution's backend names the
    module and that distribution's requirement for it (`dpcore[tinytorch]` is no extra)."""
    out = hiding(["torch"], "conformance", "torch")
    assert out.returncode == 2
    assert "backend 'torch' needs torch, which is not installed" in out.stderr
    assert "pip install 'dpcore[torch]'" in out.stderr
    pytest.importorskip("dpcore_tinytorch", reason="pip install -e docs/examples/dpcore-tinytorch")
    out = hiding(["torch"], "conformance", "tinytorch")
    assert out.returncode == 2
    assert "backend 'tinytorch' needs torch, which is not installed" in out.stderr
    assert "dpcore-tinytorch, which requires torch>=2.2: pip install 'torch>=2.2'" in out.stderr
    assert "dpcore[tinytorch]" not in out.stderr


def suite(directory, *args):
    """The conformance suite run by pytest itself, as its docs show."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "dpcore_conformance.plugin", "--pyargs",
         "dpcore_conformance", "-p", "no:cacheprovider", "-q", *args], cwd=directory,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(directory), os.environ.get("PYTHONPATH", "")])),
        capture_output=True, text=True, timeout=600)


GHOST = '''
from dpcore import plugins
from dpcore.hookspecs import hookimpl


class _Plugin:
    @hookimpl
    def dpcore_register_backends(self, register):
        register("ghost", dict, requires=("no_such_framework_xyz",))


def pytest_configure(config):
    plugins.register_plugin(_Plugin())
'''


def test_pytest_without_a_usable_backend_is_one_usage_error(tmp_path):
    """No --dpcore-backend, an unknown one or one whose framework is missing: one usage
    error (exit status 4) before anything runs, not an error of every check."""
    (tmp_path / "ghost_plugin.py").write_text(GHOST)
    for args, says in [((), "the conformance suite needs --dpcore-backend NAME"),
                       (("--dpcore-backend", "nope"), "no backend named 'nope'"),
                       (("--dpcore-backend", "ghost", "-p", "ghost_plugin"),
                        "'ghost' needs no_such_framework_xyz, which is not installed")]:
        out = suite(tmp_path, *args)
        assert out.returncode == 4, out.stdout[-2000:] + out.stderr[-2000:]
        errors = [line for line in out.stderr.splitlines() if line.startswith("ERROR")]
        assert len(errors) == 1 and says in errors[0], out.stderr
        assert " error" not in out.stdout, out.stdout[-2000:]
