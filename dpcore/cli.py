"""The ``dpcore`` command: privacy accounting from the shell.

    dpcore epsilon --sampling-rate Q --noise-multiplier Z --steps T --delta D [--accountant pld|rdp] [--json]
    dpcore calibrate --target-epsilon E --delta D  (two of --sampling-rate, --steps, --noise-multiplier)
    dpcore ledger epsilon FILE --delta D
    dpcore ledger show FILE
    dpcore ledger plot FILE -o FILE.png --delta D
    dpcore conformance NAME [PYTEST ARGS...]

Bad input ends with a one-line message on stderr and exit status 2 (as for usage errors).
Each subcommand is one ``add_parser`` call in :func:`build_parser` with a ``run`` default;
``run`` may return an exit status (``conformance`` returns pytest's).
"""

from __future__ import annotations

import argparse
import decimal
import json
import math
import sys
import warnings
from typing import Sequence

EXIT_BAD_INPUT = 2
UP, DOWN = decimal.ROUND_CEILING, decimal.ROUND_FLOOR


class CommandError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def _fmt(x, rounding: str | None = None) -> str:
    """``x`` to 6 significant digits; ``rounding`` ``decimal.ROUND_CEILING`` or
    ``ROUND_FLOOR`` makes the digits a bound on ``x`` (an epsilon or a solved z printed above
    its value, a solved q below), where rounding to nearest could cross it."""
    if not isinstance(x, float):
        return str(x)
    if math.isinf(x):
        return "inf"
    if rounding is None or x == 0 or float(f"{x:.6g}") == x:
        return f"{x:.6g}"
    exact = decimal.Decimal(x)
    digits = exact.quantize(decimal.Decimal(1).scaleb(exact.adjusted() - 5), rounding=rounding)
    return f"{digits:.6g}"


def _emit(args, obj: dict, text: str) -> None:
    if args.json:
        print(json.dumps(_finite(obj), allow_nan=False))
    else:
        print(text)


def _finite(value):
    """``value`` with every infinite float, at any depth, as the string "inf" (JSON has no
    infinity)."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# --------------------------------------------------------------------------- epsilon

def _cmd_epsilon(args) -> None:
    from .accounting import guarantee
    g = guarantee([(args.sampling_rate, args.noise_multiplier, args.steps)], args.delta,
                  accountant=args.accountant)
    obj = {"epsilon": g.epsilon, "delta": g.delta, "accountant": g.accountant,
           "sampling_rate": args.sampling_rate, "noise_multiplier": args.noise_multiplier,
           "steps": args.steps}
    if g.order is not None:
        obj["order"] = g.order
    extra = f" (RDP order {_fmt(g.order)})" if g.order is not None else ""
    _emit(args, obj, f"epsilon = {_fmt(g.epsilon, UP)} at delta = {_fmt(g.delta)} "
                     f"[{g.accountant}]{extra}")


# --------------------------------------------------------------------------- calibrate

def _cmd_calibrate(args) -> None:
    from .accounting import (calibrate_noise_multiplier, calibrate_sampling_rate,
                             calibrate_steps, epsilon)
    from .accounting.guarantee import MAX_STEPS
    given = {name: getattr(args, name) for name in ("sampling_rate", "steps", "noise_multiplier")
             if getattr(args, name) is not None}
    if len(given) != 2:
        raise CommandError("give exactly two of --sampling-rate, --steps and "
                           f"--noise-multiplier (got {len(given)}); the third is solved for")
    q, T, z = args.sampling_rate, args.steps, args.noise_multiplier
    kw = dict(accountant=args.accountant)
    if z is None:
        solved = "noise_multiplier"
        z = calibrate_noise_multiplier(args.target_epsilon, args.delta, q, T, **kw)
    elif q is None:
        solved = "sampling_rate"
        q = calibrate_sampling_rate(args.target_epsilon, args.delta, z, T, **kw)
    else:
        solved = "steps"
        T = calibrate_steps(args.target_epsilon, args.delta, q, z, **kw)
    achieved = epsilon([(q, z, T)], args.delta, **kw) if T > 0 else 0.0
    obj = {"solved_for": solved, "sampling_rate": q, "noise_multiplier": z, "steps": T,
           "epsilon": achieved, "target_epsilon": args.target_epsilon, "delta": args.delta,
           "accountant": args.accountant}
    value = {"noise_multiplier": z, "sampling_rate": q, "steps": T}[solved]
    capped = solved == "steps" and T == MAX_STEPS
    if capped:
        obj["steps_capped"] = True
    bound = {"noise_multiplier": UP, "sampling_rate": DOWN, "steps": None}[solved]
    _emit(args, obj, f"{solved} = {_fmt(value, bound)}"
                     f"{' (the most searched)' if capped else ''}  (epsilon = "
                     f"{_fmt(achieved, UP)} <= {_fmt(args.target_epsilon)} at delta = "
                     f"{_fmt(args.delta)} [{args.accountant}])")


# --------------------------------------------------------------------------- ledger

def _read(args):
    """The ledger at ``args.file``; what was tolerated in it is printed as one line each."""
    from .ledger import LedgerWarning, read_ledger
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LedgerWarning)
        ledger = read_ledger(args.file, allow_torn_tail=args.allow_torn_tail)
    for warning in caught:
        print(f"dpcore: warning: {warning.message}", file=sys.stderr)
    return ledger


def _cmd_ledger_epsilon(args) -> None:
    from .accounting import guarantee
    g = guarantee(_read(args), args.delta, accountant=args.accountant)
    obj = {"epsilon": g.epsilon, "delta": g.delta, "accountant": g.accountant,
           "steps": g.steps, "file": args.file}
    if g.order is not None:
        obj["order"] = g.order
    if g.rounded:
        obj["noise_rounded_down"] = True
    _emit(args, obj, f"epsilon = {_fmt(g.epsilon, UP)} at delta = {_fmt(g.delta)} after "
                     f"{g.steps} steps [{g.accountant}]")


def _cmd_ledger_show(args) -> None:
    from .ledger import SamplingEvent
    ledger = _read(args)
    steps = ledger.steps()
    n_sampling = sum(isinstance(e, SamplingEvent) for e in ledger.events)
    groups = sorted({e.group for e in ledger.events if not isinstance(e, SamplingEvent)})
    header = ledger.header.to_json()
    obj = {"file": args.file, "header": header, "events": len(ledger.events),
           "steps": n_sampling, "groups": groups,
           "runs": [{"q": s.q, "noise_multiplier": s.noise_multiplier, "count": s.count}
                    for s in steps]}
    lines = [f"{args.file}: {header['format']} v{header['version']}, record = "
             f"{header['record']}, neighbouring = {header['neighbouring']}",
             f"{len(ledger.events)} events, {n_sampling} steps, query groups: "
             f"{', '.join(groups) or '-'}",
             f"{len(steps)} runs of identical steps (q, z by Eq. (1)):"]
    shown = steps if args.all or len(steps) <= 20 else steps[:10] + [None] + steps[-10:]
    for s in shown:
        lines.append("  ..." if s is None else
                     f"  {s.count:>8} x  q = {_fmt(s.q)}, z = {_fmt(s.noise_multiplier)}")
    _emit(args, obj, "\n".join(lines))


def _prefix_epsilons(steps, points: int, delta: float, accountant: str):
    """(step index, epsilon) after each of ``points`` evenly spaced prefixes of ``steps``."""
    from .accounting import epsilon
    from .ledger import Step
    total = sum(s.count for s in steps)
    marks = sorted({max(1, round(total * (i + 1) / points)) for i in range(points)})
    out = []
    for mark in marks:
        prefix, left = [], mark
        for s in steps:
            if left <= 0:
                break
            prefix.append(Step(s.q, s.noise_multiplier, min(s.count, left)))
            left -= s.count
        out.append((mark, epsilon(prefix, delta, accountant=accountant)))
    return out


def _cmd_ledger_plot(args) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CommandError("ledger plot needs matplotlib: install dpcore[plot]") from None
    if args.points < 1:
        raise CommandError(f"--points must be >= 1, got {args.points}")
    ledger = _read(args)
    steps = ledger.steps()
    if not steps:
        raise CommandError(f"{args.file}: the ledger has no steps to plot")
    series = _prefix_epsilons(steps, args.points, args.delta, args.accountant)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([s for s, _ in series], [e for _, e in series], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel(f"epsilon at delta = {args.delta:g}")
    ax.set_title(f"{args.file} [{args.accountant}]", fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(args.output)
    except (OSError, ValueError) as exc:
        raise CommandError(f"cannot write {args.output}: {exc}") from None
    finally:
        plt.close(fig)
    obj = {"file": args.file, "output": args.output, "delta": args.delta,
           "accountant": args.accountant, "epsilon": series[-1][1], "steps": series[-1][0],
           "points": [{"step": s, "epsilon": e} for s, e in series]}
    _emit(args, obj, f"wrote {args.output} ({len(series)} points; final epsilon = "
                     f"{_fmt(series[-1][1], UP)} at delta = {_fmt(args.delta)})")


# --------------------------------------------------------------------------- conformance

def _cmd_conformance(args) -> int:
    from .plugins import get_backend

    try:
        get_backend(args.backend)
    except LookupError as exc:
        raise CommandError(str(exc)) from None
    from dpcore_conformance import run

    return run(args.backend, *args.pytest_args)


# --------------------------------------------------------------------------- parser

def _common(parser, *, delta=True, accountant=True):
    if delta:
        parser.add_argument("--delta", type=float, required=True,
                            help="delta of the (epsilon, delta) guarantee, in (0, 1)")
    if accountant:
        parser.add_argument("--accountant", choices=("pld", "rdp"), default="pld",
                            help="pld (privacy loss distributions, tightest; default) or rdp")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpcore",
        description="Differential privacy accounting for Poisson-subsampled Gaussian "
                    "mechanisms (DP-SGD) under add-or-remove-one-record neighbouring. "
                    "Epsilon is always an upper bound.",
        epilog="Conventions: --noise-multiplier 0 gives epsilon = inf; --sampling-rate 0 "
               "gives 0. See docs/cli.md.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("epsilon", help="epsilon of T steps at (q, z)",
                       description="Epsilon of T Poisson-subsampled Gaussian steps.")
    p.add_argument("--sampling-rate", "-q", type=float, required=True,
                   help="Poisson sampling rate q in [0, 1] (batch size / dataset size)")
    p.add_argument("--noise-multiplier", "-z", type=float, required=True,
                   help="noise std / clipping norm, z >= 0")
    p.add_argument("--steps", "-T", type=int, required=True, help="number of steps, >= 0")
    _common(p)
    p.set_defaults(run=_cmd_epsilon)

    p = sub.add_parser("calibrate", help="solve for z, q or T given a target epsilon",
                       description="Give two of --sampling-rate, --steps, --noise-multiplier; "
                                   "the third is solved so that epsilon <= target.")
    p.add_argument("--target-epsilon", type=float, required=True, help="target epsilon > 0")
    p.add_argument("--sampling-rate", "-q", type=float, help="Poisson sampling rate in (0, 1]")
    p.add_argument("--steps", "-T", type=int, help="number of steps, >= 1")
    p.add_argument("--noise-multiplier", "-z", type=float, help="noise multiplier > 0")
    _common(p)
    p.set_defaults(run=_cmd_calibrate)

    ledger = sub.add_parser("ledger", help="inspect a privacy ledger file",
                            description="Read a dpcore ledger (JSON Lines).")
    lsub = ledger.add_subparsers(dest="ledger_command", metavar="ACTION", required=True)

    def ledger_parser(name, help_, run, **common):
        lp = lsub.add_parser(name, help=help_, description=help_)
        lp.add_argument("file", metavar="FILE", help="ledger file")
        lp.add_argument("--allow-torn-tail", action="store_true",
                        help="drop a torn last line (a crash mid-write) instead of failing")
        _common(lp, **common)
        lp.set_defaults(run=run)
        return lp

    ledger_parser("epsilon", "epsilon spent by the steps in a ledger", _cmd_ledger_epsilon)
    lp = ledger_parser("show", "summarise a ledger: header, events, runs of steps",
                       _cmd_ledger_show, delta=False, accountant=False)
    lp.add_argument("--all", action="store_true", help="list every run of steps")
    lp = ledger_parser("plot", "plot epsilon against step (needs matplotlib)",
                       _cmd_ledger_plot)
    lp.add_argument("-o", "--output", required=True, metavar="PNG", help="image file to write")
    lp.add_argument("--points", type=int, default=20,
                    help="number of points (default 20; each is one accountant run, so use "
                         "--accountant rdp for long ledgers whose z changes at every step)")
    p = sub.add_parser("conformance", help="run the conformance suite against a backend",
                       description="Run the dpcore conformance suite (pytest) against a "
                                   "registered backend; extra arguments go to pytest.")
    p.add_argument("backend", metavar="NAME", help="registered backend name")
    remainder = p.add_argument("pytest_args", nargs=argparse.REMAINDER, metavar="PYTEST ARGS",
                               help="passed to pytest, e.g. -q or -k noise")
    remainder.required = False  # argparse makes a REMAINDER positional required: it is not
    p.set_defaults(run=_cmd_conformance)
    return parser


def _attached_negative_values(argv: Sequence[str]) -> list[str]:
    """``argv`` with each option followed by a negative number written ``--option=-1e-5``.

    argparse takes only ``-1`` and ``-.5`` for negative numbers; ``-1e-5`` or ``-inf`` it
    reads as an unknown option and reports a missing value, hiding the range error that
    names the value. Pytest's arguments after ``conformance`` are passed on as they are.
    """
    argv = list(argv)
    if argv[:1] == ["conformance"]:
        return argv
    out: list[str] = []
    for token in argv:
        if out and _is_negative_number(token) and out[-1].startswith("-") \
                and "=" not in out[-1] and not _is_negative_number(out[-1]):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _is_negative_number(token: str) -> bool:
    if not token.startswith("-"):
        return False
    try:
        float(token)
    except ValueError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_attached_negative_values(sys.argv[1:] if argv is None else argv))
    from .ledger import LedgerError
    try:
        status = args.run(args)
    except BrokenPipeError:  # output piped into e.g. `head`, which closed it: not an error
        sys.stderr.close()
        return 0
    except (CommandError, LedgerError, ValueError, TypeError, OSError) as exc:
        # the library's advice in the shell's words
        message = " ".join(str(exc).split()).replace("accountant='rdp'", "--accountant rdp")
        print(f"dpcore: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
