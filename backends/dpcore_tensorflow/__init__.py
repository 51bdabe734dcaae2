"""dpcore_tensorflow: the TensorFlow backend of dpcore.

* :func:`make_private` / :class:`PrivateModel` - Keras 3 ``model.fit`` with DP;
* :class:`PrivateGradients` - the fused DP gradient for GradientTape-style custom loops;
* :func:`poisson_dataset` - Poisson-sampled, padded and masked ``tf.data`` batches;
* :class:`ClippedGradients` - per-example norms and clipped sums (ghost norms, book-keeping);
* :class:`TensorFlowBackend` - the dpcore backend contract (``dpcore.get_backend("tensorflow")``).
"""

from .backend import TensorFlowBackend
from .bookkeeping import ClippedGradients, FallbackWarning
from .data import poisson_dataset
from .keras_model import PrivateModel, build_mechanism, make_private
from .layer_taps import CrossExampleLayerError
from .step import PrivateGradients, per_example_loss

__all__ = [
    "ClippedGradients", "CrossExampleLayerError", "FallbackWarning", "PrivateGradients",
    "PrivateModel", "TensorFlowBackend", "build_mechanism", "make_private", "per_example_loss",
    "poisson_dataset",
]
