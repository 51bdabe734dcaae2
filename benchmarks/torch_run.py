"""A whole private training run, eager against compiled: Poisson samples of expected size B
from n = 20 B records of a workload of :mod:`torch_models`, ``--steps`` steps of SGD, timed
end to end (sampling, indexing, padding, every trace and compilation included), with the
number of programs the compiled step built.

Both runs index the records' tensors with the aggregator's samples (a ``DataLoader`` that
collates 512 records one by one would add the same tens of milliseconds to both):
:func:`dpcore_torch.private_grads` after an eager forward and backward pass, and
:class:`dpcore_torch.CompiledPrivateStep` (the default buckets, or ``--granularity``); one after
the other in this process, each on a fresh model; flat clipping at 1.0, noise multiplier 1.0.
Inductor's on-disk cache is a new temporary directory (a first run on a machine) unless
``--warm-cache`` keeps the default one.

    python benchmarks/torch_run.py --workload mlp --steps 2000
    python benchmarks/torch_run.py --workload mlp --steps 2000 --granularity 96
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

if "--warm-cache" not in sys.argv:  # before torch reads it
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="dpcore-inductor-")

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_models import workload  # noqa: E402


def setting(name: str):
    """(model, records x, y, aggregator) with n = 20 B records (the workload's batch
    repeated) sampled at q = 1/20."""
    import dpcore

    model, x, y = workload(name)
    batch = len(x)
    x, y = x.repeat(20, *[1] * (x.dim() - 1)), y.repeat(20)
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    agg = dpcore.PrivateAggregator(dpcore.flat(names, clip=1.0, noise_multiplier=1.0),
                                   n=len(x), q=batch / len(x), backend="torch", seed=0)
    return model, x, y, agg


def eager_run(name: str, steps: int) -> float:
    from dpcore_torch import PerExampleEngine, private_grads

    model, x, y, agg = setting(name)
    engine = PerExampleEngine(model, loss_reduction="sum")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = time.perf_counter()
    for _ in range(steps):
        idx = torch.as_tensor(agg.sample())
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="sum")
        for k, g in private_grads(engine, agg, loss).items():
            engine.params[k].grad = g
        opt.step()
    return time.perf_counter() - start


def compiled_run(name: str, steps: int, granularity: int | None) -> tuple[float, int]:
    import dpcore
    from dpcore_torch import CompiledPrivateStep

    model, x, y, agg = setting(name)
    buckets = None if granularity is None else dpcore.Buckets(
        agg.expected_size, granularity=granularity)
    step = CompiledPrivateStep(model, nn.CrossEntropyLoss(reduction="none"), agg,
                               buckets=buckets)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = time.perf_counter()
    for _ in range(steps):
        idx = torch.as_tensor(agg.sampler.sample())  # the step writes its sampling event
        opt.zero_grad()
        step(x[idx], y[idx])
        opt.step()
    return time.perf_counter() - start, step.compiled_shapes()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="mlp")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--granularity", type=int, default=None,
                        help="bucket granularity of the compiled step (default: dpcore's)")
    parser.add_argument("--warm-cache", action="store_true",
                        help="use Inductor's default on-disk cache (compiled code of earlier "
                             "runs)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    eager = eager_run(args.workload, args.steps)
    compiled, programs = compiled_run(args.workload, args.steps, args.granularity)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.workload}, "
          f"{args.steps} steps")
    print(f"  private_grads (eager)    {eager:8.1f} s")
    print(f"  CompiledPrivateStep      {compiled:8.1f} s  ({programs} programs)  "
          f"{compiled / eager:.2f}x")


if __name__ == "__main__":
    main()
