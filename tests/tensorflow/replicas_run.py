"""Run by tests/tensorflow/test_tensorflow_replicas.py in a process of its own, with the CPU
split into two logical devices (set before TensorFlow starts): a model under a MirroredStrategy
of two replicas, trained by each route. Prints one JSON object: each route's error, and the
events its ledger holds."""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

from dpcore_tensorflow import PrivateGradients, make_private  # noqa: E402

X, Y = np.ones((8, 5), "float32"), np.zeros((8, 3), "float32")


def attempt(run, ledger) -> dict:
    try:
        run()
    except ValueError as error:
        return {"error": str(error), "events": len(ledger.events)}
    return {"error": None, "events": len(ledger.events)}


def main() -> dict:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
        private = make_private(model, n=40, batch_size=8, seed=0)
        private.compile(optimizer="sgd", loss="mse")
    out = {"replicas": strategy.num_replicas_in_sync}
    out["fit"] = attempt(lambda: private.fit(X, Y, steps_per_epoch=1, verbose=0),
                         private.aggregator.ledger)
    dp = PrivateGradients(model, "mse", private.aggregator)

    def call_in_scope():
        with strategy.scope():
            dp(X, Y)

    out["call"] = attempt(call_in_scope, private.aggregator.ledger)
    mask = np.ones(8, bool)

    def graph_step_per_replica():
        clips, stds = dp.record_step()
        strategy.run(tf.function(dp.graph_step), (X, Y, mask, clips, stds))

    dp.independence = None  # the check is not what is tried here
    out["run"] = attempt(graph_step_per_replica, private.aggregator.ledger)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
