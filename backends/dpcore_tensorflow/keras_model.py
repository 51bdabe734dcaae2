"""Keras 3 ``model.fit`` with DP: :func:`make_private` wraps a model in a
:class:`PrivateModel` whose train step is the fused DP step of :mod:`.step`.

    private = make_private(model, n=len(x_train), batch_size=256, max_grad_norm=1.0,
                           noise_multiplier=1.1, ledger="run.jsonl")
    private.compile(optimizer=keras.optimizers.SGD(0.1),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"])
    private.fit(x_train, y_train, epochs=3)       # Poisson batches, q = 256 / n

Each call of the train function is one step: on the host the sampling and sum-query events
are written to the ledger, then the compiled step computes the private average gradient of
one padded Poisson batch and the optimizer applies it (post-processing). Arrays given to
``fit`` are Poisson-sampled by the aggregator's sampler, 1/q steps per epoch; a
``tf.data.Dataset`` must be made from :func:`.poisson_dataset` batches ``(x, y, mask)`` drawn
at the aggregator's n and q.

Under a ``tf.distribute`` strategy of several replicas (the model built and made private in
its scope) each replica clips its part of every batch and the first adds the noise; Keras's
optimizer adds the replicas' results up, which is the step's release.
"""

from __future__ import annotations

import collections.abc
import math

import keras
import numpy as np
import tensorflow as tf

from dpcore import ClipSchedule, Mechanism, PrivateAggregator, flat, per_layer
from dpcore.aggregation import NonFiniteNormError
from dpcore.sampling import steps_per_epoch as epoch_steps

from .bookkeeping import leaf_names
from .data import check_fit_dataset, default_capacity, poisson_dataset
from .kernels import refuse_16_bit
from .step import PrivateGradients, check_strategy, per_example_loss

CLIPPINGS = ("flat", "per_layer")


class _State:
    """Untracked by Keras: the aggregator, the DP step and the per-step clip/noise inputs."""

    def __init__(self, aggregator: PrivateAggregator, mode: str, check_independence: bool,
                 leaves: list[str]):
        self.aggregator, self.mode = aggregator, mode
        self.check_independence = check_independence
        self.leaves = leaves  # the trainable variables' paths at make_private
        self.losses_checked = False  # the model's training call was found to add no losses
        self.dp: PrivateGradients | None = None
        self.clips: tf.Variable | None = None
        self.stds: tf.Variable | None = None
        self.normals: tf.Variable | None = None  # a secure aggregator's, drawn on the host
        self.check_source = None  # under several replicas: batches for the check alone
        self.peek = False  # whether Keras may call for a batch the dataset does not have
        self.assigned = None  # the (clips, stds) values the variables hold


def _weighted(metrics, weighted_metrics):
    """Every compiled metric as a weighted one: Keras passes the sample weight (here the
    padding mask) only to ``weighted_metrics``, so plain metrics counted the padded rows
    (accuracy 0.49 logged for 0)."""
    if metrics is None or weighted_metrics is None:
        return weighted_metrics if metrics is None else metrics
    if isinstance(metrics, (list, tuple)) and isinstance(weighted_metrics, (list, tuple)):
        return [*metrics, *weighted_metrics]
    raise ValueError(f"a private model weighs every metric by its padding mask: give metrics "
                     f"as one list (metrics= or weighted_metrics=), got metrics={metrics!r} "
                     f"and weighted_metrics={weighted_metrics!r}")


class PrivateModel(keras.Model):
    """``model`` trained with the Gaussian sum queries of ``aggregator`` (tensorflow backend,
    mechanism leaves = the model's variable paths). ``mode`` picks the per-example norms
    (``"auto"``: ghost or materialised per layer by cost; ``"vectorized"``);
    ``check_independence`` checks on the first two batches that the model keeps its examples
    apart (:mod:`.independence`)."""

    def __init__(self, model: keras.Model, aggregator: PrivateAggregator, *,
                 mode: str = "auto", check_independence: bool = True, **kwargs):
        super().__init__(name=kwargs.pop("name", f"private_{model.name}"), **kwargs)
        self.model = model
        self._dp_state = _State(aggregator, mode, check_independence, leaf_names(model))
        self.built = True  # its model is (make_private checks): for save_weights, checkpoints

    def get_config(self):
        raise NotImplementedError(
            f"{self.name!r} cannot be saved whole (save, ModelCheckpoint to .keras): its "
            f"aggregator and ledger are not Keras state. Save private.model (the wrapped Keras "
            f"model), or its weights (save_weights, ModelCheckpoint(save_weights_only=True)); "
            f"the ledger file is the run's record")

    @property
    def aggregator(self) -> PrivateAggregator:
        return self._dp_state.aggregator

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def compile(self, optimizer="sgd", loss=None, metrics=None, **kwargs):
        if loss is None:
            raise ValueError("a private model needs its loss at compile time (one loss per "
                             "example is clipped)")
        per_example_loss(loss)  # one loss, of a kind the step can take per example
        if kwargs.get("loss_weights") is not None:
            raise ValueError(f"loss_weights={kwargs['loss_weights']!r} would not be applied: a "
                             f"private model clips one loss per example, the compiled loss "
                             f"itself; scale that loss instead (a factor before clipping)")
        if kwargs.get("steps_per_execution", 1) != 1:
            raise ValueError(f"steps_per_execution must be 1 for a private model (the ledger "
                             f"is written before every step), got {kwargs['steps_per_execution']}")
        super().compile(optimizer=optimizer, loss=loss,
                        weighted_metrics=_weighted(metrics, kwargs.pop("weighted_metrics", None)),
                        **kwargs)
        self._dp_state.dp = None

    def _build_dp(self) -> PrivateGradients:
        state = self._dp_state
        if state.dp is None:
            now, then = set(leaf_names(self.model)), set(state.leaves)
            if now != then:
                changes = [f"{what} {sorted(names)}" for what, names in
                           (("now trainable:", now - then), ("no longer trainable:", then - now))
                           if names]
                raise ValueError(
                    f"the model's trainable variables changed since make_private (a layer's "
                    f"trainable set?), {'; '.join(changes)}: the mechanism's groups are those "
                    f"at make_private. Call make_private again (close this ledger first: "
                    f"reopening the same ledger path continues the run)")
            state.dp = PrivateGradients(self.model, self.loss, state.aggregator, mode=state.mode,
                                        check_independence=state.check_independence)
            groups, leaves = len(state.dp.clipper.structure), len(state.dp.clipper.leaves)
            state.clips = tf.Variable(tf.zeros([groups], tf.float64), trainable=False)
            state.stds = tf.Variable(tf.zeros([leaves], tf.float64), trainable=False)
            if state.aggregator.secure:
                state.normals = tf.Variable(tf.zeros([state.dp.noise_size], tf.float64),
                                            trainable=False)
            state.assigned = None
        return state.dp

    def train_step(self, data):
        x, y, mask = keras.utils.unpack_x_y_sample_weight(data)
        if mask is None:
            mask = tf.ones([tf.shape(tf.nest.flatten(x)[0])[0]], tf.bool)
        state = self._dp_state
        grads, losses, outputs, bad = state.dp.graph_step(x, y, mask, state.clips, state.stds,
                                                          state.normals)
        self._applying_optimizer.apply(grads, state.dp.variables)
        weight = tf.cast(mask, losses.dtype)
        count = tf.reduce_sum(weight)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(tf.reduce_sum(losses * weight) / tf.maximum(count, 1.0),
                                    sample_weight=count)
        logs = self.compute_metrics(x, y, outputs, sample_weight=weight)
        nonfinite = tf.reduce_sum(tf.cast(bad, tf.int32))
        replica = tf.distribute.get_replica_context()
        if replica is not None and replica.num_replicas_in_sync > 1:  # every replica's records
            nonfinite = replica.all_reduce(tf.distribute.ReduceOp.SUM, nonfinite)
        return {**logs, "nonfinite_records": nonfinite}

    def _check_no_added_losses(self, x) -> None:
        """Raise if the model's training call adds losses (``add_loss``), which the DP step
        would leave out. Traced once on ``x`` (a batch or its spec), not run: nothing changes."""
        state = self._dp_state
        if state.losses_checked:
            return
        added = []

        def forward(x):
            with keras.StatelessScope(collect_losses=True) as scope:
                self.model(x, training=True)
            added.extend(id(loss) for loss in scope.losses)

        tf.function(forward).get_concrete_function(x)
        if added:
            layers = sorted({layer.name for layer in self.model._flatten_layers()
                             if set(getattr(layer, "_loss_ids", ())) & set(added)})
            raise ValueError(
                f"layers {layers} of model {self.model.name!r} add losses in training "
                f"(add_loss); the DP step clips per-example losses only and would ignore them. "
                f"Remove them (weight decay on the optimizer, e.g. SGD(weight_decay=...), is "
                f"applied after the private gradient and costs no privacy; a penalty on an "
                f"example's own outputs belongs in the loss function)")
        state.losses_checked = True

    @property
    def _applying_optimizer(self):
        """The optimizer that applies the private gradient: the compiled one, or under
        mixed_float16 the one Keras wraps in a LossScaleOptimizer (which would divide by its
        loss scale; the per-example losses were never scaled)."""
        optimizer = self.optimizer
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return optimizer.inner_optimizer
        return optimizer

    def _check_replicas(self) -> int:
        """The number of replicas (:func:`.step.check_strategy`). Under several, the
        optimizer must not change each replica's result before they are added up: Keras
        clips gradients (``clipnorm``, ``clipvalue``, ``global_clipnorm``) per replica, and
        a clip of the parts without noise would not be post-processing of the noisy sum."""
        replicas = check_strategy(self.distribute_strategy)
        optimizer = self._applying_optimizer
        if getattr(optimizer, "loss_scale_factor", None):
            raise ValueError(f"the optimizer's loss_scale_factor={optimizer.loss_scale_factor} "
                             f"would divide the private gradient, whose per-example losses "
                             f"are not scaled: leave it unset")
        if replicas == 1:
            return replicas
        options = {name: getattr(optimizer, name, None) for name in
                   ("clipnorm", "clipvalue", "global_clipnorm", "gradient_accumulation_steps")}
        options = {name: value for name, value in options.items() if value}
        if options:
            raise ValueError(
                f"the optimizer's {options} would act on each of the {replicas} replicas' "
                f"parts of the step before they are added up (a clip of a part without "
                f"noise is not post-processing of the private sum): leave them unset under "
                f"several replicas (the private gradient is already clipped per example)")
        if getattr(self, "jit_compile", False) is True:
            raise ValueError(f"jit_compile=True under {replicas} replicas: XLA cannot compile "
                             f"the step across the replicas' devices; compile without it")
        return replicas

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        self._check_replicas()
        dp = self._build_dp()
        state = self._dp_state
        super().make_train_function(force=True)
        compiled = self.train_function

        def train_function(iterator):
            if self.steps_per_execution != 1:  # set after compile: several releases a call
                raise ValueError(f"steps_per_execution must be 1 for a private model (the "
                                 f"ledger is written before every step), got "
                                 f"{self.steps_per_execution}")
            peek = state.peek
            if dp.independence is not None and not dp.independence.done:
                if state.check_source is not None:
                    dp.check(*next(state.check_source))
                    if dp.independence.done:  # let the source (and its prefetch) go
                        state.check_source = None
                else:
                    iterator, peek = _check_next_batch(dp, iterator), False
            if peek:  # the end of the data records no step; Keras traces the step for a
                iterator = iter([_next_batch(iterator)])  # batch alone once, then reuses it
            inputs = dp.record_step()  # ledger first
            if inputs != state.assigned:  # clips or noise moved (or first step)
                state.clips.assign(inputs[0])
                state.stds.assign(inputs[1])
                state.assigned = inputs
            if state.normals is not None:  # fresh for every step
                state.normals.assign(dp.host_normals())
            logs = compiled(iterator)
            if state.aggregator.on_nonfinite == "raise" and int(logs["nonfinite_records"]):
                raise NonFiniteNormError(
                    f"{int(logs['nonfinite_records'])} record(s) of the last step had a NaN or "
                    f"infinite gradient norm (they got weight 0); fix the model or loss, or "
                    f"use on_nonfinite='drop'")
            return logs

        self.train_function = train_function
        return train_function

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None,
                       return_dict=False):
        """Keras ``train_on_batch`` on one Poisson batch: ``sample_weight`` may only be its
        padding mask (0 or 1 per row); class weights do not apply."""
        if self.distribute_strategy.num_replicas_in_sync > 1:
            raise ValueError("train_on_batch under several replicas would give every replica "
                             "the whole batch (each clips it, so the step would hold its sums "
                             "once per replica): use fit")
        if class_weight is not None:
            raise ValueError(f"class_weight={class_weight!r} does not apply to a private model: "
                             f"every record's clipped gradient counts once")
        weights = None if sample_weight is None else np.asarray(sample_weight)
        if weights is not None and not np.isin(weights, (0, 1)).all():
            raise ValueError(f"a private model reads sample_weight as the batch's padding mask "
                             f"(0 or 1 per row), got values such as "
                             f"{np.setdiff1d(weights, (0, 1))[:3]}: weights do not apply "
                             f"(every record's clipped gradient counts once); pass a bool "
                             f"mask or none")
        self._check_no_added_losses(x)
        return super().train_on_batch(x, y, sample_weight=sample_weight,
                                      return_dict=return_dict)

    def fit(self, x=None, y=None, *, batch_size=None, epochs=1, steps_per_epoch=None,
            sample_weight=None, class_weight=None, shuffle=None, **kwargs):
        """Keras ``fit`` on Poisson batches. Arrays are sampled at the aggregator's rate q,
        ``steps_per_epoch`` (default round(1/q)) samples per epoch; batch sizes, shuffling and
        sample or class weights do not apply (the batch is the Poisson sample). A dataset must
        come from :func:`.poisson_dataset` at the aggregator's n and q."""
        for name, value in (("batch_size", batch_size), ("sample_weight", sample_weight),
                            ("class_weight", class_weight), ("shuffle", shuffle)):
            if value is not None:
                raise ValueError(f"{name}={value!r} does not apply to a private model: batches "
                                 f"are Poisson samples at rate q={self.aggregator.q}")
        if kwargs.get("validation_split"):
            raise ValueError(f"validation_split={kwargs['validation_split']!r} does not apply to "
                             f"a private model (the aggregator samples all n={self.aggregator.n} "
                             f"records given): split the records yourself and pass the held-out "
                             f"ones as validation_data")
        if isinstance(x, (keras.utils.PyDataset, collections.abc.Iterator)):
            raise ValueError(f"a private model's fit cannot take x of type {type(x).__name__}: "
                             f"its batches would not be Poisson samples. Pass the records as "
                             f"arrays x, y (sampled at q={self.aggregator.q}), or a dataset "
                             f"made by poisson_dataset")
        replicas, arrays = self._check_replicas(), None
        self._dp_state.peek = False
        if isinstance(x, tf.data.Dataset):
            # where Keras cannot know the dataset's end, look for each batch before its step
            # is recorded: the call that finds none would otherwise leave a step in the ledger
            self._dp_state.peek = int(x.cardinality()) == tf.data.UNKNOWN_CARDINALITY
            if not _is_poisson(x):
                spec = x.element_spec
                raise ValueError(
                    f"a dataset given to a private model's fit must yield (x, y, mask) Poisson "
                    f"batches with a bool padding mask (dpcore_tensorflow.poisson_dataset); got "
                    f"elements {spec}. Fixed-size batches would be accounted as Poisson samples "
                    f"they are not, and sample weights do not apply")
            if tf.nest.is_nested(x.element_spec[1]):
                raise ValueError(
                    f"a private model's targets y must be one tensor, got {x.element_spec[1]}: "
                    f"it clips one loss per example. For several outputs, combine their losses "
                    f"in one loss function (of y and the outputs)")
            check_fit_dataset(x, self.aggregator)
        else:
            steps = steps_per_epoch or epoch_steps(self.aggregator.q)
            agg = self.aggregator  # batches cut evenly over the replicas
            capacity = replicas * math.ceil(default_capacity(agg.n, agg.q) / replicas)
            arrays = (x, y)
            x = poisson_dataset(x, y, sampler=agg.sampler, steps=steps, capacity=capacity)
            y, steps_per_epoch = None, None
        self._check_no_added_losses(x.element_spec[0])
        if replicas > 1:
            # the replicas get parts of each batch; the check needs whole ones (on the host):
            # until it is done, each step checks a batch drawn for it alone (not trained on;
            # from arrays, by a sampler of its own, so the aggregator's draws stay the run's)
            check = (x if arrays is None else
                     poisson_dataset(*arrays, q=self.aggregator.q, steps=1, capacity=capacity))
            self._dp_state.check_source = iter(check.repeat())
            x = _for_replicas(x, replicas)
            if steps_per_epoch is None and int(x.cardinality()) > 0:
                steps_per_epoch = int(x.cardinality())  # lost in the split over the replicas
            if _is_poisson(kwargs.get("validation_data")):
                kwargs["validation_data"] = _for_replicas(kwargs["validation_data"], replicas)
        return super().fit(x, y, epochs=epochs, steps_per_epoch=steps_per_epoch, shuffle=False,
                           **kwargs)


def _is_poisson(data) -> bool:
    """Whether ``data`` is a dataset of ``(x, y, bool mask)`` batches."""
    if not isinstance(data, tf.data.Dataset):
        return False
    spec = data.element_spec
    return (isinstance(spec, tuple) and len(spec) == 3
            and getattr(spec[2], "dtype", None) == tf.bool)


def _for_replicas(dataset: tf.data.Dataset, replicas: int) -> tf.data.Dataset:
    """Batches Keras can cut over ``replicas``: rows padded to a multiple of them (masked
    out), the mask as float32 (Keras averages a first batch's parts to build the model,
    which must have one shape and cannot be bool)."""
    def rows(t, extra):
        t = tf.convert_to_tensor(t)
        return tf.pad(t, tf.concat([[[0, extra]], tf.zeros([tf.rank(t) - 1, 2], tf.int32)], 0))

    def pad(x, y, mask):
        extra = -tf.shape(mask)[0] % replicas
        return (tf.nest.map_structure(lambda t: rows(t, extra), x), rows(y, extra),
                rows(tf.cast(mask, tf.float32), extra))

    return dataset.map(pad)


def _next_batch(iterator):
    """The next batch of ``iterator`` (a dataset's or a distributed one); ``StopIteration``
    at its end."""
    if isinstance(iterator, tf.data.Iterator):
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            raise StopIteration
        return optional.get_value()
    return next(iter(iterator))


def _check_next_batch(dp: PrivateGradients, iterator):
    """Check the next batch of ``iterator`` for mixing of the examples (:meth:`PrivateGradients.
    check`); an iterator over that one batch, of the same element type (the compiled step
    is not traced again)."""
    data = _next_batch(iterator)
    x, y, mask = keras.utils.unpack_x_y_sample_weight(data)
    dp.check(x, y, mask)
    if isinstance(iterator, tf.data.Iterator):
        return iter(tf.data.Dataset.from_generator(lambda: iter([data]),
                                                   output_signature=iterator.element_spec))
    return iter([data])


def build_mechanism(model: keras.Model, clipping, max_grad_norm: float,
                    noise_multiplier: float) -> Mechanism:
    """``"flat"`` (one group, clip S), ``"per_layer"`` (one group per variable, S_g = S /
    sqrt(L), proportional noise) or a :class:`dpcore.Mechanism` over the variable paths."""
    if isinstance(clipping, Mechanism):
        return clipping
    names = leaf_names(model)
    if clipping == "flat":
        return flat(names, max_grad_norm, noise_multiplier)
    if clipping == "per_layer":
        sizes = {v.path: math.prod(v.shape) for v in model.trainable_variables}
        return per_layer(sizes, max_grad_norm, noise_multiplier)
    raise ValueError(f"clipping must be one of {CLIPPINGS} or a dpcore Mechanism, got "
                     f"{clipping!r}")


def make_private(model: keras.Model, *, n: int, batch_size: float | None = None,
                 q: float | None = None, max_grad_norm: float = 1.0,
                 noise_multiplier: float = 1.0, clipping="flat", ledger=None, seed=None,
                 mode: str = "auto", on_nonfinite: str = "raise",
                 clip_schedule=None, check_independence: bool = True,
                 secure: bool = False) -> PrivateModel:
    """A :class:`PrivateModel` around a built ``model``, for ``n`` records sampled at rate
    ``q`` (or ``batch_size / n``: the expected batch size). ``ledger`` is a path or a
    :class:`dpcore.Ledger`; ``seed`` fixes sampling and noise (tests only); ``clip_schedule``
    is a dpcore clip schedule. ``secure`` draws sampling and noise from the system's
    cryptographically secure generator, on the host (:mod:`dpcore.secure`; no ``seed``).
    ``check_independence`` (default) checks on the first two batches
    that the model keeps its examples apart, and raises
    :class:`~dpcore_tensorflow.independence.NotPerExampleError` if it does not."""
    if (q is None) == (batch_size is None):
        raise ValueError("give exactly one of q (sampling rate) and batch_size (expected "
                         f"batch size, q = batch_size / n); got q={q!r}, batch_size={batch_size!r}")
    if not model.built:
        raise ValueError(f"model {model.name!r} is not built; call it on a batch or give it an "
                         f"Input first, so its variables exist")
    refuse_16_bit(leaf_names(model), model.trainable_variables)
    if clip_schedule is not None and not isinstance(clip_schedule, ClipSchedule):
        raise TypeError(f"clip_schedule must be a dpcore.ClipSchedule, got {clip_schedule!r} "
                        f"(adaptive clipping releases counts the fused Keras step does not: "
                        f"use TensorFlowBackend.private_gradient in a custom loop)")
    q = batch_size / n if q is None else q
    mechanism = build_mechanism(model, clipping, max_grad_norm, noise_multiplier)
    aggregator = PrivateAggregator(mechanism, n=n, q=q, backend="tensorflow", ledger=ledger,
                                   seed=seed, on_nonfinite=on_nonfinite, clipping=clip_schedule,
                                   secure=secure)
    return PrivateModel(model, aggregator, mode=mode, check_independence=check_independence)
