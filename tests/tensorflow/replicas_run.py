"""Run by tests/tensorflow/test_tensorflow_replicas.py in a process of its own, with the CPU
split into logical devices (set before TensorFlow starts): Keras ``fit`` of a private model
under a MirroredStrategy of two replicas (``python replicas_run.py``) or three (``... 3``;
one process takes one strategy's collectives) against the same fit on one device. Prints
one JSON object."""

import contextlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
REPLICAS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)

import keras  # noqa: E402
from keras import ops  # noqa: E402

from dpcore_tensorflow import PrivateGradients, make_private, poisson_dataset  # noqa: E402

STRATEGY = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
N = 40  # q = 1: every step's batch is the n records and 32 padding rows, 36 per replica
CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 6)).astype("float32"), rng.integers(0, 3, N)


def fit(strategy, x, y, *, layers=None, epochs=3, compiled=None, fitted=None, dataset=None,
        **options):
    """``(updates of the weights, private model, error)`` of ``epochs`` steps at q = 1 (on
    ``dataset()``'s batches if given, else on the arrays)."""
    keras.utils.set_random_seed(1)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = keras.Sequential(layers or [keras.Input((6,)), keras.layers.Dense(8, "tanh"),
                                            keras.layers.Dense(3)])
        options = {"max_grad_norm": 0.05, "noise_multiplier": 0.0, "seed": 0, **options}
        private = make_private(model, n=len(x), q=1.0, **options)
        private.compile(**{"optimizer": keras.optimizers.SGD(1.0), "loss": CE,
                           **(compiled or {})})
    before = [v.numpy() for v in model.trainable_variables]
    try:
        data = (x, y) if dataset is None else (dataset(),)
        private.fit(*data, epochs=epochs, steps_per_epoch=1, verbose=0, **(fitted or {}))
    except Exception as error:  # noqa: BLE001 - reported to the test
        return None, private, f"{type(error).__name__}: {error}"
    return [b - v.numpy() for b, v in zip(before, model.trainable_variables)], private, None


def same_as_one_device() -> dict:
    """A clip that binds for most records, no noise: the same three steps."""
    x, y = data()
    one, _, _ = fit(None, x, y)
    two, private, error = fit(STRATEGY, x, y)
    assert error is None, error
    return {"difference": max(float(np.abs(a - b).max()) for a, b in zip(one, two)),
            "largest_update": max(float(np.abs(a).max()) for a in one),
            "steps": len(private.aggregator.ledger.steps()) and
            private.aggregator.ledger.steps()[0].count,
            "checked": private._dp_state.dp.independence.done,
            "check_source_dropped": private._dp_state.check_source is None}


def reproducible() -> dict:
    """Two seeded runs at q = 1/2 with noise: the same weights (the check draws its batches
    with a sampler of its own, not the aggregator's)."""
    x, y = data()
    weights = []
    for _ in range(2):
        keras.utils.set_random_seed(1)
        with STRATEGY.scope():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
            private = make_private(model, n=N, q=0.5, max_grad_norm=1.0, noise_multiplier=1.0,
                                   seed=3)
            private.compile(optimizer=keras.optimizers.SGD(0.5), loss=CE)
        private.fit(x, y, epochs=1, steps_per_epoch=4, verbose=0)
        weights.append([v.numpy() for v in model.trainable_variables])
    return {"difference": max(float(np.abs(a - b).max()) for a, b in zip(*weights))}


def noise(secure: bool) -> dict:
    """Zero inputs and targets, a clip near 0: the update times q n is the noise alone."""
    x, y = np.zeros((N, 6), "float32"), np.zeros(N, "int64")
    layers = [keras.Input((6,)), keras.layers.Dense(2000)]
    options = {"max_grad_norm": 1e-8, "noise_multiplier": 1e7, "secure": secure,
               "seed": None if secure else 0}
    updates, private, error = fit(STRATEGY, x, y, layers=layers, epochs=1, **options)
    assert error is None, error
    event = private.aggregator.ledger.events[-1]
    return {"std_ratio": float(np.concatenate([u.ravel() for u in updates]).std()
                               * private.aggregator.expected_size / event.noise_std),
            "values": int(sum(u.size for u in updates))}


def nonfinite() -> dict:
    """A NaN in record 39, which the second replica gets."""
    x, y = data()
    x[39, 0] = np.nan
    _, _, error = fit(STRATEGY, x, y, epochs=1)
    return {"error": error}


def mixing() -> dict:
    """A layer that subtracts the batch mean: the check refuses it under the replicas too."""
    x, y = data()
    layers = [keras.Input((6,)), keras.layers.Lambda(lambda t: t - ops.mean(t, axis=0)),
              keras.layers.Dense(3)]
    _, private, error = fit(STRATEGY, x, y, layers=layers, epochs=2)
    return {"error": error, "events": len(private.aggregator.ledger.events)}


def graph_step_per_replica() -> dict:
    """A loop of one's own: graph_step run per replica on its part of a batch, the results
    added up, against graph_step on the whole batch (clip binding, no noise)."""
    x, y = data()
    mask = np.ones(N, bool)
    keras.utils.set_random_seed(1)
    with STRATEGY.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        private = make_private(model, n=N, q=1.0, max_grad_norm=0.05, noise_multiplier=0.0,
                               seed=0)
    dp = PrivateGradients(model, CE, private.aggregator, check_independence=False)
    inputs = [tf.constant(v, tf.float64) for v in dp.record_step()]
    whole = dp.graph_step(x, y, mask, *inputs)[0]
    batches = STRATEGY.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors((x, y, mask)))
    parts = STRATEGY.run(tf.function(lambda b: dp.graph_step(*b, *inputs)[0]),
                         args=(next(iter(batches)),))
    summed = [STRATEGY.reduce(tf.distribute.ReduceOp.SUM, g, axis=None) for g in parts]
    return {"difference": max(float(np.abs(a - b).max()) for a, b in zip(whole, summed)),
            "largest": max(float(np.abs(a).max()) for a in whole)}


def three_replicas() -> dict:
    """30 records at q = 1: the default capacity, 56 rows, would not split evenly over three
    replicas (Keras's build would fail); fit pads to 57, and the steps are one device's."""
    x, y = data()
    x, y = x[:30], y[:30]
    one, _, _ = fit(None, x, y)
    updates, _, error = fit(STRATEGY, x, y)
    assert error is None, error
    return {"difference": max(float(np.abs(a - b).max()) for a, b in zip(one, updates)),
            "largest_update": max(float(np.abs(a).max()) for a in one)}


def validation() -> dict:
    """Validation batches of (x, y, bool mask), as poisson_dataset makes them."""
    x, y = data()
    check = poisson_dataset(x, y, q=0.5, steps=2, seed=1)
    _, private, error = fit(STRATEGY, x, y, epochs=1, fitted={"validation_data": check})
    return {"error": error, "steps": len(private.aggregator.ledger.events) // 2}


def odd_batches() -> dict:
    """A dataset of one's own whose batches, 41 rows (the 40 records at q = 1 and a padding
    row), do not divide over the two replicas: fit pads them, and the steps are one
    device's."""
    x, y = data()

    def dataset():
        return poisson_dataset(x, y, q=1.0, steps=3, capacity=41)

    one, _, _ = fit(None, x, y, dataset=dataset)
    two, private, error = fit(STRATEGY, x, y, dataset=dataset)
    if error is not None:
        return {"error": error}
    return {"error": None, "steps": private.aggregator.ledger.samplings,
            "difference": max(float(np.abs(a - b).max()) for a, b in zip(one, two)),
            "largest_update": max(float(np.abs(a).max()) for a in one)}


def unknown_length() -> dict:
    """A dataset whose end Keras cannot know (chosen from by a selector): the ledger holds
    the steps trained on, the call that finds no batch none."""
    x, y = data()
    with STRATEGY.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        private = make_private(model, n=N, q=0.5, max_grad_norm=1.0, noise_multiplier=1.0,
                               seed=0)
        private.compile(optimizer=keras.optimizers.SGD(0.1), loss=CE)
    dataset = poisson_dataset(x, y, q=0.5, steps=3, seed=1, capacity=40)
    trained = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: trained.append(batch))
    try:
        selector = tf.data.Dataset.from_tensors(np.int64(0)).repeat()
        private.fit(tf.data.Dataset.choose_from_datasets([dataset], selector), epochs=2,
                    verbose=0, callbacks=[callback])
    except Exception as error:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None, "trained": len(trained),
            "steps": private.aggregator.ledger.samplings}


def refused(**options) -> dict:
    """fit or train_on_batch under the replicas with ``options``: the error, the events."""
    x, y = data()
    train_on_batch = options.pop("train_on_batch", False)
    if not train_on_batch:
        _, private, error = fit(STRATEGY, x, y, epochs=1, **options)
        return {"error": error, "events": len(private.aggregator.ledger.events)}
    with STRATEGY.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        private = make_private(model, n=N, q=1.0, seed=0)
        private.compile(optimizer="sgd", loss=CE)
    try:
        private.train_on_batch(x, y, np.ones(N, bool))
    except ValueError as error:
        return {"error": f"ValueError: {error}", "events": len(private.aggregator.ledger.events)}
    return {"error": None}


def other_strategy() -> dict:
    """A strategy of two replicas that is not a MirroredStrategy: refused before any step."""
    x, y = data()
    strategy = tf.distribute.experimental.CentralStorageStrategy(
        compute_devices=["/cpu:0", "/cpu:1"], parameter_device="/cpu:0")
    _, private, error = fit(strategy, x, y, epochs=1)
    return {"error": error, "events": len(private.aggregator.ledger.events)}


def tape_style_call() -> dict:
    x, y = data()
    with STRATEGY.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        private = make_private(model, n=N, q=1.0, seed=0)
        dp = PrivateGradients(model, CE, private.aggregator)
        try:
            dp(x, y)
        except ValueError as error:
            return {"error": str(error), "events": len(private.aggregator.ledger.events)}
    return {"error": None}


if __name__ == "__main__" and REPLICAS == 3:
    print(json.dumps({"replicas": REPLICAS, "three": three_replicas()}))
elif __name__ == "__main__":
    print(json.dumps({"replicas": STRATEGY.num_replicas_in_sync,
                      "same": same_as_one_device(), "reproducible": reproducible(),
                      "noise": noise(secure=False),
                      "secure_noise": noise(secure=True), "nonfinite": nonfinite(),
                      "mixing": mixing(), "per_replica": graph_step_per_replica(),
                      "other_strategy": other_strategy(),
                      "validation": validation(), "unknown_length": unknown_length(),
                      "odd_batches": odd_batches(),
                      "clipnorm": refused(compiled={
                          "optimizer": keras.optimizers.SGD(0.1, clipnorm=1.0)}),
                      "jit": refused(compiled={"jit_compile": True}),
                      "train_on_batch": refused(train_on_batch=True),
                      "call": tape_style_call()}))
