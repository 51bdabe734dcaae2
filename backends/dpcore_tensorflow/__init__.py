"""dpcore_tensorflow: the TensorFlow backend of dpcore.

* :func:`make_private` / :class:`PrivateModel` - Keras 3 ``model.fit`` with DP;
* :class:`PrivateGradients` - the fused DP gradient for GradientTape-style custom loops;
* :func:`poisson_dataset` - Poisson-sampled, padded and masked ``tf.data`` batches;
* :class:`ClippedGradients` - per-example norms and clipped sums (ghost norms, book-keeping);
* :class:`TensorFlowBackend` - the dpcore backend contract (``dpcore.get_backend("tensorflow")``).

Names are imported on first use, so that importing the entry-point module
:mod:`dpcore_tensorflow.plugin` (which dpcore does to list backends) imports no TensorFlow.
"""

from dpcore.plugins import lazy_exports

_HOME = {
    "TensorFlowBackend": "backend",
    "ClippedGradients": "bookkeeping", "FallbackWarning": "bookkeeping",
    "poisson_dataset": "data",
    "PrivateModel": "keras_model", "build_mechanism": "keras_model", "make_private": "keras_model",
    "CrossExampleLayerError": "layer_taps", "NotPerExampleError": "independence",
    "PrivateGradients": "step", "per_example_loss": "step",
}

__all__ = sorted(_HOME)
__getattr__, __dir__ = lazy_exports(__name__, _HOME)
