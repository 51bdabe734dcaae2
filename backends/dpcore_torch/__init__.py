"""dpcore_torch: the PyTorch backend of dpcore.

* :func:`make_private` - model, optimizer and loader in, private ones out (the Opacus-style path);
* :class:`PerExampleEngine` + :func:`private_grads` - the functional step for custom loops
  (:func:`clip_into` to accumulate a Poisson sample over micro-batches);
* :class:`CompiledPrivateStep` - the functional step traced and compiled by TorchInductor, one
  call per step (small models, where eager overhead dominates);
* :func:`poisson_loader` - Poisson-sampled batches (empty batches included);
* :class:`BatchNormStatistics` - BatchNorm layers trained with privately released statistics;
* :func:`register_linear` - another library's linear layer class (GPT-2's ``Conv1D``) run
  through the Linear rule;
* :class:`TorchBackend` - the dpcore backend contract (``dpcore.get_backend("torch")``).

Names are imported on first use, so that importing the entry-point module
:mod:`dpcore_torch.plugin` (which dpcore does to list backends) imports no torch.
"""

from dpcore.plugins import lazy_exports

_HOME = {
    "TorchBackend": "backend",
    "PoissonBatchSampler": "data", "poisson_loader": "data",
    "BatchNormStatistics": "batch_norm",
    "CompiledPrivateStep": "compiled",
    "AccumulationError": "engine", "LeakedGradientError": "engine",
    "NotPerExampleError": "engine",
    "PerExampleEngine": "engine",
    "PrivateOptimizer": "optimizer",
    "build_mechanism": "privacy", "make_private": "privacy",
    "clip_into": "step", "private_grads": "step",
    "register_linear": "registered", "ReplayMismatchError": "draws",
}

__all__ = sorted(_HOME)
__getattr__, __dir__ = lazy_exports(__name__, _HOME)
