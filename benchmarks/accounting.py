"""Accounting benchmark: dpcore's PLD and RDP accountants against dp-accounting and
prv-accountant, timed side by side in one process.

    python benchmarks/accounting.py            # every workload, every accountant
    python benchmarks/accounting.py --quick    # skip the slowest oracle runs

(a) the MNIST example: q = 256/60000, z = 1.1, 14063 steps, delta = 1e-5.
(b) a 100,000-step ledger whose noise multiplier changes at every step: decreasing clip
    C_t = C / min(2, 1 + t/T) with the noise std held fixed, so z_t = 1.1 min(2, 1 + t/T)
    (q = 256/60000). dpcore rounds each z down onto a relative grid of 1e-3 before grouping
    (conservative); rounding *up* instead gives a lower bound for the same ledger, which
    brackets the rounding error. The oracles cannot take 100,000 distinct steps in
    reasonable time, so they are given the same ledger rounded down at resolution 1e-2
    (about 70 groups), and dpcore is timed on that input too.
(c) a budget's question after a clip schedule: how many more steps at q = 0.045, z = 1.6 fit
    in epsilon = 4 (delta = 1e-5) after 70 steps of distinct z from 1.0 to 1.6 (the
    "epsilon" column holds the count): ``remaining_steps`` against the plain search it
    replaced (doubling from 1, then bisecting, every probe priced from scratch).

Each accountant runs ``--repeats`` times (fresh each time), in interleaved rounds so that
changes in machine load hit all alike; the table shows the best run as wall time and as CPU
time of this process (all threads; the steadier figure on a shared machine), and both as
ratios to dpcore PLD on the same input.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import warnings

import numpy as np

from dpcore.accounting import PLDAccountant, RDPAccountant, remaining_steps
from dpcore.accounting.guarantee import MAX_STEPS, _largest_true
from dpcore.accounting.rdp import _step_rdp
from dpcore.accounting.steps import _round_down
from dpcore.ledger import Ledger, SumQueryEvent

DELTA = 1e-5


def dp_accounting_pld(groups):
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    for q, z, count in groups:
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), count)
    return acc.get_epsilon(DELTA)


def dp_accounting_rdp(groups):
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant
    acc = rdp_privacy_accountant.RdpAccountant()
    for q, z, count in groups:
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), count)
    return acc.get_epsilon(DELTA)


def prv(groups):
    """prv-accountant as Opacus configures it (eps_error 0.01, delta_error delta/1000);
    returns the upper bound it reports."""
    from prv_accountant import PoissonSubsampledGaussianMechanism, PRVAccountant
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = PRVAccountant(
            prvs=[PoissonSubsampledGaussianMechanism(sampling_probability=q, noise_multiplier=z)
                  for q, z, _ in groups],
            max_self_compositions=[c for _, _, c in groups], eps_error=0.01,
            delta_error=DELTA / 1000)
        return acc.compute_epsilon(delta=DELTA, num_self_compositions=[c for _, _, c in groups])[2]


def decreasing_clip_ledger(steps=100_000, q=256 / 60000, noise_std=1.1, clip=1.0) -> Ledger:
    ledger = Ledger()
    for t in range(steps):
        ledger.record_sampling(q, 60000)
        ledger.record_sum_queries(
            [SumQueryEvent("grads", clip / min(2.0, 1.0 + t / steps), noise_std)])
    return ledger


def grouped(steps, resolution, direction="down"):
    """(q, z, count) groups with z rounded onto the grid (1 - resolution)^k."""
    q = np.array([s.q for s in steps])
    z = np.array([s.noise_multiplier for s in steps])
    c = np.array([s.count for s in steps])
    zr = _round_down(z, resolution)
    if direction == "up":
        zr = np.where(zr < z, zr / (1 - resolution), zr)
    keys, inverse = np.unique(q + 1j * zr, return_inverse=True)
    counts = np.bincount(inverse.reshape(-1), weights=c)
    return [(k.real, k.imag, int(n)) for k, n in zip(keys, counts)]


def rdp(source, **options):
    """dpcore's RDP epsilon, its per-step values computed afresh (they are kept per process)."""
    _step_rdp.cache_clear()
    return RDPAccountant(source, **options).epsilon(DELTA)


def run_rows(table, workload, rows, repeats):
    """Time ``rows`` [(name, fn, repeats or None)] interleaved: each round runs every row
    once, so changes in machine load hit all of them alike."""
    rows = [row for row in rows if row[2] != 0]  # a limit of 0 rounds: skipped (--quick)
    results = {name: ([], [], []) for name, _, _ in rows}
    failed = {}
    for round_ in range(repeats):
        for name, fn, limit in rows:
            if name in failed or (limit is not None and round_ >= limit):
                continue
            try:
                wall, cpu = time.perf_counter(), time.process_time()
                value = fn()
                results[name][0].append(value)
                results[name][1].append(time.perf_counter() - wall)
                results[name][2].append(time.process_time() - cpu)
            except Exception as exc:  # an oracle that cannot run this input
                failed[name] = f"failed: {exc}"
    for name, _, _ in rows:
        if name in failed:
            table.append((workload, name, math.nan, math.nan, math.nan, failed[name]))
            print(f"  {name:<52} {failed[name]}", flush=True)
            continue
        values, walls, cpus = results[name]
        eps, wall, cpu = values[-1], min(walls), min(cpus)
        table.append((workload, name, eps, wall, cpu, ""))
        print(f"  {name:<52} eps = {eps:.6f}  wall {wall:8.3f} s  cpu {cpu:8.3f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true",
                        help="skip dp-accounting PLD and prv-accountant on workload (b)")
    args = parser.parse_args()
    table = []

    print("(a) MNIST example: q = 256/60000, z = 1.1, T = 14063, delta = 1e-5", flush=True)
    mnist = [(256 / 60000, 1.1, 14063)]
    PLDAccountant(mnist).epsilon(DELTA)  # warm up imports and FFT plans
    dp_accounting_pld(mnist)
    run_rows(table, "a", [
        ("dpcore PLD (h = 1e-4)", lambda: PLDAccountant(mnist).epsilon(DELTA), None),
        ("dpcore RDP", lambda: rdp(mnist), None),
        ("dp-accounting PLD (1e-4)", lambda: dp_accounting_pld(mnist), None),
        ("dp-accounting RDP", lambda: dp_accounting_rdp(mnist), None),
        ("prv-accountant (upper bound, Opacus settings)", lambda: prv(mnist), 3),
    ], args.repeats)

    print("(b) 100,000 steps, z_t = 1.1 min(2, 1 + t/T) (decreasing clip), q = 256/60000",
          flush=True)
    start = time.perf_counter()
    ledger = decreasing_clip_ledger()
    steps = ledger.steps()
    print(f"  (building the in-memory ledger and reducing it: "
          f"{time.perf_counter() - start:.1f} s, {len(steps)} distinct steps; not timed below)")
    up = grouped(steps, 1e-3, "up")
    coarse = grouped(steps, 1e-2)
    slow = 0 if args.quick else 1
    run_rows(table, "b", [
        ("dpcore PLD from the ledger (z rounded down, 1e-3)",
         lambda: PLDAccountant(ledger).epsilon(DELTA), None),
        ("dpcore RDP from the ledger (z rounded down, 1e-3)",
         lambda: rdp(ledger), None),
        (f"dpcore PLD, z rounded UP (lower bracket, {len(up)} groups)",
         lambda: PLDAccountant(up, noise_resolution=None).epsilon(DELTA), 1),
        (f"dpcore PLD on {len(coarse)} groups (1e-2)",
         lambda: PLDAccountant(coarse, noise_resolution=None).epsilon(DELTA), None),
        (f"dpcore RDP on {len(coarse)} groups (1e-2)",
         lambda: rdp(coarse, noise_resolution=None), None),
        (f"dp-accounting RDP on {len(coarse)} groups", lambda: dp_accounting_rdp(coarse), 1),
        (f"dp-accounting PLD (1e-4) on {len(coarse)} groups",
         lambda: dp_accounting_pld(coarse), slow),
        (f"prv-accountant on {len(coarse)} groups", lambda: prv(coarse), slow),
    ], args.repeats)

    print("(c) remaining steps at q = 0.045, z = 1.6 within epsilon 4 after 70 distinct z",
          flush=True)
    past = [(0.045, float(z), 1) for z in np.linspace(1.0, 1.6, 70)]

    def plain_search():
        return _largest_true(lambda k: k == 0 or PLDAccountant(past + [(0.045, 1.6, k)])
                             .epsilon(DELTA) <= 4.0, MAX_STEPS)

    def remaining(accountant):
        _step_rdp.cache_clear()
        return remaining_steps(past, 0.045, 1.6, 4.0, DELTA, accountant=accountant)

    run_rows(table, "c", [
        ("dpcore PLD remaining_steps", lambda: remaining("pld"), 1),
        ("dpcore RDP remaining_steps", lambda: remaining("rdp"), 1),
        ("plain search, PLD priced from scratch at every probe", plain_search, slow),
    ], args.repeats)

    print(f"\nload average at the end: {os.getloadavg()}  (2 cores; wall times grow with load, "
          "CPU times much less)")
    print("\n| workload | accountant | epsilon | wall (s) | CPU (s) | wall ratio | CPU ratio |")
    print("|---|---|---|---|---|---|---|")
    reference = {}
    for workload, name, eps, wall, cpu, note in table:
        key = "b-coarse" if (workload == "b" and " groups (1e-2)" in name) else workload
        if name.startswith("dpcore PLD") and key not in reference:
            reference[key] = (wall, cpu)
    for workload, name, eps, wall, cpu, note in table:
        coarse_row = workload == "b" and " groups" in name and "UP" not in name
        ref_wall, ref_cpu = reference.get("b-coarse" if coarse_row else workload,
                                          (math.nan, math.nan))
        if math.isfinite(cpu):
            ratios = f"{wall / ref_wall:.1f}x | {cpu / ref_cpu:.1f}x"
        else:
            ratios = f"{note} |"
        print(f"| ({workload}) | {name} | {eps:.4f} | {wall:.3f} | {cpu:.3f} | {ratios} |")


if __name__ == "__main__":
    main()
