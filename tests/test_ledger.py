"""The privacy ledger: schema, round trip, resume, corrupt and torn files, step reduction."""

import json
import math
import subprocess
import sys

import pytest

from dpcore.ledger import (Header, Ledger, LedgerError, LedgerWarning, SamplingEvent, Step,
                           SumQueryEvent, merge_steps, read_ledger)


def write_steps(ledger, steps):
    for q, queries in steps:
        ledger.record_sampling(q, 1000)
        ledger.record_sum_queries([SumQueryEvent(g, c, s) for g, c, s in queries])


def test_file_layout_is_header_then_one_event_a_line(tmp_path):
    path = tmp_path / "run.jsonl"
    with Ledger(path) as ledger:
        write_steps(ledger, [(0.01, [("dense", 1.0, 1.1), ("metric", 0.5, 2.0)])])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {"format": "dpcore-ledger", "version": 1, "neighbouring": "add_or_remove_one_record",
         "record": "example"},
        {"event": "sampling", "q": 0.01, "n": 1000},
        {"event": "sum_query", "group": "dense", "clip": 1.0, "noise_std": 1.1},
        {"event": "sum_query", "group": "metric", "clip": 0.5, "noise_std": 2.0},
    ]


def test_events_are_on_disk_as_soon_as_written(tmp_path):
    path = tmp_path / "run.jsonl"
    ledger = Ledger(path)
    ledger.record_sampling(0.5, 10)
    ledger.record_sum_queries([SumQueryEvent("g", 1.0, 2.0)])
    # not closed: a crash now must not lose the step whose result is about to be released
    assert read_ledger(path).events == ledger.events
    ledger.close()


def test_round_trip_and_step_reduction(tmp_path):
    path = tmp_path / "run.jsonl"
    with Ledger(path, record="microbatch", microbatch_size=4) as ledger:
        write_steps(ledger, [(0.01, [("a", 1.0, 1.0), ("b", 2.0, 2.0)])] * 3
                    + [(0.02, [("a", 1.0, 3.0)])] + [(0.02, [])] + [(0.02, [("a", 1.0, 0.0)])])
    back = read_ledger(path)
    assert back.header == Header(record="microbatch", microbatch_size=4)
    assert back.steps() == [Step(0.01, 2.0 ** -0.5, 3), Step(0.02, 3.0, 1),
                            Step(0.02, math.inf, 1), Step(0.02, 0.0, 1)]


def test_merge_steps_merges_only_consecutive_equal_steps():
    steps = [Step(0.1, 1.0), Step(0.1, 1.0), Step(0.1, 2.0), Step(0.1, 1.0, 5)]
    assert merge_steps(steps) == [Step(0.1, 1.0, 2), Step(0.1, 2.0, 1), Step(0.1, 1.0, 5)]
    # z computed from noise_std / clip differs by ulps when the clips change: one run, at
    # the smaller z; a real difference, or inf beside a finite z, is not a tie
    up = math.nextafter(math.nextafter(1.1, 2), 2)
    steps = [Step(0.1, up), Step(0.1, 1.1), Step(0.1, up), Step(0.1, 1.1 * (1 + 1e-9)),
             Step(0.1, math.inf), Step(0.1, 1e300), Step(0.2, 1.1)]
    assert merge_steps(steps) == [Step(0.1, 1.1, 3), Step(0.1, 1.1 * (1 + 1e-9), 1),
                                  Step(0.1, math.inf, 1), Step(0.1, 1e300, 1), Step(0.2, 1.1, 1)]


def test_reopening_appends_to_the_same_ledger(tmp_path):
    path = tmp_path / "run.jsonl"
    with Ledger(path) as ledger:
        write_steps(ledger, [(0.1, [("g", 1.0, 1.0)])])
    with Ledger(path) as ledger:
        assert len(ledger.events) == 2 and ledger.samplings == 1  # the steps begun so far
        write_steps(ledger, [(0.1, [("g", 1.0, 1.0)])])
        assert ledger.samplings == 2
    assert read_ledger(path).steps() == [Step(0.1, 1.0, 2)]
    assert read_ledger(path).samplings == 2
    with pytest.raises(LedgerError, match="existing ledger is for record='example'"):
        Ledger(path, record="user")



def test_a_closed_ledger_file_refuses_events_rather_than_keep_them_in_memory(tmp_path):
    """The file would under-report the steps taken after close()."""
    path = tmp_path / "run.jsonl"
    ledger = Ledger(path)
    write_steps(ledger, [(0.1, [("g", 1.0, 1.0)])])
    ledger.close()
    with pytest.raises(LedgerError, match=r"run.jsonl is closed: 1 event\(s\) would be kept"):
        ledger.record_sampling(0.1, 100)
    assert len(ledger.events) == 2 and len(read_ledger(path).events) == 2
    ledger.close()  # closing twice is harmless

@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_a_ledger_file_has_one_writer(tmp_path):
    """A second writer, in this process or another, is refused before it reads or changes a
    byte; the first keeps writing, and once it is closed the run can be resumed."""
    path = tmp_path / "run.jsonl"
    first = Ledger(path)
    first.record_sampling(0.1, 100)
    before = path.read_bytes()
    with pytest.raises(LedgerError, match="open for writing by another Ledger"):
        Ledger(path)
    other = subprocess.run(
        [sys.executable, "-c", "import sys; from dpcore.ledger import Ledger, LedgerError\n"
         "try:\n    Ledger(sys.argv[1])\nexcept LedgerError as e:\n    print(e)",
         str(path)], capture_output=True, text=True, check=True)
    assert "open for writing by another Ledger" in other.stdout
    assert path.read_bytes() == before
    first.record_sum_queries([SumQueryEvent("all", 1.0, 1.1)])
    first.close()
    with Ledger(path) as resumed:
        assert len(resumed.events) == 2
    assert len(read_ledger(path).events) == 2  # readers take no lock


def test_sum_query_needs_a_sampling_event():
    with pytest.raises(LedgerError, match="must follow a sampling event"):
        Ledger().record_sum_queries([SumQueryEvent("g", 1.0, 1.0)])


@pytest.mark.parametrize("line, message", [
    ('{"event":"sampling","q":1.5,"n":10}', r"line 3: invalid sampling event: q must be in \(0, 1\], got 1\.5"),
    ('{"event":"sampling","q":0.1,"n":-1}', r"line 3: invalid sampling event: n must be an integer >= 0, got -1"),
    ('{"event":"sum_query","group":"g","clip":0,"noise_std":1}', r"line 3: .*clip must be finite and > 0, got 0"),
    ('{"event":"sum_query","group":"g","clip":1,"noise_std":-1}', r"line 3: .*noise_std must be finite and >= 0, got -1"),
    ('{"event":"sum_query","group":"g","clip":1}', r"line 3: sum_query event lacks field\(s\) \['noise_std'\]"),
    ('{"event":"gradient","q":0.1}', r"line 3: unknown event type 'gradient'"),
    ('{"event":["sampling"],"q":0.1}', r"line 3: unknown event type \['sampling'\]"),
    ('{"event":{"k":1},"q":0.1}', r"line 3: unknown event type \{'k': 1\}"),
    ('[1, 2]', r"line 3: expected a JSON object"),
    ('{"event":"sampling",', r"line 3: not valid JSON"),
])
def test_corrupt_line_is_an_error_naming_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    with Ledger(path) as ledger:
        write_steps(ledger, [(0.1, [])])
        write_steps(ledger, [(0.1, [("g", 1.0, 1.0)])])
    lines = path.read_text().splitlines()
    lines[2] = line
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(LedgerError, match=message):
        read_ledger(path)
    with pytest.raises(LedgerError, match=message):  # and no run appends to a corrupt ledger
        Ledger(path)


def test_bad_headers(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text("")
    with pytest.raises(LedgerError, match="empty file"):
        read_ledger(path)
    path.write_text('{"event":"sampling","q":0.1,"n":1}\n')
    with pytest.raises(LedgerError, match="line 1: not a dpcore ledger"):
        read_ledger(path)
    path.write_text('{"format":"dpcore-ledger","version":2,"neighbouring":"add_or_remove_one_record","record":"example"}\n')
    with pytest.raises(LedgerError, match="version 2 was written by a newer dpcore"):
        read_ledger(path)
    path.write_text('{"format":"dpcore-ledger","version":1,"neighbouring":"replace_one","record":"example"}\n')
    with pytest.raises(LedgerError, match="neighbouring must be"):
        read_ledger(path)
    path.write_text('{"format":"dpcore-ledger","version":1,"neighbouring":"add_or_remove_one_record","record":"example"}\n'
                    '{"event":"sum_query","group":"g","clip":1,"noise_std":1}\n')
    with pytest.raises(LedgerError, match="line 2: sum query before any sampling event"):
        read_ledger(path)
    with pytest.raises(LedgerError, match="cannot read ledger"):
        read_ledger(tmp_path / "missing.jsonl")
    path.write_text('{"format":"dpcore-ledger","version":1,"neighbouring":"add_or_remove_one_record","record":"example"}\n'
                    '{"event":"sampling","q":0.1,"n":5}\n\n')
    with pytest.raises(LedgerError, match="line 3: blank line"):
        read_ledger(path)
    with pytest.raises(LedgerError, match="cannot read ledger"):
        read_ledger(tmp_path)
    with pytest.raises(LedgerError, match=f"cannot open ledger {tmp_path} for writing"):
        Ledger(tmp_path)
    with pytest.raises(LedgerError, match="cannot open ledger .*missing/l.jsonl for writing"):
        Ledger(tmp_path / "missing" / "l.jsonl")


def test_unknown_fields_are_ignored_for_forward_compatibility(tmp_path):
    path = tmp_path / "new.jsonl"
    path.write_text('{"format":"dpcore-ledger","version":1,"neighbouring":"add_or_remove_one_record","record":"example","host":"x"}\n'
                    '{"event":"sampling","q":0.1,"n":5,"time":1.5}\n'
                    '{"event":"sum_query","group":"g","clip":1,"noise_std":2,"note":"hi"}\n')
    assert read_ledger(path).steps() == [Step(0.1, 2.0, 1)]


def torn_ledger(tmp_path):
    path = tmp_path / "torn.jsonl"
    with Ledger(path) as ledger:
        write_steps(ledger, [(0.1, [("g", 1.0, 1.0)])] * 2)
    with open(path, "a") as f:
        f.write('{"event":"sampling","q":0.1')  # the crash came mid-write
    return path


def test_torn_last_line_is_reported_never_silently_dropped(tmp_path):
    path = torn_ledger(tmp_path)
    with pytest.raises(LedgerError, match=r"line 6: torn last line .*allow_torn_tail=True"):
        read_ledger(path)
    with pytest.warns(LedgerWarning, match="line 6: torn last line"):
        assert read_ledger(path, allow_torn_tail=True).steps() == [Step(0.1, 1.0, 2)]


def test_resuming_after_a_torn_write_cuts_only_the_torn_bytes(tmp_path):
    path = torn_ledger(tmp_path)
    with pytest.raises(LedgerError, match="torn last line"):
        Ledger(path)
    with pytest.warns(LedgerWarning):
        ledger = Ledger(path, allow_torn_tail=True)
    write_steps(ledger, [(0.1, [("g", 1.0, 1.0)])])
    ledger.close()
    assert read_ledger(path).steps() == [Step(0.1, 1.0, 3)]


def test_a_missing_final_newline_alone_is_not_torn(tmp_path):
    path = tmp_path / "nl.jsonl"
    with Ledger(path) as ledger:
        write_steps(ledger, [(0.1, [("g", 1.0, 1.0)])])
    path.write_bytes(path.read_bytes()[:-1])
    assert read_ledger(path).steps() == [Step(0.1, 1.0, 1)]
    with Ledger(path) as ledger:
        write_steps(ledger, [(0.1, [("g", 1.0, 1.0)])])
    assert read_ledger(path).steps() == [Step(0.1, 1.0, 2)]


def test_events_validate_on_construction():
    with pytest.raises(ValueError, match=r"q must be in \(0, 1\], got 0\.0"):
        SamplingEvent(0.0, 10)
    with pytest.raises(ValueError, match="group must be a non-empty string"):
        SumQueryEvent("", 1.0, 1.0)
    with pytest.raises(TypeError, match="expected SamplingEvent or SumQueryEvent"):
        Ledger().write({"event": "sampling"})


@pytest.mark.parametrize("lines, message", [
    (['{"format": "dpcore-ledger"}'], "missing"),  # a header that lost "record": "user"
    (['{"format": "dpcore-ledger", "version": 1, "neighbouring": "add_or_remove_one_record", '
      '"record": "example"}', '{"event": "sampling", "q": 0.5, "n": 1000, "q": 0.001}'],
     "line 2: not valid JSON .*repeated keys \\['q'\\]"),
])
def test_an_incomplete_header_or_a_repeated_key_is_refused(tmp_path, lines, message):
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(LedgerError, match=message):
        read_ledger(path)


def test_a_line_nested_too_deep_for_the_json_parser_is_a_ledger_error(tmp_path):
    header = ('{"format":"dpcore-ledger","version":1,"neighbouring":"add_or_remove_one_record",'
              '"record":"example"}\n')
    sampling = '{"event":"sampling","q":0.5,"n":10}\n'
    middle, tail = tmp_path / "middle.jsonl", tmp_path / "tail.jsonl"
    middle.write_text(header + sampling + "[" * 100_000 + "]" * 100_000 + "\n" + sampling)
    tail.write_text(header + sampling + "[" * 100_000)
    with pytest.raises(LedgerError, match=r"middle.jsonl, line 3: not valid JSON"):
        read_ledger(middle)
    with pytest.raises(LedgerError, match=r"tail.jsonl, line 3: not valid JSON, nor the start"):
        Ledger(tail, allow_torn_tail=True)  # a torn event line starts with '{'


@pytest.mark.parametrize("tail", [b"\x89PNG\r\x1a\x00\xff", b'{"event":"sampling","q":0.1\xff',
                                  b"[1, 2", b'{"event":"samp\x00'])
def test_bytes_the_writer_never_writes_are_no_torn_line(tmp_path, tail):
    """They were reported as a torn last line, and dropped with allow_torn_tail=True."""
    path = torn_ledger(tmp_path)
    path.write_bytes(path.read_bytes()[:path.read_bytes().rindex(b"\n") + 1] + tail)
    for allow in (False, True):
        with pytest.raises(LedgerError, match=r"line 6: not valid JSON, nor the start of a "
                                              r"ledger line"):
            read_ledger(path, allow_torn_tail=allow)
