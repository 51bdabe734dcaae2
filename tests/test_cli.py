"""The ``dpcore`` command (run in-process through ``main``, and once as a real process)."""

import json
import subprocess
import sys

import pytest

from dpcore.cli import main
from dpcore.ledger import Ledger, SumQueryEvent


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_epsilon_json(capsys):
    code, out, err = run(capsys, "epsilon", "--sampling-rate", str(256 / 60000),
                         "--noise-multiplier", "1.1", "--steps", "14063", "--delta", "1e-5",
                         "--json")
    assert code == 0 and err == ""
    obj = json.loads(out)
    assert obj["accountant"] == "pld" and obj["delta"] == 1e-5
    assert obj["epsilon"] == pytest.approx(2.382, abs=1e-3)


def test_epsilon_rdp_text(capsys):
    code, out, _ = run(capsys, "epsilon", "-q", str(256 / 60000), "-z", "1.1", "-T", "14063",
                       "--delta", "1e-5", "--accountant", "rdp")
    assert code == 0 and "epsilon = 2.5966" in out and "RDP order 8.1" in out


def test_epsilon_conventions(capsys):
    code, out, _ = run(capsys, "epsilon", "-q", "0.1", "-z", "0", "-T", "5", "--delta", "1e-5",
                       "--json")
    assert code == 0 and json.loads(out)["epsilon"] == "inf"
    code, out, _ = run(capsys, "epsilon", "-q", "0", "-z", "1", "-T", "5", "--delta", "1e-5",
                       "--json")
    assert code == 0 and json.loads(out)["epsilon"] == 0.0


@pytest.mark.parametrize("argv,message", [
    (["epsilon", "-q", "1.5", "-z", "1", "-T", "10", "--delta", "1e-5"], "q (sampling rate)"),
    (["epsilon", "-q", "0.1", "-z", "-1", "-T", "10", "--delta", "1e-5"], "noise_multiplier"),
    (["epsilon", "-q", "0.1", "-z", "1", "-T", "-10", "--delta", "1e-5"], "steps"),
    (["epsilon", "-q", "0.1", "-z", "1", "-T", "10", "--delta", "0"], "delta must be in"),
    (["epsilon", "-q", "0.1", "-z", "1", "-T", "10", "--delta", "1"], "delta must be in"),
    # negative numbers argparse would read as options: the range error still names the value
    (["epsilon", "-q", "0.1", "-z", "1", "-T", "10", "--delta", "-1e-5"], "got -1e-05"),
    (["epsilon", "-q", "-1e-3", "-z", "1", "-T", "10", "--delta", "1e-5"], "got -0.001"),
    (["epsilon", "-q", "0.1", "-z", "-inf", "-T", "10", "--delta", "1e-5"], "got -inf"),
    (["calibrate", "--target-epsilon", "-1", "--delta", "1e-5", "-q", "0.1", "-T", "10"],
     "target_epsilon"),
    (["calibrate", "--target-epsilon", "1", "--delta", "1e-5", "-q", "0.1"], "exactly two"),
    (["calibrate", "--target-epsilon", "1", "--delta", "1e-5", "-q", "0.1", "-T", "1",
      "-z", "1"], "exactly two"),
    (["ledger", "epsilon", "/nonexistent.jsonl", "--delta", "1e-5"], "cannot read ledger"),
    (["epsilon", "-q", "0.01", "-z", "1", "-T", str(10**13), "--delta", "1e-5"],
     "use --accountant rdp"),  # the library's advice, in the shell's words
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("dpcore: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["epsilon", "-q", "0.1"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["epsilon", "-q", "abc", "-z", "1", "-T", "1", "--delta", "1e-5"])
    assert exc.value.code == 2


def test_help_mentions_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for word in ["epsilon", "calibrate", "ledger"]:
        assert word in out
    with pytest.raises(SystemExit):
        main(["ledger", "--help"])
    out = capsys.readouterr().out
    for word in ["epsilon", "show", "plot"]:
        assert word in out


@pytest.mark.parametrize("given,solved", [
    (["-q", "0.01", "-T", "1000"], "noise_multiplier"),
    (["-z", "1.0", "-T", "1000"], "sampling_rate"),
    (["-q", "0.01", "-z", "1.0"], "steps"),
])
def test_calibrate(capsys, given, solved):
    code, out, _ = run(capsys, "calibrate", "--target-epsilon", "2", "--delta", "1e-5",
                       *given, "--json")
    obj = json.loads(out)
    assert code == 0 and obj["solved_for"] == solved
    assert 1.99 <= obj["epsilon"] <= 2.0
    assert {"epsilon", "delta", "accountant"} <= set(obj)


@pytest.fixture
def ledger_file(tmp_path):
    path = tmp_path / "run.jsonl"
    with Ledger(path) as ledger:
        for t in range(120):
            ledger.record_sampling(0.01, 60000)
            ledger.record_sum_queries([SumQueryEvent("grads", 1.0 / min(2, 1 + t / 120), 1.1)])
    return path


def test_ledger_epsilon(capsys, ledger_file):
    code, out, _ = run(capsys, "ledger", "epsilon", str(ledger_file), "--delta", "1e-5",
                       "--json")
    obj = json.loads(out)
    assert code == 0 and obj["steps"] == 120 and obj["accountant"] == "pld"
    code, out, _ = run(capsys, "ledger", "epsilon", str(ledger_file), "--delta", "1e-5",
                       "--accountant", "rdp", "--json")
    assert json.loads(out)["epsilon"] >= obj["epsilon"]


def test_ledger_show(capsys, ledger_file):
    code, out, _ = run(capsys, "ledger", "show", str(ledger_file))
    assert code == 0 and "120 steps" in out and "grads" in out and "..." in out
    code, out, _ = run(capsys, "ledger", "show", str(ledger_file), "--json")
    obj = json.loads(out)
    assert obj["steps"] == 120 and obj["header"]["neighbouring"] == "add_or_remove_one_record"
    assert sum(r["count"] for r in obj["runs"]) == 120


def test_ledger_plot(capsys, ledger_file, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "eps.png"
    code, out, _ = run(capsys, "ledger", "plot", str(ledger_file), "-o", str(png),
                       "--delta", "1e-5", "--points", "5", "--json")
    obj = json.loads(out)
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    eps = [p["epsilon"] for p in obj["points"]]
    assert eps == sorted(eps) and obj["points"][-1]["step"] == 120


def test_json_output_is_strict_json_at_any_depth(capsys, tmp_path):
    """A step that released nothing (z = inf) and a noiseless one (epsilon inf): nested
    infinities are the string "inf", as at the top level (a bare Infinity is not JSON)."""
    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name}"))

    path = tmp_path / "run.jsonl"
    with Ledger(path) as ledger:
        ledger.record_sampling(0.01, 60000)  # nothing released: z = inf
        ledger.record_sampling(0.01, 60000)
        ledger.record_sum_queries([SumQueryEvent("grads", 1.0, 0.0)])  # noiseless
    _, out, _ = run(capsys, "ledger", "show", str(path), "--json")
    assert [r["noise_multiplier"] for r in strict(out)["runs"]] == ["inf", 0.0]
    pytest.importorskip("matplotlib")
    _, out, _ = run(capsys, "ledger", "plot", str(path), "-o", str(tmp_path / "e.png"),
                    "--delta", "1e-5", "--points", "2", "--json")
    assert strict(out)["points"][-1]["epsilon"] == "inf"


def test_ledger_plot_without_matplotlib(capsys, ledger_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = run(capsys, "ledger", "plot", str(ledger_file), "-o",
                       str(tmp_path / "x.png"), "--delta", "1e-5")
    assert code == 2 and "install dpcore[plot]" in err


def test_corrupt_ledger_names_the_line(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"format":"dpcore-ledger","version":1,'
                    '"neighbouring":"add_or_remove_one_record","record":"example"}\n'
                    '{"event":"sampling","q":0.1,"n":10}\n{"event":"sampling","q":2,"n":10}\n')
    code, _, err = run(capsys, "ledger", "epsilon", str(path), "--delta", "1e-5")
    assert code == 2 and "line 3" in err


def test_module_entry_point():
    result = subprocess.run([sys.executable, "-m", "dpcore.cli", "epsilon", "-q", "0.01", "-z",
                             "1", "-T", "100", "--delta", "1e-5", "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["accountant"] == "pld"
    bad = subprocess.run([sys.executable, "-m", "dpcore.cli", "epsilon", "-q", "2", "-z", "1",
                          "-T", "100", "--delta", "1e-5"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("dpcore: error:")


def test_a_torn_tail_is_one_warning_line_and_binary_data_an_error(capsys, ledger_file, tmp_path):
    """--allow-torn-tail printed a two-line Python warning (file, line, source); a binary file
    without a newline was read as a torn last line and dropped."""
    with open(ledger_file, "a") as f:
        f.write('{"event":"sampling","q":0.0')
    code, out, err = run(capsys, "ledger", "epsilon", str(ledger_file), "--delta", "1e-5",
                         "--allow-torn-tail", "--json")
    assert code == 0 and json.loads(out)["steps"] == 120
    assert err.splitlines() == [f"dpcore: warning: {ledger_file}, line 242: torn last line "
                                f"(27 bytes without a newline; a crash while writing?); dropped"]
    binary = tmp_path / "image.png"
    binary.write_bytes(bytes(range(256)).replace(b"\n", b""))
    code, _, err = run(capsys, "ledger", "show", str(binary), "--allow-torn-tail")
    assert code == 2 and "line 1: not valid JSON, nor the start of a ledger line" in err


def test_printed_bounds_are_rounded_to_the_safe_side(capsys):
    """Six digits rounded to nearest printed epsilon 2.38178 for 2.3817809 (below the bound)
    and a solved z of 0.959127 for 0.9591274 (less noise than calibrated); a steps answer at
    the search's limit said nothing of it."""
    code, out, _ = run(capsys, "epsilon", "-q", "0.00426667", "-z", "1.1", "-T", "14063",
                       "--delta", "1e-5")
    assert code == 0 and out.startswith("epsilon = 2.38179 ")
    code, out, _ = run(capsys, "calibrate", "--target-epsilon", "2", "--delta", "1e-5",
                       "-q", "0.01", "-T", "1000", "--json")
    z = json.loads(out)["noise_multiplier"]
    code, out, _ = run(capsys, "calibrate", "--target-epsilon", "2", "--delta", "1e-5",
                       "-q", "0.01", "-T", "1000")
    printed = float(out.split()[2])
    assert printed >= z and printed == pytest.approx(z, rel=1e-5)
    code, out, _ = run(capsys, "calibrate", "--target-epsilon", "10", "--delta", "1e-5",
                       "-q", "1e-6", "-z", "5", "--accountant", "rdp")
    assert out.startswith("steps = 1000000000 (the most searched)")
