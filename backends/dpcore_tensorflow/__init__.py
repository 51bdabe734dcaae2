"""dpcore_tensorflow: the TensorFlow backend of dpcore.

* :class:`TensorFlowBackend` - the dpcore backend contract (``dpcore.get_backend("tensorflow")``).
"""

from .backend import TensorFlowBackend

__all__ = ["TensorFlowBackend"]
