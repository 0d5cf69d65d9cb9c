"""Many tables behind one layer, in the shape of `keras_rs.layers.DistributedEmbedding`, each table trained
in the backward pass of the lookup by its `EmbeddingAdam`; tables that can be stepped together are stored
as one stacked table (docs/algorithms.md#many-tables-in-one-layer)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional

import keras
import numpy as np
from keras import ops

from keras_tpu_optim import _private
from keras_tpu_optim._backend import backend
from keras_tpu_optim.embedding_adam import EmbeddingAdam
from keras_tpu_optim.layers.embedding import Embedding

COMBINERS = ("mean", "sum", "sqrtn")


@dataclasses.dataclass(eq=False)
class TableConfig:
    """One embedding table: `keras_rs.layers.TableConfig`'s fields, where `optimizer=None` (the default)
    means the layer's optimizer.

    Attributes:
        name: The table's name, unique in the layer; its state is saved under it.
        vocabulary_size: The number of rows.
        embedding_dim: The width of a row.
        initializer: The rows' initializer (each table gets its own copy).
        optimizer: None (the layer's `optimizer`), a `keras_tpu_optim.EmbeddingAdam`, a
            `keras.optimizers.Adam` or `"adam"` (mapped to the `EmbeddingAdam` with Adam's numbers).
        combiner: How the rows of a feature with several ids per example are pooled: `"mean"`,
            `"sum"` or `"sqrtn"`.
        placement: `"auto"` or `"default_device"`: the table lives with the rest of the model.
    """

    name: str
    vocabulary_size: int
    embedding_dim: int
    initializer: Any = dataclasses.field(
        default_factory=lambda: keras.initializers.VarianceScaling(mode="fan_out")
    )
    optimizer: Any = None
    combiner: str = "mean"
    placement: str = "auto"

    def get_config(self):
        """The config as plain values (also of a keras-rs `TableConfig`: `TableConfig.get_config(config)`)."""
        optimizer = self.optimizer
        if isinstance(optimizer, keras.optimizers.Optimizer):
            optimizer = keras.optimizers.serialize(optimizer)
        return dict(
            name=self.name,
            vocabulary_size=self.vocabulary_size,
            embedding_dim=self.embedding_dim,
            initializer=keras.initializers.serialize(keras.initializers.get(self.initializer)),
            optimizer=optimizer,
            combiner=self.combiner,
            placement=getattr(self, "placement", "auto"),
        )

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["initializer"] = keras.initializers.deserialize(config["initializer"])
        if isinstance(config["optimizer"], dict):
            config["optimizer"] = keras.optimizers.deserialize(config["optimizer"])
        return cls(**config)


@dataclasses.dataclass(eq=False)
class FeatureConfig:
    """One feature looked up in a table: `keras_rs.layers.FeatureConfig`'s fields; several features may share
    a `table`. `input_shape` and `output_shape` (batch first, None for any size) are checked when given."""

    name: str
    table: TableConfig
    input_shape: Optional[tuple] = None
    output_shape: Optional[tuple] = None

    def get_config(self):
        """The config as plain values, its table by name (also of a keras-rs `FeatureConfig`)."""
        return dict(
            name=self.name,
            table=self.table.name,
            input_shape=None if self.input_shape is None else list(self.input_shape),
            output_shape=None if self.output_shape is None else list(self.output_shape),
        )

    @classmethod
    def from_config(cls, config, tables):
        """The feature of `config`, its table from `tables` (`{name: TableConfig}`)."""
        return cls(
            name=config["name"],
            table=tables[config["table"]],
            input_shape=None if config["input_shape"] is None else tuple(config["input_shape"]),
            output_shape=None if config["output_shape"] is None else tuple(config["output_shape"]),
        )


def _table_error(table_name, message):
    return ValueError(
        f"keras_tpu_optim.layers.DistributedEmbedding: table '{table_name}': {message}"
    )


def _table_optimizer(table, layer_optimizer, adam_for):
    """The `EmbeddingAdam` that trains `table` (`adam_for`: the converted Adam of each Adam instance)."""
    optimizer = table.optimizer
    is_adam_name = isinstance(optimizer, str) and optimizer.lower() == "adam"
    if optimizer is None or is_adam_name:
        if layer_optimizer is not None:
            return layer_optimizer
        if optimizer is None:
            raise _table_error(
                table.name,
                "it has no optimizer. Pass `optimizer=kto.EmbeddingAdam(...)` to the layer (the tables' "
                "default) or to the table's config.",
            )
    if isinstance(optimizer, EmbeddingAdam):
        return optimizer
    # Keras's Adam (on torch, its torch subclass of the same name), not a subclass such as AdamW.
    if is_adam_name or (
        isinstance(optimizer, keras.optimizers.Adam) and type(optimizer).__name__ == "Adam"
    ):
        key = "adam" if is_adam_name else id(optimizer)
        if key not in adam_for:
            adam_for[key] = _from_adam(
                table.name, keras.optimizers.Adam() if is_adam_name else optimizer
            )
        return adam_for[key][0]
    name = optimizer if isinstance(optimizer, str) else type(optimizer).__name__
    raise _table_error(
        table.name,
        f"its optimizer {name!r} is not supported: a table is trained by a `keras_tpu_optim.EmbeddingAdam`, a "
        "`keras.optimizers.Adam` or `\"adam\"` (Adam's numbers), or None (the layer's optimizer).",
    )


def _from_adam(table_name, adam):
    """`(EmbeddingAdam, adam)`: Keras's Adam as the `EmbeddingAdam` with its numbers (epsilon outside the root)."""
    config = adam.get_config()
    if config.pop("amsgrad"):
        raise _table_error(
            table_name, "its `keras.optimizers.Adam` has `amsgrad=True`, which is not supported."
        )
    config.pop("name", None)
    config["learning_rate"] = _private.raw_learning_rate(adam)
    if isinstance(config["learning_rate"], keras.Variable):
        config["learning_rate"] = float(ops.convert_to_numpy(config["learning_rate"]))
    return EmbeddingAdam(**config, sum_inside_sqrt=False), adam


def _copied_initializer(initializer, index):
    """A copy of `initializer` for the table at `index`: its own instance, and a seed of its own where one is set
    (keras-rs hands every table one instance, so two tables of one shape would start identical)."""
    initializer = keras.initializers.get(initializer)
    if not isinstance(initializer, keras.initializers.Initializer):
        return initializer  # A plain callable: called once per table with that table's shape.
    config = initializer.get_config()
    if isinstance(config.get("seed"), int):
        config["seed"] = config["seed"] + index
    return type(initializer).from_config(config)


def _padded_rows(rows):
    """A stacked table's rows: its tables' and at least one zero row (absent entries look it up), up to a
    multiple of 1,024 (of a power of two below that), so that a layout splits it over devices evenly."""
    multiple = min(1024, 1 << rows.bit_length())
    return -(-(rows + 1) // multiple) * multiple


def _optimizer_key(optimizer):
    config = dict(keras.optimizers.serialize(optimizer)["config"])
    config.pop("name", None)
    return json.dumps(config, sort_keys=True, default=repr)


class _Grouping:
    """The groups (`kto.layers.Embedding`s of stacked tables), each group's `(table config, optimizer)`s and
    their rows, each table's `(group index, first row)`, and each group's features."""

    def __init__(self):
        self.groups, self.members, self.placement, self.features, self.rows = [], [], {}, [], []


class _Stacked(keras.initializers.Initializer):
    """The stacked table's initial rows: each table's own initializer on its own shape, one after another."""

    def __init__(self, parts):
        self.parts = parts  # [(initializer, rows)]

    def __call__(self, shape, dtype=None):
        return ops.concatenate(
            [
                ops.cast(keras.initializers.get(init)((rows, shape[1]), dtype=dtype), dtype)
                for init, rows in self.parts
            ],
            axis=0,
        )


@keras.saving.register_keras_serializable(package="keras_tpu_optim")
class DistributedEmbedding(keras.layers.Layer):
    """`keras_rs.layers.DistributedEmbedding`'s layer on every device, its tables trained by `EmbeddingAdam` in the
    backward pass of the lookup, the tables of a step updated together.

    `feature_configs` is a nested structure (dict, list, ...) of `FeatureConfig`s, ours or keras-rs's;
    the layer's inputs (and `weights`) have that structure, and so have its outputs. A feature's ids of
    shape `(batch,)` give `(batch, dim)` rows; ids of shape `(batch, n)` give their rows pooled by the
    table's `combiner` (weighted by `weights` of the ids' shape, when given; a weight of 0 pads).

    Every table is trained by an `EmbeddingAdam`, its `TableConfig`'s `optimizer` or else the layer's
    `optimizer`; a `keras.optimizers.Adam`, or `"adam"`, becomes the `EmbeddingAdam` with Adam's numbers
    (`sum_inside_sqrt=False`, Adam's epsilon, learning rate and decay), converted when the layer is made.
    keras-rs's `TableConfig` sets `optimizer="adam"` unless told otherwise, so a table whose optimizer is
    the string `"adam"` takes the layer's `optimizer` where one is given, and Keras's default Adam where
    not. Any other optimizer raises, naming the table.

    Tables of the same width whose optimizers have equal configurations form a group, stored as one stacked
    table with its slots and step count (the variables of an internal `kto.layers.Embedding`): a training
    step looks each group's ids up at once and updates each group once, so its work grows with the number
    of groups, not of tables. Features sharing a table add their ids to one update (duplicates summed, or
    the last kept, as the optimizer says). `model.save` and `save_weights` store each table, its slots and
    step count under the table's name, so a file loads into any grouping of the same tables;
    `get_embedding_tables()` returns `{table name: rows}`. Everything `kto.layers.Embedding` with
    `optimizer` requires holds here, per group (one call per training step, the model's optimizer
    unscaled, ...). An id outside its table's `[0, vocabulary_size)` reads a zero row, trains nothing (no
    row of its table or of another) and is counted in `out_of_range_ids`, as in `kto.layers.Embedding`.

    Args:
        feature_configs: A nested structure of `FeatureConfig`s.
        optimizer: The `EmbeddingAdam` of every table whose config names no optimizer (or `"adam"`).
        table_stacking: `"auto"` (the grouping above), as keras-rs spells it.
    """

    def __init__(self, feature_configs, *, optimizer=None, table_stacking="auto", **kwargs):
        super().__init__(**kwargs)
        if table_stacking != "auto":
            raise ValueError(
                "keras_tpu_optim.layers.DistributedEmbedding groups its tables itself: `table_stacking` must be "
                f"'auto'. Received: table_stacking={table_stacking!r}"
            )
        if optimizer is not None and not isinstance(optimizer, EmbeddingAdam):
            raise ValueError(
                "Argument `optimizer` must be None or a `keras_tpu_optim.EmbeddingAdam`. "
                f"Received: optimizer={optimizer!r}"
            )
        # Plain attributes, kept out of Keras's tracking (which would wrap the structure's dicts and lists).
        self.__dict__["feature_configs"] = feature_configs
        self.__dict__["_optimizer"] = optimizer
        self.__dict__["_features"] = keras.tree.flatten(feature_configs)
        if not self._features:
            raise ValueError(
                "keras_tpu_optim.layers.DistributedEmbedding: `feature_configs` is empty."
            )
        self.__dict__["_tables"] = self._checked_tables()
        adam_for = {}
        optimizers = [_table_optimizer(t, optimizer, adam_for) for t in self._tables]
        # A group: tables of one width whose optimizers have one configuration.
        groups = {}
        for index, (table, table_optimizer) in enumerate(zip(self._tables, optimizers)):
            key = (table.embedding_dim, _optimizer_key(table_optimizer))
            groups.setdefault(key, []).append((index, table, table_optimizer))
        # The groups are sublayers (their variables are the layer's) reached through a plain object, not an
        # attribute Keras's saving walks: their state is saved per table, so that a file does not depend on
        # the grouping.
        grouping = self.__dict__["_grouping"] = _Grouping()
        for members in groups.values():
            offset, parts = 0, []
            for index, table, _ in members:
                grouping.placement[table.name] = (len(grouping.groups), offset)
                parts.append((_copied_initializer(table.initializer, index), table.vocabulary_size))
                offset += table.vocabulary_size
            names = [table.name for _, table, _ in members]
            try:
                group = Embedding(
                    _padded_rows(offset),
                    members[0][1].embedding_dim,
                    embeddings_initializer=_Stacked(
                        parts + [("zeros", _padded_rows(offset) - offset)]
                    ),
                    optimizer=members[0][2],
                    name=re.sub(r"[^A-Za-z0-9_.-]", "_", "_".join(names))[:100],
                    dtype=self.dtype_policy,
                )
            except ValueError as error:
                raise _table_error(names[0], str(error)) from None
            grouping.members.append([(table, o) for _, table, o in members])
            grouping.groups.append(self._tracker.track(group))
            grouping.rows.append(offset)
        grouping.features = [[] for _ in grouping.groups]
        for i, feature in enumerate(self._features):
            grouping.features[grouping.placement[feature.table.name][0]].append(i)

    def _checked_tables(self):
        """The distinct tables of the features, in order of first use, each checked."""
        tables, names = [], {}
        for feature in self._features:
            for field in ("name", "table"):
                if not hasattr(feature, field):
                    raise ValueError(
                        "keras_tpu_optim.layers.DistributedEmbedding: `feature_configs` must hold `FeatureConfig`s "
                        f"(ours or keras-rs's). Received: {feature!r}"
                    )
            table = feature.table
            if table is None or not hasattr(table, "vocabulary_size"):
                raise ValueError(
                    f"keras_tpu_optim.layers.DistributedEmbedding: feature '{feature.name}' has no table. "
                    f"Received: table={table!r}"
                )
            expected = getattr(feature, "output_shape", None)
            if expected is not None and tuple(expected)[-1:] != (table.embedding_dim,):
                raise ValueError(
                    f"keras_tpu_optim.layers.DistributedEmbedding: feature '{feature.name}' has `output_shape="
                    f"{tuple(expected)}`, but its table's rows are {table.embedding_dim} wide."
                )
            if any(table is t for t in tables):
                continue
            if table.name in names:
                raise _table_error(
                    table.name, "two different tables have this name; table names must be unique."
                )
            if not table.name or "/" in table.name:
                raise _table_error(table.name, "a table's name must be non-empty and without '/'.")
            for field in ("vocabulary_size", "embedding_dim"):
                value = getattr(table, field)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    raise _table_error(
                        table.name, f"`{field}` must be a positive integer. Received: {value!r}"
                    )
            if table.combiner not in COMBINERS:
                raise _table_error(
                    table.name,
                    f"`combiner` must be one of {COMBINERS}. Received: {table.combiner!r}",
                )
            placement = getattr(table, "placement", "auto")
            if placement not in ("auto", "default_device"):
                raise _table_error(
                    table.name,
                    "this layer keeps its tables with the rest of the model: `placement` must be 'auto' or "
                    f"'default_device' (convert the optimizers with `kto.tpu.to_tpu_embedding` for keras-rs "
                    f"on TPU). Received: placement={placement!r}",
                )
            names[table.name] = table
            tables.append(table)
        return tables

    @property
    def out_of_range_ids(self):
        """The number of ids looked up outside their table's range so far (each read a zero row and trained
        nothing), over every table: the sum of the groups' `kto.layers.Embedding.out_of_range_ids`."""
        return sum(ops.convert_to_tensor(g.out_of_range_ids) for g in self._grouping.groups)

    @property
    def optimizer(self):
        """The layer's `EmbeddingAdam` (for tables that name none), or None."""
        return self._optimizer

    def table_optimizer(self, name):
        """The `EmbeddingAdam` that trains the table `name`."""
        group, _ = self._grouping.placement[name]
        return dict((t.name, o) for t, o in self._grouping.members[group])[name]

    def build(self, input_shapes=None):
        # The ids' shapes are checked on the tensors, in `call`.
        for group in self._grouping.groups:
            group.build()
        self.built = True

    def _check_shape(self, feature, shape):
        if len(shape) not in (1, 2):
            raise ValueError(
                f"keras_tpu_optim.layers.DistributedEmbedding: feature '{feature.name}' must have ids of shape "
                f"(batch,) or (batch, ids per example). Received: shape={shape}"
            )
        expected = getattr(feature, "input_shape", None)
        if expected is not None and (
            len(expected) != len(shape)
            or any(e is not None and s is not None and e != s for e, s in zip(expected, shape))
        ):
            raise ValueError(
                f"keras_tpu_optim.layers.DistributedEmbedding: feature '{feature.name}' has `input_shape="
                f"{tuple(expected)}`. Received: ids of shape {shape}"
            )

    def compute_output_spec(self, inputs, weights=None, training=None):
        flat = keras.tree.flatten(inputs)
        outputs = [
            keras.KerasTensor((x.shape[0], f.table.embedding_dim), dtype=self.compute_dtype)
            for f, x in zip(self._features, flat)
        ]
        return keras.tree.pack_sequence_as(self.feature_configs, outputs)

    def call(self, inputs, weights=None, training=None):
        flat = keras.tree.flatten(inputs)
        if len(flat) != len(self._features):
            raise ValueError(
                f"keras_tpu_optim.layers.DistributedEmbedding: {len(self._features)} features are configured, "
                f"but the inputs hold {len(flat)} tensors; they must have `feature_configs`' structure."
            )
        flat_weights = [None] * len(flat) if weights is None else keras.tree.flatten(weights)
        self._check_group_optimizers()
        present = [None] * len(flat)
        for i, feature in enumerate(self._features):
            width = (getattr(feature, "input_shape", None) or (None, None))[-1]
            flat[i], present[i], flat_weights[i] = backend.dense_ids(
                flat[i], flat_weights[i], width
            )
            self._check_shape(feature, tuple(flat[i].shape))
        outputs = [None] * len(flat)
        for group, members in zip(self._grouping.groups, self._grouping.features):
            rows = self._grouped_lookup(
                group, [flat[i] for i in members], [present[i] for i in members], members, training
            )
            for i, looked_up in zip(members, rows):
                outputs[i] = self._pooled(
                    looked_up, flat_weights[i], self._features[i].table.combiner, len(flat[i].shape)
                )
        return keras.tree.pack_sequence_as(self.feature_configs, outputs)

    def _grouped_lookup(self, group, ids, present, members, training):
        """The rows of `ids` (the id tensors of the group's features `members`; `present`: None, or where an
        entry of a ragged or sparse input is), by one call of the group's layer: ids of one shape stacked (a
        step's work then does not grow with their number), others flattened and concatenated."""
        tables = [self._features[i].table for i in members]
        ids = [x if x.dtype == "int32" else ops.cast(x, "int32") for x in ids]
        if any(p is not None for p in present):
            present = [ops.ones_like(x, "bool") if p is None else p for x, p in zip(ids, present)]
        else:
            present = None
        shapes = [tuple(x.shape) for x in ids]
        if all(shape == shapes[0] for shape in shapes):
            stack = (lambda xs: xs[0][None]) if len(ids) == 1 else ops.stack
            stacked = self._stacked_ids(
                stack(ids), None if present is None else stack(present), tables, len(shapes[0])
            )
            rows = group(stacked, training=training)
            return [rows[0]] if len(ids) == 1 else list(backend.unstacked(rows))
        flat = [ops.reshape(x, (-1,)) for x in ids]
        stacked = [
            self._stacked_ids(
                f[None], None if present is None else ops.reshape(p, (1, -1)), [t], 1
            )[0]
            for f, p, t in zip(flat, present or [None] * len(flat), tables)
        ]
        rows = group(ops.concatenate(stacked, axis=0), training=training)
        out, start = [], 0
        for x, f in zip(ids, flat):
            size = ops.shape(f)[0]
            out.append(
                ops.reshape(rows[start : start + size], tuple(ops.shape(x)) + (group.output_dim,))
            )
            start = start + size
        return out

    def _stacked_ids(self, ids, present, tables, rank):
        """`ids` (`(len(tables), *shape)`) as rows of their group's stacked table: an absent entry reads the zero
        row after the tables, an id out of its table's range maps past the stacked table."""
        group, _ = self._grouping.placement[tables[0].name]
        sink = self._grouping.rows[group]
        per_table = (len(tables),) + (1,) * rank
        offsets = [self._grouping.placement[t.name][1] for t in tables]
        offsets = ops.reshape(ops.convert_to_tensor(offsets, "int32"), per_table)
        sizes = ops.reshape(
            ops.convert_to_tensor([t.vocabulary_size for t in tables], "int32"), per_table
        )
        outside = ops.logical_or(ids < 0, ids >= sizes)
        rows = ops.where(outside, self._grouping.groups[group].input_dim, ids + offsets)
        return rows if present is None else ops.where(present, rows, sink)

    def _pooled(self, rows, weights, combiner, rank):
        """keras-rs's `EmbedReduce`: rows of `(batch,)` ids as they are (times the weights for `"sum"`), rows of
        `(batch, n)` ids weighted and pooled by `combiner`."""
        if weights is None or (rank == 1 and combiner != "sum"):
            if rank == 1:
                return rows
            weights = ops.ones(ops.shape(rows)[:-1], rows.dtype)
        weights = ops.expand_dims(ops.cast(weights, rows.dtype), -1)
        rows = rows * weights
        if rank == 1:
            return rows
        pooled = ops.sum(rows, axis=-2)
        if combiner == "sum":
            return pooled
        if combiner == "mean":
            return ops.divide_no_nan(pooled, ops.sum(weights, axis=-2))
        return ops.divide_no_nan(pooled, ops.sqrt(ops.sum(ops.square(weights), axis=-2)))

    def _check_group_optimizers(self):
        """Raise if tables grouped for their equal optimizers no longer have equal ones (one was changed)."""
        for members in self._grouping.members:
            distinct = {id(o): (t, o) for t, o in members}
            if len(distinct) < 2:
                continue
            keys = {_optimizer_key(o): t.name for t, o in distinct.values()}
            if len(keys) > 1:
                raise ValueError(
                    "keras_tpu_optim.layers.DistributedEmbedding: the tables "
                    f"{sorted(t.name for t, _ in members)} were grouped for their equal optimizers, which now "
                    "differ. Set hyperparameters on every table's optimizer alike, or give the tables one optimizer "
                    "instance."
                )

    def get_embedding_tables(self):
        """`{table name: its rows}` (tensors, not the variables), as keras-rs's layer returns them; with
        `lazy_adam=False`, caught up first (`catch_up`)."""
        self.catch_up()
        return {t.name: self._slice(self._table_state(t)["embeddings"], t) for t in self._tables}

    def _slice(self, variable, table):
        _, offset = self._grouping.placement[table.name]
        return variable.value[offset : offset + table.vocabulary_size]

    def _table_state(self, table):
        """`{name: variable}` of a table's group saved per table: its `table_state()` (the stacked table, its
        step count and slots) but the catch-up sums, shared by every row, which loading restarts."""
        group = self._grouping.groups[self._grouping.placement[table.name][0]]
        return {n: v for n, v in group.table_state().items() if n != "catch_up_sums"}

    def catch_up(self):
        """Bring every table trained with `lazy_adam=False` to ordinary Adam's values now, in one pass
        (`kto.layers.Embedding.catch_up`): before reading the variables directly."""
        for group in self._grouping.groups:
            group.catch_up()

    def save_own_variables(self, store):
        self.catch_up()
        for table in self._tables:
            for name, variable in self._table_state(table).items():
                value = variable.value if name == "iterations" else self._slice(variable, table)
                store[f"{table.name}:{name}"] = ops.convert_to_numpy(value)
            rate = self._own_learning_rate(table)
            if rate is not None:
                store[f"{table.name}:learning_rate"] = ops.convert_to_numpy(rate.value)

    def _own_learning_rate(self, table):
        """The learning-rate variable of a table's own optimizer (the layer's is saved as Keras saves it)."""
        optimizer = self.table_optimizer(table.name)
        rate = _private.raw_learning_rate(optimizer)
        return (
            rate if optimizer is not self._optimizer and isinstance(rate, keras.Variable) else None
        )

    def load_own_variables(self, store):
        keys = set(store.keys())
        for table in self._tables:
            for name in self._table_state(table):
                if f"{table.name}:{name}" not in keys:
                    raise ValueError(
                        f"Layer '{self.name}': no saved `{name}` of the table '{table.name}' (saved: "
                        f"{sorted(keys)}); the file was written with other tables or optimizer options."
                    )
        for g, (group, members) in enumerate(zip(self._grouping.groups, self._grouping.members)):
            counts = {t.name: float(np.asarray(store[f"{t.name}:iterations"])) for t, _ in members}
            if len(set(counts.values())) > 1:
                raise ValueError(
                    f"Layer '{self.name}': the tables {sorted(counts)} are stepped together here, but were saved "
                    f"after different numbers of steps: {counts}."
                )
            group.iterations.assign(next(iter(counts.values())))
            for name, variable in self._table_state(members[0][0]).items():
                if name == "iterations":
                    continue
                parts = [np.asarray(store[f"{t.name}:{name}"], variable.dtype) for t, _ in members]
                padding = (variable.shape[0] - self._grouping.rows[g],) + tuple(variable.shape[1:])
                # Saved caught up (`catch_up`): padding rows are current too.
                fill = group.iterations.numpy() if name == "row_steps" else 0
                variable.assign(np.concatenate(parts + [np.full(padding, fill, variable.dtype)]))
            group.restart_catch_up_sums()  # every row is current
        for table in self._tables:
            rate = self._own_learning_rate(table)
            if rate is not None and f"{table.name}:learning_rate" in keys:
                rate.assign(np.asarray(store[f"{table.name}:learning_rate"]))

    def get_config(self):
        config = super().get_config()
        # keras-rs's configs are saved as ours (they load as ours).
        config["tables"] = [TableConfig.get_config(t) for t in self._tables]
        config["features"] = [FeatureConfig.get_config(f) for f in self._features]
        # The structure, with each feature's position in `features` for the feature.
        config["feature_configs"] = keras.tree.pack_sequence_as(
            self.feature_configs, list(range(len(self._features)))
        )
        config["optimizer"] = (
            None if self._optimizer is None else keras.optimizers.serialize(self._optimizer)
        )
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        tables = {t["name"]: TableConfig.from_config(t) for t in config.pop("tables")}
        features = [FeatureConfig.from_config(f, tables) for f in config.pop("features")]
        config["feature_configs"] = keras.tree.map_structure(
            lambda i: features[i], config["feature_configs"]
        )
        if config.get("optimizer") is not None:
            config["optimizer"] = keras.optimizers.deserialize(config["optimizer"])
        return cls(**config)
