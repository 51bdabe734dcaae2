"""Backend registry: entry points, lazy loading, DPCORE_DISABLE_PLUGINS and clear errors."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dpcore
from dpcore import plugins
from dpcore.hookspecs import hookimpl


def run_python(code, *, env=None, path=None):
    environ = dict(os.environ, **(env or {}))
    if path is not None:
        environ["PYTHONPATH"] = os.pathsep.join([str(path), environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=environ, timeout=120)


def test_import_dpcore_loads_no_framework_and_no_plugin():
    out = run_python("""
        import sys, dpcore
        heavy = [m for m in ("torch", "jax", "tensorflow", "dpcore.numpy_backend") if m in sys.modules]
        print(heavy)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_listing_backends_imports_no_framework():
    """Entry-point modules must import their framework only in the backend factory."""
    out = run_python("""
        import sys, dpcore
        dpcore.available_backends()
        print([m for m in ("torch", "jax", "tensorflow") if m in sys.modules])
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_numpy_backend_comes_through_the_entry_point():
    backend = dpcore.get_backend("numpy")
    assert "numpy" in dpcore.available_backends()
    assert backend is dpcore.get_backend("numpy")  # built once
    rng = backend.rng(3)
    _, a = backend.standard_normal(rng, (4,), np.zeros(1, dtype=np.float32))
    assert a.dtype == np.float32
    _, b = backend.standard_normal(backend.rng(3), (4,), np.zeros(1, dtype=np.float32))
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("setting, loads_any, loads_numpy", [
    ("1", False, False), ("all", False, False), ("numpy", None, False), ("other,x", True, True)])
def test_disable_plugins_environment_variable(setting, loads_any, loads_numpy):
    out = run_python("import dpcore; print(','.join(dpcore.available_backends()))",
                     env={"DPCORE_DISABLE_PLUGINS": setting})
    assert out.returncode == 0, out.stderr
    names = out.stdout.strip().split(",") if out.stdout.strip() else []
    assert ("numpy" in names) == loads_numpy
    if loads_any is not None:
        assert bool(names) == loads_any


class Plugin:
    def __init__(self, name, factory, requires=()):
        self.args = (name, factory, requires)

    @hookimpl
    def dpcore_register_backends(self, register):
        name, factory, requires = self.args
        register(name, factory, requires=requires)


@pytest.fixture
def registered():
    added = []

    def add(plugin):
        plugins.register_plugin(plugin)
        added.append(plugin)
        return plugin

    yield add
    for plugin in added:
        plugins.unregister_plugin(plugin)


def test_unknown_backend_names_the_registered_ones():
    with pytest.raises(plugins.UnknownBackendError,
                       match=r"no backend named 'nope'; registered backends: .*numpy"):
        dpcore.get_backend("nope")


def test_duplicate_backend_names_are_an_error(registered):
    registered(Plugin("numpy", dict))
    with pytest.raises(plugins.DuplicateBackendError, match="'numpy' is registered twice") as err:
        dpcore.available_backends()
    assert "dpcore.numpy_backend" in str(err.value) and "builtins" in str(err.value)


def test_backend_whose_framework_is_missing_is_unavailable_not_a_crash(registered):
    registered(Plugin("ghost", dict, requires=("no_such_framework_xyz",)))
    assert "ghost" not in dpcore.available_backends()
    with pytest.raises(plugins.BackendUnavailableError,
                       match=r"'ghost' needs no_such_framework_xyz, which is not installed"):
        dpcore.get_backend("ghost")


def test_backend_that_fails_to_start(registered):
    def factory():
        raise RuntimeError("no device")

    registered(Plugin("broken", factory))
    with pytest.raises(plugins.BackendUnavailableError,
                       match="'broken' failed to start: RuntimeError: no device"):
        dpcore.get_backend("broken")


def make_distribution(root, name, entry_points, modules=None):
    """An installed-looking distribution on ``root`` (a dist-info folder), as pip would leave."""
    info = root / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[dpcore]\n" + "".join(
        f"{k} = {v}\n" for k, v in entry_points.items()))
    for module, source in (modules or {}).items():
        (root / f"{module}.py").write_text(textwrap.dedent(source))


def test_third_party_entry_point_registers_a_backend(tmp_path):
    make_distribution(tmp_path, "thirdparty", {"thirdparty": "thirdparty_plugin"}, {
        "thirdparty_plugin": """
            from dpcore.hookspecs import hookimpl
            from dpcore.numpy_backend import NumpyBackend

            class Backend(NumpyBackend):
                name = "thirdparty"

            @hookimpl
            def dpcore_register_backends(register):
                register("thirdparty", Backend)
        """})
    out = run_python("import dpcore; print('thirdparty' in dpcore.available_backends(), "
                     "dpcore.get_backend('thirdparty').name)", path=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True thirdparty"


def test_a_broken_plugin_warns_and_leaves_the_others_working(tmp_path):
    make_distribution(tmp_path, "broken", {"broken": "no_such_module_abc"})
    out = run_python("""
        import warnings, dpcore
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            print(dpcore.available_backends())
        print(caught[0].category.__name__, caught[0].message)
        try:
            dpcore.get_backend("broken")
        except LookupError as exc:
            print(exc)
    """, path=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "'numpy'" in lines[0]
    assert lines[1].startswith("PluginLoadWarning dpcore plugin 'broken' (no_such_module_abc) "
                               "failed to load: ModuleNotFoundError")
    assert "plugin 'broken' failed to load (ModuleNotFoundError" in lines[2]
