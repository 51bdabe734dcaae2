"""DP step time and peak memory of dpcore's PyTorch backend against the non-private step and
Opacus (hooks, ghost, functorch), on the workloads of :mod:`torch_models`.

    python benchmarks/torch_step.py                  # all workloads, all modes
    python benchmarks/torch_step.py --workloads mlp --seconds 20
    python benchmarks/torch_step.py --workloads lstm --modes non-private dpcore opacus-hooks \
        opacus-ghost opacus-functorch              # dpcore-vmap cannot vmap a fused LSTM
    python benchmarks/torch_step.py --workloads encoder vit --seconds 40
    python benchmarks/torch_step.py --workloads gpt2 --modes non-private dpcore dpcore-replay \
        dpcore-vmap opacus-hooks opacus-ghost opacus-functorch --seconds 40
    python benchmarks/torch_step.py --workloads cifar cifar-bn --modes non-private dpcore \
        --seconds 20                                # BatchNorm: private statistics

A *step* is zero_grad, forward, cross-entropy (mean), backward and optimizer.step (SGD) on a
fixed batch, so every mode does the same work (the DP modes: flat clipping at 1.0, noise
multiplier 1.0, q n = B; dpcore releases a BatchNorm's statistics privately, clip 8 and
multiplier 8, where the non-private step uses the batch's). The compiled modes trace the
gradient into one graph compiled by TorchInductor: ``dpcore-compiled`` is
:class:`dpcore_torch.CompiledPrivateStep` (its batch padded to its bucket, its ledger written
every step), ``non-private-compiled`` the same tracing of ``torch.func.grad`` of the mean loss
without DP (like for like), ``non-private-torch-compile`` the model under ``torch.compile``
(PyTorch's usual way); the optimizer step stays eager. ``x best`` is a mode's time against the
fastest non-private mode's.

Time: all modes of a workload live in one process and are timed round-robin, so drift of the
machine hits them alike: each round runs a *block* of ``--block`` consecutive steps of each mode
(after warm-up), the first step of a block is not timed, and we report the median of the timed
steps over about ``--seconds`` of rounds (60 by default). Consecutive steps measure the steady
state of a training loop, which runs one kind of step: with one step of each mode per round,
every step started from caches the other modes had filled, which slowed the non-private step
more than dpcore's (transformer, all six modes: non-private 28.4 ms and 1.47x, in blocks
24.5 ms and 1.54x; docs/benchmarks-history.md, tenth session). The default block is the number of
non-private steps in 0.1 s, at least 5 and at most 100.

Memory: each (workload, mode) runs in a fresh subprocess that builds the model, optimizer and
batch, records its resident set size (RSS, /proc/self/statm), resets the kernel's peak-RSS
counter (/proc/self/clear_refs), runs the first two steps and reads the peak (VmHWM in
/proc/self/status), then resets the counter again, runs three more steps and reads the peak.
Peak memory of a step = peak RSS - RSS before the first step: it counts every allocation of
the step (activations, backprops, per-example gradients, noise), including torch's and the
allocator's. The ratios are those of the later steps (a training loop's steady state); the
first two steps' peak, which holds one-time work (dpcore's independence check of the model on
both, its timing of convolution forms), is printed beside them. The child runs with
MALLOC_MMAP_THRESHOLD_=65536, so glibc maps every block above 64 KiB separately and returns it
on free (by default the threshold grows with freed blocks and RSS keeps freed memory), and RSS
follows live memory; small allocations may stay cached, which inflates all modes alike a little.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import one_round  # noqa: E402
from torch_models import Conv1D, workload  # noqa: E402

MODES = ("non-private", "non-private-compiled", "non-private-torch-compile", "dpcore",
         "dpcore-compiled", "dpcore-vmap", "opacus-hooks", "opacus-ghost", "opacus-functorch")
NON_PRIVATE = ("non-private", "non-private-compiled", "non-private-torch-compile")
SETTLE = {"dpcore-compiled": 1, "non-private-compiled": 0, "non-private-torch-compile": 0}
EXTRA_MODES = ("dpcore-replay",)  # gpt2: its Conv1D left to the per-layer replay
WORKLOADS = ("cnn", "mlp", "transformer")  # issue 4's
EXTRA_WORKLOADS = ("encoder", "lstm", "cifar", "cifar-bn", "vit", "gpt2")  # on request


def build(name: str, mode: str):
    """A ``step()`` closure for workload ``name`` in ``mode``."""
    from torch.utils.data import DataLoader, TensorDataset

    model, x, y = workload(name, replayed=mode == "dpcore-replay")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = torch.nn.CrossEntropyLoss()
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))  # q n = B
    if mode in ("dpcore-compiled", "non-private-compiled"):
        return compiled_step(model, opt, x, y, private=mode == "dpcore-compiled")
    if mode == "non-private-torch-compile":
        model = torch.compile(model)
    if mode.startswith("dpcore"):
        from dpcore_torch import BatchNormStatistics, make_private, register_linear

        register_linear(Conv1D, transposed=True)  # gpt2's projections (dpcore-replay: a
        # subclass, not registered)
        norms = any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
        model, opt, _ = make_private(model, opt, loader, noise_multiplier=1.0, max_grad_norm=1.0,
                                     mode="vmap" if mode == "dpcore-vmap" else "auto", seed=0,
                                     batch_norm=BatchNormStatistics(8.0, 8.0) if norms else None)
    elif mode.startswith("opacus"):
        from opacus import PrivacyEngine

        warnings.filterwarnings("ignore")
        if name in ("lstm", "encoder", "vit"):  # Opacus's DPLSTM, DPMultiheadAttention in
            from opacus.validators import ModuleValidator

            model = ModuleValidator.fix(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
        engine = PrivacyEngine(accountant="rdp")
        grad_mode = mode.split("-")[1]
        grad_mode = "hooks" if grad_mode == "hooks" else grad_mode
        out = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                  noise_multiplier=1.0, max_grad_norm=1.0, criterion=criterion,
                                  poisson_sampling=False, grad_sample_mode=grad_mode)
        model, opt = out[0], out[1]
        if grad_mode == "ghost":
            criterion = out[2]

    def step():
        opt.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()

    return step


def compiled_step(model, opt, x, y, *, private: bool):
    """A ``step()`` of the whole gradient computation traced into one graph (``make_fx``) and
    compiled by TorchInductor: dpcore's :class:`~dpcore_torch.CompiledPrivateStep` (flat
    clipping at 1.0, noise multiplier 1.0, q n = B; the batch padded to its bucket), or
    without DP the same tracing of ``torch.func.grad`` of the mean loss (like for like); the
    optimizer step stays eager in both."""
    import dpcore
    from dpcore_torch import CompiledPrivateStep

    per_example = torch.nn.CrossEntropyLoss(reduction="none")
    if private:
        names = [k for k, p in model.named_parameters() if p.requires_grad]
        aggregator = dpcore.PrivateAggregator(
            dpcore.flat(names, clip=1.0, noise_multiplier=1.0), n=10 * len(x), q=0.1,
            backend="torch", seed=0)
        gradient = CompiledPrivateStep(model, per_example, aggregator)

        def step():
            opt.zero_grad()
            gradient(x, y)
            opt.step()
        return step

    from torch.fx.experimental.proxy_tensor import make_fx

    def grads(params, buffers, x, y):
        def loss(p):
            return per_example(torch.func.functional_call(model, {**p, **buffers}, (x,)),
                               y).mean()
        return torch.func.grad(loss)(params)

    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    program = torch.compile(make_fx(grads, tracing_mode="fake")(
        {k: p.detach() for k, p in params.items()}, buffers, x, y), fullgraph=True,
        dynamic=False)

    def step():
        opt.zero_grad()
        for k, g in program({k: p.detach() for k, p in params.items()}, buffers, x, y).items():
            params[k].grad = g
        opt.step()
    return step


def working_steps(name: str, modes) -> tuple[dict, dict[str, str]]:
    """({mode: step} of the modes that run the workload, {mode: error} of those that fail
    to build it or to take a step), after three steps of each (lazy initialisation,
    allocator growth)."""
    steps, failed = {}, {}
    for mode in modes:
        try:
            step = build(name, mode)
            for _ in range(3):
                step()
        except Exception as error:  # reported beside the others' times
            failed[mode] = f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"
        else:
            steps[mode] = step
    return steps, failed


def time_modes(name: str, modes, *, seconds: float = 60.0, rounds: int | None = None,
               block: int | None = None) -> tuple[dict[str, float], int, int, dict]:
    """(median step time per mode, rounds, block, failed modes): the modes are timed
    round-robin, ``block`` consecutive steps of each per round (the first of each block not
    timed), for ``rounds`` rounds or as many as fill about ``seconds`` (at least 5, the cost
    of a round estimated from the warm-up), after a tenth as many more warm-up rounds (a
    sub-millisecond step settles only after hundreds of steps)."""
    steps, failed = working_steps(name, modes)
    if block is None:
        start = time.perf_counter()
        for _ in range(3):
            steps.get("non-private", next(iter(steps.values())))()
        block = min(100, max(5, math.ceil(0.1 / ((time.perf_counter() - start) / 3))))

    start = time.perf_counter()
    one_round(steps, block - 1)
    if rounds is None:
        rounds = max(5, math.ceil(seconds / (time.perf_counter() - start)))
    for _ in range(rounds // 10):
        one_round(steps, block - 1)
    times = {mode: [] for mode in steps}
    for _ in range(rounds):
        one_round(steps, block - 1, times)
    return {mode: statistics.median(t) for mode, t in times.items()}, rounds, block, failed


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def peak_memory(name: str, mode: str, steps: int = 3) -> tuple[int, int]:
    """Bytes (first two steps, the ``steps`` steps after them): peak RSS during them minus
    RSS before the first step (run in this process).

    Writing 5 to /proc/self/clear_refs resets the kernel's peak-RSS counter (VmHWM) to the
    current RSS, so the set-up (imports, model) and the first steps do not count in the
    later steps' peak. A compiled mode settles first (``SETTLE``: dpcore-compiled's third step
    traces and compiles its program) and its later steps are measured from the RSS before
    them: the compiled code and Inductor's state stay loaded for the rest of the run, they are
    not a step's memory."""
    step = build(name, mode)
    before = _rss()
    peaks = []
    for count, settle in ((2, 0), (steps, SETTLE.get(mode))):
        if settle is not None:
            for _ in range(settle):
                step()
            before = _rss()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        for _ in range(count):
            step()
        peaks.append(_peak_rss() - before)
    return peaks[0], peaks[1]


def memory_in_subprocess(name: str, mode: str) -> tuple[int, int] | None:
    cmd = [sys.executable, __file__, "--memory-child", name, mode]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        print(f"  memory of {name}/{mode} failed: {out.stderr.strip().splitlines()[-1]}")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS),
                        choices=WORKLOADS + EXTRA_WORKLOADS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES + EXTRA_MODES)
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="time each workload's modes for about this long (default 60)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds (instead of --seconds)")
    parser.add_argument("--block", type=int, default=None,
                        help="consecutive steps of each mode per round (default: the "
                             "non-private steps in 0.1 s, 5 to 100)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        print(json.dumps(peak_memory(*args.memory_child)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.workloads:
        med, rounds, block, failed = time_modes(name, args.modes, seconds=args.seconds,
                                                rounds=args.rounds, block=args.block)
        mem = {} if args.no_memory else {m: memory_in_subprocess(name, m) for m in med}
        base_t = med.get("non-private")
        best = min((med[m] for m in NON_PRIVATE if m in med), default=None)
        base_m = mem.get("non-private", (None, None))[1]
        print(f"\n{name} ({rounds} rounds of {block} steps per mode)")
        print(f"  {'mode':<26} {'step ms':>8} {'x time':>7} {'x best':>7} {'peak MiB':>9} "
              f"{'x memory':>9} {'first 2 steps MiB':>18}")
        for mode, error in failed.items():
            print(f"  {mode:<26} fails: {error}")
        for mode in med:
            t = med[mode] * 1e3
            rt = f"{med[mode] / base_t:.2f}" if base_t else "-"
            rb = f"{med[mode] / best:.2f}" if best else "-"
            first, m = mem.get(mode) or (None, None)
            ms = f"{m / 2**20:.1f}" if m is not None else "-"
            rm = f"{m / base_m:.2f}" if m is not None and base_m else "-"
            fs = f"{first / 2**20:.1f}" if first is not None else "-"
            print(f"  {mode:<26} {t:8.2f} {rt:>7} {rb:>7} {ms:>9} {rm:>9} {fs:>18}")


if __name__ == "__main__":
    main()
