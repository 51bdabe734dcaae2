"""DP step time against the non-private Keras step, side by side, on the three workloads.

    python benchmarks/tensorflow_step.py [--workloads cnn mlp transformer] [--rounds 7]
                                         [--configs np np-xla dp dp-xla]

For each workload four Keras train functions run on the same batch: the non-private model
(``model.compile(...)``, its own train step) and the private model (``make_private``: ledger
written on the host, fused DP step, optimizer update), each without and with XLA. The
configurations take turns in blocks, so load drift hits all alike: each round runs one
untimed step of each configuration (its caches move over from the previous one) and then
``--steps`` timed consecutive steps, the steady state of a training loop (until the tenth
session they took turns step by step, which slows every step by the other configurations'
cache traffic; docs/benchmarks-history.md). The figure is the median of rounds x steps timed steps.
The ratio divides the best DP configuration by the best non-private one. Run on an otherwise
quiet machine; the script prints ``os.getloadavg()``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rounds import one_round  # noqa: E402
from tensorflow_models import workload  # noqa: E402

from dpcore_tensorflow import make_private  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train_function(name: str, private: bool, jit: bool, seed: int = 0):
    """A zero-argument callable running one training step of the configuration."""
    model, x, y = workload(name, seed)
    if private:
        model = make_private(model, n=100 * len(x), batch_size=len(x), max_grad_norm=1.0,
                             noise_multiplier=1.0)
        data = (x, y, np.ones(len(x), bool))
    else:
        data = (x, y)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=LOSS, jit_compile=jit)
    iterator = iter(tf.data.Dataset.from_tensors(data).repeat())
    model.make_train_function()
    step = model.train_function

    def run():
        logs = step(iterator)
        return float(logs["loss"])  # wait for the step to finish
    return run


CONFIGS = {"np": (False, False), "np-xla": (False, True), "dp": (True, False), "dp-xla": (True, True)}


def measure(name: str, rounds: int, steps: int, which=tuple(CONFIGS)) -> dict:
    configs = {CONFIGS[c]: train_function(name, *CONFIGS[c]) for c in which}
    for run in configs.values():
        for _ in range(3):
            run()
    times = {c: [] for c in configs}
    for _ in range(rounds):
        one_round(configs, steps, times)
    return {c: float(np.median(t)) for c, t in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["cnn", "mlp", "transformer"])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5,
                        help="timed consecutive steps of each configuration per round")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        help="configurations sharing the process (default: all four)")
    args = parser.parse_args(argv)
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}, "
          f"load average before: {os.getloadavg()}")
    print(f"{'workload':12} {'non-private':>12} {'np XLA':>9} {'DP':>9} {'DP XLA':>9} {'ratio':>6}")
    for name in args.workloads:
        t = measure(name, args.rounds, args.steps, args.configs)
        base = min(t.get((False, j), np.inf) for j in (False, True))
        best = min(t.get((True, j), np.inf) for j in (False, True))
        cells = [f"{1e3 * t[c]:7.2f}ms" if c in t else f"{'-':>9}" for c in CONFIGS.values()]
        print(f"{name:12} {cells[0]:>12} {' '.join(cells[1:])} {best / base:5.2f}x", flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
