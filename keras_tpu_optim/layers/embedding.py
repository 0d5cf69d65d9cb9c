"""`keras.layers.Embedding` whose table is trained in the backward pass of its lookup, by its own `EmbeddingAdam`."""

from __future__ import annotations

import dataclasses
import warnings

import keras
from keras import ops

from keras_tpu_optim import _checks, _private, _slots
from keras_tpu_optim._backend import backend
from keras_tpu_optim._math import catch_up as catch_up_math
from keras_tpu_optim._math import sparse_rows
from keras_tpu_optim.embedding_adam import EmbeddingAdam

# The layer optimizer's options that cannot keep their meaning when the table is updated in the
# backward pass of one lookup, with why: each raises a `ValueError` naming it.
_UNSUPPORTED = {
    "use_ema": "the moving average of the table would need a pass over every row each step",
    "gradient_accumulation_steps": "the table is updated in the backward pass of every step",
    "clipnorm": "the norm of the table's gradient is not known to one lookup",
    "global_clipnorm": "the norm of the model's gradients is not known to one lookup",
    "loss_scale_factor": "the lookup's gradient arrives unscaled",
    "slot_variable_creation_fn": "the layer creates and saves the table's slots itself",
}


def _model_optimizer():
    """`(skips, accumulation_steps)` of the optimizer of the model calling the layer: whether it skips
    non-finite steps (a `LossScaleOptimizer`, or `skip_nonfinite_updates`), as the table's update then does,
    and its `gradient_accumulation_steps`; None where no model is calling (the model is the outermost layer
    of the call, Keras's call context)."""
    model = _private.calling_model()
    if not isinstance(model, keras.Model):
        return None
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    skips = isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or bool(
        getattr(inner, "skip_nonfinite_updates", False)
    )
    return skips, getattr(inner, "gradient_accumulation_steps", None)


def _check_optimizer(optimizer):
    if optimizer is None:
        return None
    if not isinstance(optimizer, EmbeddingAdam):
        raise ValueError(
            "Argument `optimizer` must be None or a `keras_tpu_optim.EmbeddingAdam`. "
            f"Received: optimizer={optimizer!r}"
        )
    for name, why in _UNSUPPORTED.items():
        if getattr(optimizer, name, None):
            raise ValueError(
                f"keras_tpu_optim.layers.Embedding: its optimizer's `{name}` is not supported ({why}). "
                f"Received: {name}={getattr(optimizer, name)!r}"
            )
    return optimizer


@keras.saving.register_keras_serializable(package="keras_tpu_optim")
class Embedding(keras.layers.Embedding):
    """`keras.layers.Embedding`, optionally trained by its own `EmbeddingAdam` at the cost of the rows looked up.

    With `optimizer=None` this is `keras.layers.Embedding`: the model's
    optimizer trains the table from its (on JAX and torch, dense) gradient.

    With `optimizer=kto.EmbeddingAdam(...)` the table and that optimizer's
    state are updated in the backward pass of the lookup, from the looked-up
    ids and the gradient of the looked-up rows: each training step reads and
    writes only the rows looked up (and their slots), and no table-sized
    gradient is ever formed. The numbers are those of the same
    `EmbeddingAdam` applied to the table's gradient (duplicate ids summed, or
    the last occurrence kept with `use_gradient_accumulation=False`;
    `clipvalue`, weight clipping and decay, `second_moment`,
    `bias_correction`, learning-rate schedules). The model's optimizer never
    sees the table: it keeps no state for it, and its gradient clipping does
    not include it. `evaluate` and `predict` only look rows up.

    The state lives in the layer, saved with it (`model.save`, checkpoints);
    `table_state` returns it by name, in the order saved: `embeddings`,
    `iterations` (the table's step count, advanced once per training step:
    float32, exact up to 2^24 steps), the slots `momenta` and `velocities`
    (`(input_dim,)` with `second_moment="rowwise"`; of the optimizer's
    `momentum_dtype` and `velocity_dtype`), and with
    `bias_correction="per_row"` a float32 `row_steps`. `iterations` is the
    layer's trainable variable, which the model's optimizer overwrites with the
    value the lookup's backward pass computes for it
    (`overwrite_with_gradient`); on JAX, whose gradients cannot update state in
    place, the table and slots are overwritten the same way (under `jax.jit`
    with donated state, as Keras's trainer runs it, in place).

    With `lazy_adam=False` (ordinary Adam, in which a row not looked up
    keeps moving), a row's skipped steps are applied in closed form when it
    is next read, so the table trains with ordinary Adam's numbers at the
    cost of the rows looked up (docs/algorithms.md#ordinary-adam-at-the-cost-of-the-rows-looked-up).
    The state adds `row_steps` (the step each row is current at) and
    `catch_up_sums` (a window of sums shared by every row); each step also
    brings a run of `input_dim / window` rows up to date, so that no row falls
    more than the window behind. Lookups outside training read caught-up rows,
    and saving brings the whole table up to date first; `catch_up` does that
    for code that reads the variables directly (`get_weights()`), and code that
    assigns them caught-up values calls `restart_catch_up_sums`. With betas for
    which no short series reaches float32 accuracy (`beta_1 / sqrt(beta_2)`
    near 1, e.g. `beta_2=0.99` with `beta_1=0.9`), every row is stepped every
    step instead.

    An id outside `[0, input_dim)` reads a zero row and trains nothing (no
    row, slot or count of its own), on every backend, eager or compiled; such
    ids are counted in `out_of_range_ids` (an int32 variable, not saved), and
    a step run eagerly warns once (docs/algorithms.md#ids-out-of-range).

    Under a loss scale (the model's `LossScaleOptimizer`, as `mixed_float16`
    makes it, or `loss_scale_factor`) the rows' gradient is unscaled: the
    layer adds a zero to the model's losses whose gradient is the scale. With
    `skip_nonfinite_updates=True` in this optimizer or the model's, or under a
    `LossScaleOptimizer`, a step in which the looked-up rows' gradient holds a
    NaN or an Inf leaves the table, its slots and `iterations` as they were,
    and the model's optimizer, where it skips such steps, skips it too. The
    layer sees only its rows: on TF and torch a step whose other gradients
    alone are not finite still trains the table
    (docs/algorithms.md#non-finite-steps-in-the-layers).

    Requirements, each checked where it can be: the layer is called once per
    training step (to look up several id tensors, concatenate them; checked
    but in eager TensorFlow and under `torch.compile`); of the `tf.distribute`
    strategies, `MirroredStrategy` and `MultiWorkerMirroredStrategy`, with
    `lazy_adam=True` and without skipping non-finite steps (every replica's
    rows reach one update); the table is read only through the layer; the
    optimizer has no `use_ema`, `gradient_accumulation_steps`, `clipnorm`,
    `global_clipnorm`, `loss_scale_factor` or `slot_variable_creation_fn`; the
    table has no `embeddings_regularizer`, `embeddings_constraint`, LoRA or
    quantization; the model's optimizer does not accumulate gradients over
    steps (`gradient_accumulation_steps`, checked where Keras calls the model).

    Args:
        input_dim, output_dim, embeddings_initializer, embeddings_regularizer,
        embeddings_constraint, mask_zero, weights, lora_rank, lora_alpha: as
            for `keras.layers.Embedding`.
        optimizer: None, or a `keras_tpu_optim.EmbeddingAdam` that trains the
            table in the lookup's backward pass. Only its configuration is
            used; the layer keeps the state.
    """

    def __init__(self, input_dim, output_dim, *args, optimizer=None, **kwargs):
        self._table_optimizer = _check_optimizer(optimizer)
        # Not state: kept out of Keras's tracking. The cache: what the backend keeps for the lookup.
        self.__dict__.update(_last_lookup_trace=None, _backend_cache={})
        if self._table_optimizer is not None:
            for argument in (
                "embeddings_regularizer",
                "embeddings_constraint",
                "lora_rank",
                "quantization_config",
            ):
                if kwargs.get(argument) is not None:
                    raise ValueError(
                        f"keras_tpu_optim.layers.Embedding: `{argument}` cannot be combined with `optimizer` "
                        "(the table is updated row by row in the lookup's backward pass). "
                        f"Received: {argument}={kwargs[argument]!r}"
                    )
        super().__init__(input_dim, output_dim, *args, **kwargs)

    @property
    def optimizer(self):
        """The `EmbeddingAdam` that trains the table in the lookup's backward pass, or None."""
        return self._table_optimizer

    def build(self, input_shape=None):
        if self._table_optimizer is None:
            return super().build(input_shape)
        if self.built:
            return
        _check_optimizer(self._table_optimizer)
        # JAX updates state only through gradients: there every state variable is "trained" by
        # being overwritten with the value the lookup's backward pass computes for it.
        in_gradients = keras.backend.backend() == "jax"
        state = dict(trainable=in_gradients, overwrite_with_gradient=in_gradients)
        rows, table = (self.input_dim,), (self.input_dim, self.output_dim)
        # Not autocast: the lookup reads and writes the stored rows (a mixed policy's compute dtype is the
        # output's). Every replica of a `tf.distribute` strategy writes the same values: the first's reach
        # every copy.
        state.update(autocast=False, aggregation="only_first_replica")
        self._embeddings = self.add_weight(
            shape=table, initializer=self.embeddings_initializer, name="embeddings", **state
        )
        zeros = dict(state, initializer="zeros", dtype="float32")
        self.iterations = self.add_weight(
            shape=(), name="iterations", **dict(zeros, trainable=True, overwrite_with_gradient=True)
        )
        # The state EmbeddingAdam keeps beside a table; `row_steps` below.
        for name, axes, dtype in self._table_optimizer._table_state_plan()[:2]:
            shape = table if axes is None else tuple(table[i] for i in axes)
            setattr(self, name, self._add_row_state(name, shape, in_gradients, dtype))
        rate = _private.raw_learning_rate(self._table_optimizer)
        if isinstance(rate, keras.Variable):
            # Tracked as the layer's: a compiled JAX step reads its value, not the value when traced.
            self._table_learning_rate = rate
        self.out_of_range_ids = self.add_weight(
            shape=(),
            initializer="zeros",
            dtype="int32",
            trainable=False,
            aggregation="sum",
            name="out_of_range_ids",
        )
        self.row_steps = self.catch_up_sums = None
        terms = self._catch_up_terms()
        if self._table_optimizer.bias_correction == "per_row" or terms:
            # float32 where the optimizer's is int32: on JAX the state is written through its gradient,
            # which integers do not have (exact to 2^24 steps a row).
            self.row_steps = self._add_row_state("row_steps", rows, in_gradients)
        if terms:
            window = catch_up_math.window_size(self.input_dim, self.output_dim, terms)
            self.catch_up_sums = self.add_weight(  # every row current: `log E = 0`, `C = 0`
                shape=(terms + 1, window + 1), name="catch_up_sums", **zeros
            )
        self.built = True

    def _add_row_state(self, name, shape, in_gradients, dtype="float32"):
        """A state variable of the table's rows, zeros, laid out like the table along its first axes
        (`keras.distribution`): a LayoutMap naming only the table splits its state too, and a key laying
        the state out apart from its table is refused (`_checks.check_slot_layouts`)."""
        layout = _slots.kept_layout(_private.variable_layout(self._embeddings), range(len(shape)))
        path = self._embeddings.path.rsplit("/", 1)[0] + "/" + name
        axes = tuple(getattr(layout, "axes", None) or (None,) * len(shape))
        _checks.check_slot_layouts(
            type(self), [_slots.PlannedSlot(path, shape, axes, self._embeddings.path)]
        )
        with keras.name_scope(self.name, caller=self):
            variable = keras.Variable(
                keras.initializers.Zeros(),
                shape=shape,
                dtype=dtype,
                trainable=in_gradients,
                autocast=False,
                aggregation="only_first_replica",
                layout=layout,
                name=name,
            )
        variable.overwrite_with_gradient = in_gradients
        return variable

    def _catch_up_terms(self):
        """The catch-up's number of series terms with `lazy_adam=False` (`_math.catch_up`), or None: lazy,
        or betas for which no short series reaches float32 accuracy (then every row steps every step)."""
        o = self._table_optimizer
        if o.lazy_adam:
            return None
        found = catch_up_math.series(o.beta_1, o.beta_2, o.sum_inside_sqrt)
        return found and found[0]

    def _row_state(self):
        """The table and its slots, in the order `row_update` reads them."""
        state = (self._embeddings, self.momenta, self.velocities)
        return state if self.row_steps is None else state + (self.row_steps,)

    def _row_update_arguments(self, step):
        """`(learning_rate, options)` of the row update after `step` updates (`adam_math.RowUpdate`)."""
        optimizer = self._table_optimizer
        _check_optimizer(optimizer)  # Hyperparameters may have been set since the layer was built.
        built = [
            ("second_moment", "rowwise" if len(self.velocities.shape) == 1 else "full"),
            ("momentum_dtype", keras.backend.standardize_dtype(self.momenta.dtype)),
            ("velocity_dtype", keras.backend.standardize_dtype(self.velocities.dtype)),
        ]
        if self.catch_up_sums is None:  # (caught up, every row has the global count)
            built.append(("bias_correction", "global" if self.row_steps is None else "per_row"))
        for name, built_with in built:
            if getattr(optimizer, name) != built_with:
                raise ValueError(
                    f"keras_tpu_optim.layers.Embedding: its optimizer's `{name}` decides the table's slots, which "
                    f"are built: set it before the layer is built. Received: {name}={getattr(optimizer, name)!r}"
                )
        built_terms = None if self.catch_up_sums is None else self.catch_up_sums.shape[0] - 1
        if built_terms != self._catch_up_terms():
            raise ValueError(
                "keras_tpu_optim.layers.Embedding: its optimizer's `lazy_adam`, `beta_1`, `beta_2` and "
                "`sum_inside_sqrt` decide the table's catch-up state, which is built: set them before the layer "
                f"is built. Received: lazy_adam={optimizer.lazy_adam!r}, beta_1={optimizer.beta_1!r}, "
                f"beta_2={optimizer.beta_2!r}, sum_inside_sqrt={optimizer.sum_inside_sqrt!r}"
            )
        if self.catch_up_sums is not None and (
            optimizer.stochastic_rounding
            or optimizer.momentum_dtype != "float32"
            or optimizer.velocity_dtype != "float32"
        ):
            raise ValueError(
                "keras_tpu_optim.layers.Embedding: `lazy_adam=False` catches rows up in float32 and rounds "
                "to nearest; it cannot keep bfloat16 slots or stochastic rounding. Received: "
                f"momentum_dtype={optimizer.momentum_dtype!r}, velocity_dtype={optimizer.velocity_dtype!r}, "
                f"stochastic_rounding={optimizer.stochastic_rounding!r}"
            )
        learning_rate = optimizer._row_learning_rate(step)
        options = optimizer._row_update_options(self._embeddings)
        if self.catch_up_sums is not None:
            options = dataclasses.replace(options, catch_up_window=self.catch_up_sums.shape[1] - 1)
        return learning_rate, options

    def call(self, inputs, training=None):
        if self._table_optimizer is None:
            return super().call(inputs)
        # Read in every call with the model calling: JAX's step calls it statelessly (no call context), but
        # Keras builds it symbolically, calling it, before the first step after `compile`.
        found = _model_optimizer()
        if found is not None:
            self.__dict__["_model_optimizer"] = found
        if inputs.dtype != "int32" and inputs.dtype != "int64":
            inputs = ops.cast(inputs, "int32")
        ids, outside = self._counted_in_table(inputs)
        if not training or not self.trainable:
            step = self.iterations.value
            readable = sparse_rows.clipped(ids, self.input_dim)
            if self.catch_up_sums is None:
                outputs = ops.take(self._embeddings.value, readable, axis=0)
            else:
                outputs = catch_up_math.read_rows(
                    tuple(v.value for v in self._row_state()),
                    readable,
                    step,
                    self.catch_up_sums.value,
                    self._row_update_arguments(step)[1],
                )
            return self._masked(outputs, outside)
        self._check_one_lookup_per_step()
        optimizer = self._table_optimizer
        skip_with_model, steps = self.__dict__.get("_model_optimizer", (False, None))
        if steps:
            raise ValueError(
                f"keras_tpu_optim.layers.Embedding '{self.name}' with `optimizer`: the model's optimizer has "
                f"`gradient_accumulation_steps={steps!r}`, which is not supported (the table is updated in the "
                "backward pass of every step, not once per accumulated step). Compile the model without it, or "
                "use this layer without `optimizer`."
            )
        # Read where Keras maps the variables to the step's state.
        learning_rate, options = self._row_update_arguments(self.iterations.value)
        outputs, loss_scale_probe = backend.trained_lookup(
            ids,
            self._row_state(),
            self.iterations,
            learning_rate,
            options,
            lazy=optimizer.lazy_adam,
            accumulate_duplicates=optimizer.use_gradient_accumulation,
            window=self.catch_up_sums,
            cache=self._backend_cache,
            name=self.name,
            skip_nonfinite=optimizer.skip_nonfinite_updates or skip_with_model,
            skip_with_model=skip_with_model,
        )
        # A zero whose gradient is the scale of the loss (`trained_lookup`), in the loss's dtype.
        self.add_loss(ops.cast(loss_scale_probe, keras.config.floatx()))
        return self._masked(outputs, outside)

    def _counted_in_table(self, ids):
        """`(ids, outside)`: `ids` with those out of range moved past the table (`sparse_rows.in_table`),
        counted in `out_of_range_ids`, and where they are (None where none is, known eagerly: the ids are
        then used as they are). The first count read eagerly that is not 0 is said in a warning."""
        outside = sparse_rows.out_of_range(ids, self.input_dim)
        count = ops.sum(ops.cast(outside, "int32"))
        known = backend.host_value(count)
        if known == 0:
            return ids, None
        self.out_of_range_ids.assign_add(count)
        if known and not self.__dict__.get("_warned_out_of_range"):
            self.__dict__["_warned_out_of_range"] = True
            warnings.warn(
                f"keras_tpu_optim.layers.Embedding '{self.name}': a lookup has ids outside [0, "
                f"{self.input_dim}), which read zero rows and train nothing. They are counted in the layer's "
                "`out_of_range_ids`; this is said once.",
                stacklevel=3,
            )
        return sparse_rows.in_table(ids, self.input_dim, outside), ops.expand_dims(outside, -1)

    def _masked(self, outputs, outside):
        """The looked-up `outputs` with the rows of ids out of range zero, in the layer's compute dtype."""
        if outside is not None:
            outputs = ops.where(outside, 0, outputs)
        return ops.cast(outputs, dtype=self.compute_dtype)

    def catch_up(self):
        """With `lazy_adam=False`: bring every row of the table and its slots to ordinary Adam's values now,
        in one pass over the table (eagerly). Training steps and lookups do this for the rows they read, and
        saving does it for the whole table; call it before reading the variables directly (`get_weights()`).
        Without `lazy_adam=False` there is nothing to do."""
        if not self.built or self.catch_up_sums is None:
            return
        step = ops.stop_gradient(self.iterations.value)
        options = self._row_update_arguments(step)[1]
        state = self._row_state()
        chunk = max(1, (1 << 22) // max(1, self.output_dim))
        pieces = []
        for start in range(0, self.input_dim, chunk):
            rows = slice(start, min(self.input_dim, start + chunk))
            pieces.append(
                catch_up_math.caught_up(
                    # Copies: `caught_up` updates the rows it is given in place (torch).
                    *(ops.copy(ops.cast(v.value[rows], "float32")) for v in state[:3]),
                    state[3].value[rows],
                    step,
                    self.catch_up_sums.value,
                    options,
                )
            )
        for i, variable in enumerate(state[:3]):
            variable.assign(
                ops.cast(ops.concatenate([p[i] for p in pieces], axis=0), variable.dtype)
            )
        self.row_steps.assign(ops.zeros(self.row_steps.shape, "float32") + step)
        self.restart_catch_up_sums()

    def restart_catch_up_sums(self):
        """With `lazy_adam=False`: start the window of sums that rows behind are caught up from afresh. Call it
        after assigning every row caught-up values (`row_steps` at `iterations`), as `catch_up` and loading do:
        the old sums are read no more. Without `lazy_adam=False` there is nothing to do."""
        if self.catch_up_sums is not None:
            self.catch_up_sums.assign(ops.zeros(self.catch_up_sums.shape))

    def _check_one_lookup_per_step(self):
        """Raise if the layer looks up twice in one traced step, told by the trace of `iterations` (torch
        checks in the lookup's backward pass, eager TF not at all)."""
        trace = backend.lookup_trace(self.iterations)
        if trace is not None and trace is self._last_lookup_trace:
            raise ValueError(
                f"keras_tpu_optim.layers.Embedding '{self.name}' with `optimizer` is called twice in one training "
                "step; each call would update the table by itself. Look all ids up in one call (concatenate them), "
                "or use a layer without `optimizer`."
            )
        self.__dict__["_last_lookup_trace"] = trace

    def save_own_variables(self, store):
        if self._table_optimizer is None:
            return super().save_own_variables(store)
        self.catch_up()
        for i, variable in enumerate(self.table_state().values()):
            store[str(i)] = variable

    def table_state(self) -> dict:
        """With `optimizer`, once built: `{name: variable}` of the table and the state that trains it, in the
        order saved: `embeddings`, `iterations`, `momenta`, `velocities`, then `row_steps` and
        `catch_up_sums` where the optimizer's options have them."""
        names = ("iterations", "momenta", "velocities", "row_steps", "catch_up_sums")
        state = {"embeddings": self._embeddings, **{n: getattr(self, n) for n in names}}
        return {name: variable for name, variable in state.items() if variable is not None}

    def load_own_variables(self, store):
        if self._table_optimizer is None:
            return super().load_own_variables(store)
        variables = list(self.table_state().values())
        # Written before `lazy_adam=False` caught rows up (no sums, `row_steps` only with per-row bias
        # correction): every row was stepped every step, so is current.
        stepped_every_row = self.catch_up_sums is not None and len(store.keys()) in (4, 5)
        if stepped_every_row:
            variables = variables[: len(store.keys())]
        if len(store.keys()) != len(variables):
            raise ValueError(
                f"Layer '{self.name}' expected {len(variables)} variables (the table, its step count and slots), "
                f"but received {len(store.keys())} variables during loading."
            )
        for i, variable in enumerate(variables):
            variable.assign(store[str(i)])
        if stepped_every_row:
            self.row_steps.assign(
                ops.zeros(self.row_steps.shape, "float32") + self.iterations.value
            )
            self.restart_catch_up_sums()

    def get_config(self):
        config = super().get_config()
        optimizer = self._table_optimizer
        config["optimizer"] = None if optimizer is None else keras.optimizers.serialize(optimizer)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if config.get("optimizer") is not None:
            config["optimizer"] = keras.optimizers.deserialize(config["optimizer"])
        return super().from_config(config)
