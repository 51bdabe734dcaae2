"""The privacy ledger: an append-only record of every sampling and every noisy sum.

A ledger is a JSON Lines file. The first line is a header naming the format, its version,
the neighbouring relation and the unit of privacy (the *record*); every other line is one
event. A :class:`SumQueryEvent` belongs to the :class:`SamplingEvent` before it, and a
sampling event with its sum queries is one *step*. Accountants read only the ledger, so a
bug in configuration code cannot corrupt the guarantee, and a ledger can be reprocessed
later by a tighter accountant.

Field meanings never change; new fields are optional and readers ignore fields they do not
know. An unknown event type is an error, since an accountant cannot price it. See
``docs/ledger.md``.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Iterable, Iterator, Sequence, Union

from . import _validation as check
from .queries import check_record, effective_noise_multiplier

FORMAT = "dpcore-ledger"
VERSION = 1
NEIGHBOURING = "add_or_remove_one_record"

PathLike = Union[str, "os.PathLike[str]"]


class LedgerError(ValueError):
    """A ledger file or event is invalid; the message names the line where there is one."""


class LedgerWarning(UserWarning):
    """Something in a ledger was tolerated at the caller's request (a torn last line)."""


@dataclass(frozen=True)
class Header:
    """First line of a ledger.

    ``neighbouring`` is the relation the guarantee is stated for: datasets that differ by
    adding or removing one ``record``, where a record is one example, one microbatch (the
    mean of ``microbatch_size`` examples) or all data of one user.
    """

    record: str = "example"
    microbatch_size: int | None = None
    neighbouring: str = NEIGHBOURING
    format: str = FORMAT
    version: int = VERSION

    def __post_init__(self):
        if self.format != FORMAT:
            raise LedgerError(f"format must be {FORMAT!r}, got {self.format!r}")
        check.count("version", self.version, minimum=1)
        if self.version > VERSION:
            raise LedgerError(
                f"ledger version {self.version} was written by a newer dpcore; this one reads "
                f"versions up to {VERSION}"
            )
        if self.neighbouring != NEIGHBOURING:
            raise LedgerError(f"neighbouring must be {NEIGHBOURING!r}, got {self.neighbouring!r}")
        check_record(self.record, self.microbatch_size)

    def to_json(self) -> dict:
        d = {"format": self.format, "version": self.version, "neighbouring": self.neighbouring,
             "record": self.record}
        if self.microbatch_size is not None:
            d["microbatch_size"] = self.microbatch_size
        return d


@dataclass(frozen=True)
class SamplingEvent:
    """Poisson sampling: each of the ``n`` records enters the sample independently with
    probability ``q`` in (0, 1]. ``q = 1`` is a full pass over the data."""

    q: float
    n: int
    kind: str = field(default="sampling", init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "q", check.probability("q", self.q))
        object.__setattr__(self, "n", check.count("n", self.n))


@dataclass(frozen=True)
class SumQueryEvent:
    """A Gaussian sum query over the records of the preceding sampling event.

    Each record's vector for ``group`` is clipped to L2 norm ``clip`` (S_g), the clipped
    vectors are summed and N(0, ``noise_std``^2 I) is added to the *sum* (sigma~_g). For a
    joint group with scales alpha_j, ``clip`` and ``noise_std`` refer to the scaled vector
    (v_j / alpha_j)_j, so vector j receives noise of standard deviation alpha_j * noise_std.
    The query's noise multiplier is noise_std / clip.
    """

    group: str
    clip: float
    noise_std: float
    kind: str = field(default="sum_query", init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.group, str) or not self.group:
            raise ValueError(f"group must be a non-empty string, got {self.group!r}")
        object.__setattr__(self, "clip", check.positive("clip", self.clip))
        object.__setattr__(self, "noise_std", check.non_negative("noise_std", self.noise_std))


Event = Union[SamplingEvent, SumQueryEvent]
_EVENT_TYPES = {"sampling": SamplingEvent, "sum_query": SumQueryEvent}


@dataclass(frozen=True)
class Step:
    """``count`` consecutive steps, each one Poisson-subsampled Gaussian sum query with
    sampling rate ``q`` and noise multiplier ``noise_multiplier`` (z of Eq. (1); ``inf``
    for a step that released no sum)."""

    q: float
    noise_multiplier: float
    count: int = 1


def event_to_json(event: Event) -> dict:
    d = asdict(event)
    kind = d.pop("kind")
    return {"event": kind, **d}


def _event_from_json(obj) -> Event:
    if not isinstance(obj, dict):
        raise LedgerError(f"expected a JSON object, got {type(obj).__name__}")
    kind = obj.get("event")
    if not isinstance(kind, str) or kind not in _EVENT_TYPES:
        raise LedgerError(f"unknown event type {kind!r}; expected one of {sorted(_EVENT_TYPES)}")
    cls = _EVENT_TYPES[kind]
    names = [f for f in cls.__dataclass_fields__ if f != "kind"]
    missing = [f for f in names if f not in obj]
    if missing:
        raise LedgerError(f"{kind} event lacks field(s) {missing}")
    try:
        return cls(**{f: obj[f] for f in names})
    except (TypeError, ValueError) as exc:
        raise LedgerError(f"invalid {kind} event: {exc}") from None


def _unique_keys(pairs) -> dict:
    """A JSON object whose keys are distinct (``json`` would keep the last of repeated ones,
    e.g. a second q on a sampling line)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        keys = [k for k, _ in pairs]
        raise ValueError(f"repeated keys {sorted({k for k in keys if keys.count(k) > 1})}")
    return obj


def _header_from_json(obj) -> Header:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise LedgerError(f"not a dpcore ledger: the first line must be a header with "
                          f"format {FORMAT!r}")
    fields = ("format", "version", "neighbouring", "record", "microbatch_size")
    missing = [f for f in fields[:4] if f not in obj]  # what the guarantee is about
    if missing:
        raise LedgerError(f"invalid header: missing {missing} (only microbatch_size is "
                          f"optional)")
    try:
        return Header(**{f: obj[f] for f in fields if f in obj})
    except (TypeError, ValueError) as exc:
        raise LedgerError(f"invalid header: {exc}") from None


class Ledger:
    """The events of one training run, in memory and, with ``path``, in a JSON Lines file.

    ``Ledger(path)`` creates the file with a header, or reopens an existing ledger (validating
    every line) and appends to it, so a resumed run keeps one ledger. ``Ledger()`` keeps the
    events in memory only. Every :meth:`write` is one ``write`` call followed by a flush (and
    an ``os.fsync`` with ``fsync=True``): a step's events are durable before its result is
    released.

    A torn last line (a crash in the middle of a write) is an error unless
    ``allow_torn_tail=True``; then it is reported with a :class:`LedgerWarning` and cut off,
    which is safe because the events of a step are written before its result is released.

    A ledger file has one writer: ``Ledger(path)`` takes an exclusive lock on it (``flock``,
    where the platform has it) until :meth:`close`, and raises :class:`LedgerError` if another
    open ``Ledger`` (in this or another process) holds it, before reading or changing a byte,
    so two runs cannot interleave their events or truncate each other's. Readers
    (:func:`read_ledger`) take no lock.
    """

    def __init__(self, path: PathLike | None = None, *, record: str = "example",
                 microbatch_size: int | None = None, fsync: bool = False,
                 allow_torn_tail: bool = False):
        self.path = None if path is None else Path(path)
        self.fsync = fsync
        self._file: IO[str] | None = None
        wanted = Header(record=record, microbatch_size=microbatch_size)
        self.header, self._events, self._samplings = wanted, [], 0
        if self.path is None:
            return
        # "a+": created if missing, never truncated by opening; locked before it is read
        try:
            self._file = open(self.path, "a+", encoding="utf-8", newline="\n")
        except OSError as exc:  # a directory, no permission, a missing parent directory
            raise LedgerError(f"cannot open ledger {self.path} for writing: {exc}") from None
        try:
            _lock(self._file, self.path)
            if self._file.seek(0, os.SEEK_END) == 0:
                self._emit([self.header.to_json()])
                return
            header, events, keep, complete = _parse(self.path, allow_torn_tail=allow_torn_tail)
            if (header.record, header.microbatch_size) != (record, microbatch_size):
                raise LedgerError(
                    f"{self.path}: existing ledger is for record={header.record!r}, "
                    f"microbatch_size={header.microbatch_size!r}; this run asked for "
                    f"record={record!r}, microbatch_size={microbatch_size!r}")
            self._adopt(header, events)
            self._file.truncate(keep)
            if not complete:
                self._file.write("\n")  # a crash tore off only the final newline
        except BaseException:
            self.close()
            raise

    def _adopt(self, header: Header, events: list[Event]) -> None:
        """Hold the header and events read from a file."""
        self.header, self._events = header, events
        self._samplings = sum(isinstance(e, SamplingEvent) for e in events)

    @property
    def _sampled(self) -> bool:
        """Whether a sampling event has been recorded (sum queries need one before them)."""
        return bool(self._events) and isinstance(self._events[0], SamplingEvent)

    @property
    def events(self) -> tuple[Event, ...]:
        return tuple(self._events)

    @property
    def event_count(self) -> int:
        """The number of events (a resumed run's included), without copying them."""
        return len(self._events)

    @property
    def samplings(self) -> int:
        """The number of sampling events, i.e. of steps begun (a resumed run's included)."""
        return self._samplings

    def write(self, *events: Event) -> None:
        """Append ``events`` (validated, then written and flushed together)."""
        for event in events:
            if not isinstance(event, (SamplingEvent, SumQueryEvent)):
                raise TypeError(f"expected SamplingEvent or SumQueryEvent, got {event!r}")
        seen_sampling = self._sampled
        for event in events:
            seen_sampling = seen_sampling or isinstance(event, SamplingEvent)
            if isinstance(event, SumQueryEvent) and not seen_sampling:
                raise LedgerError("a sum query must follow a sampling event: record the "
                                  "sampling of the records before querying them")
        if self.path is not None and self._file is None:
            raise LedgerError(f"the ledger {self.path} is closed: {len(events)} event(s) would "
                              f"be kept in memory only and the file would under-report; "
                              f"nothing was written (reopen it with Ledger(path))")
        if self._file is not None:
            self._emit([event_to_json(e) for e in events])
        self._events.extend(events)
        self._samplings += sum(isinstance(e, SamplingEvent) for e in events)

    def record_sampling(self, q: float, n: int) -> SamplingEvent:
        event = SamplingEvent(q=q, n=n)
        self.write(event)
        return event

    def record_sum_queries(self, queries: Sequence[SumQueryEvent]) -> None:
        self.write(*queries)

    def steps(self) -> list[Step]:
        """The ledger reduced to steps (q, z) by Eq. (1), runs of identical steps merged."""
        return merge_steps(_iter_steps(self._events))

    def steps_from(self, start: int) -> tuple[list[Step], int]:
        """The steps of the events from index ``start`` (a sampling event's, or 0) up to the
        last sampling event, whose step may still be receiving queries, and that event's
        index: a reader that keeps the index reads every finished step once."""
        last = next((i for i in range(len(self._events) - 1, start - 1, -1)
                     if isinstance(self._events[i], SamplingEvent)), start)
        return list(_iter_steps(self._events[start:last])), last

    def _emit(self, objs: list[dict]) -> None:
        text = "".join(json.dumps(o, allow_nan=False, separators=(",", ":")) + "\n"
                       for o in objs)
        self._file.write(text)
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = str(self.path) if self.path is not None else "memory"
        return f"Ledger({where}, record={self.header.record!r}, events={len(self._events)})"


def _lock(file: IO[str], path: Path) -> None:
    """An exclusive lock on the open ledger ``file``, held until it is closed; LedgerError if
    another open file holds it. Where the file system cannot lock, a :class:`LedgerWarning`."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): one writer is the caller's to ensure
        return
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise LedgerError(f"{path} is open for writing by another Ledger (in this or another "
                          f"process); a ledger has one writer: close that one first, or give "
                          f"this run its own file") from None
    except OSError as exc:
        warnings.warn(f"{path}: the file system cannot lock the ledger ({exc}); make sure no "
                      f"other run writes to it", LedgerWarning, stacklevel=3)


def read_ledger(path: PathLike, *, allow_torn_tail: bool = False) -> Ledger:
    """Read and validate a ledger file into an in-memory :class:`Ledger` (appending to the
    result does not touch the file; open ``Ledger(path)`` to continue a run)."""
    header, events, _, _ = _parse(Path(path), allow_torn_tail=allow_torn_tail)
    ledger = Ledger(record=header.record, microbatch_size=header.microbatch_size)
    ledger._adopt(header, events)
    return ledger


def _iter_steps(events: Sequence[Event]) -> Iterator[Step]:
    sampling, queries = None, []
    for event in events:
        if isinstance(event, SamplingEvent):
            if sampling is not None:
                yield Step(sampling.q, _noise_multiplier(queries))
            sampling, queries = event, []
        else:
            queries.append(event)
    if sampling is not None:
        yield Step(sampling.q, _noise_multiplier(queries))


def _noise_multiplier(queries: Sequence[SumQueryEvent]) -> float:
    return effective_noise_multiplier((query.clip, query.noise_std) for query in queries)


NOISE_TIE = 1e-12
"""Noise multipliers this close (relative) are one: a step's z is computed from the recorded
``noise_std / clip`` of its queries, which moves it by a few ulps when the clips change (as
under adaptive clipping). Tied values take the smaller, which never lowers epsilon."""


def tied(z1: float, z2: float) -> bool:
    """Whether two noise multipliers are equal up to :data:`NOISE_TIE`."""
    return z1 == z2 or (math.isfinite(z1) and math.isfinite(z2)
                        and abs(z1 - z2) <= NOISE_TIE * max(z1, z2))


def merge_steps(steps: Iterable[Step]) -> list[Step]:
    """Merge runs of consecutive steps with equal q and tied z (the smaller z kept), adding
    their counts."""
    merged: list[Step] = []
    for step in steps:
        if merged and merged[-1].q == step.q and tied(merged[-1].noise_multiplier,
                                                      step.noise_multiplier):
            last = merged.pop()
            step = Step(step.q, min(last.noise_multiplier, step.noise_multiplier),
                        last.count + step.count)
        merged.append(step)
    return merged


_DISTINCT_LINES_KEPT = 4096
_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)


def _json_line(path: Path, number: int, raw: bytes):
    """The JSON value on line ``number`` of the ledger at ``path``."""
    if not raw.strip():
        raise LedgerError(f"{path}, line {number}: blank line (a ledger holds one JSON "
                          f"object per line, with no blank lines; edited by hand?)")
    try:
        return _DECODER.decode(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise LedgerError(f"{path}, line {number}: not valid JSON ({exc})") from None


def _parse(path: Path, *, allow_torn_tail: bool) -> tuple[Header, list[Event], int, bool]:
    """Header, events, the byte length of the valid part of the file at ``path``, and whether
    that part ends with a newline."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise LedgerError(f"cannot read ledger {path}: {exc}") from None
    if not data:
        raise LedgerError(f"{path}: empty file, expected a ledger header on line 1")
    lines = data.split(b"\n")
    complete = lines[:-1]
    tail = lines[-1]  # bytes after the last newline: empty for a well-formed file
    if tail:
        try:
            json.loads(tail)
            complete.append(tail)  # the crash tore off only the newline
            tail = b""
        except (ValueError, RecursionError):  # nested too deep to be an event: not one
            pass
    header, events, sampling_seen = None, [], False
    seen: dict[bytes, Event] = {}  # a run repeats its lines: each distinct one is parsed once
    for number, raw in enumerate(complete, start=1):
        event = seen.get(raw)
        if event is None:
            obj = _json_line(path, number, raw)
            try:
                if number == 1:
                    header = _header_from_json(obj)
                    continue
                event = _event_from_json(obj)
            except LedgerError as exc:
                raise LedgerError(f"{path}, line {number}: {exc}") from None
            if len(seen) == _DISTINCT_LINES_KEPT:
                seen.clear()
            seen[raw] = event
        if isinstance(event, SamplingEvent):
            sampling_seen = True
        elif not sampling_seen:
            raise LedgerError(f"{path}, line {number}: sum query before any sampling event")
        events.append(event)
    keep = len(data)
    if tail:
        number = len(complete) + 1
        if not re.fullmatch(rb"\{[\x20-\x7e]*", tail):  # what the writer's ASCII JSON is not
            raise LedgerError(f"{path}, line {number}: not valid JSON, nor the start of a "
                              f"ledger line (its lines are JSON objects in ASCII text): not a "
                              f"ledger, or damaged")
        message = (f"{path}, line {number}: torn last line ({len(tail)} bytes without a "
                   f"newline; a crash while writing?)")
        if not allow_torn_tail:
            raise LedgerError(message + "; pass allow_torn_tail=True to drop it (safe: a "
                              "step's events are written before its result is released)")
        warnings.warn(message + "; dropped", LedgerWarning, stacklevel=3)
        keep = len(data) - len(tail)
    if header is None:
        raise LedgerError(f"{path}: no header line")
    return header, events, keep, data[:keep].endswith(b"\n")
