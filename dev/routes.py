"""Measure "the route": the calls from an entry function down to the call that writes a variable.

For each scenario the script runs 3 steps (2 warm-ups, the last measured) and, at every write primitive
called while the scenario's entry function is on the Python stack, records the chain
`entry -> f1 -> ... -> fk -> primitive`, f1..fk being the frames of code defined under keras_tpu_optim/
(functions, methods, nested functions, lambdas and generator expressions; not list, dict and set
comprehensions, which Python 3.12 runs inline) strictly after the innermost
entry frame; framework frames between them (keras, tf, torch autograd, jax tracing) are skipped, package
frames reached through them count. Length = k + 1 (entry calls f1: 1, ..., fk calls the primitive).
A primitive reached from its last package frame through framework frames is marked `(via file:func)`.

Entries: `Adafactor.update_step`, `EmbeddingAdam.update_step`, or, where Adafactor's grouped torch step
runs and `update_step` is not on the stack, `Adafactor._backend_update_step` (said in the line); the
trained lookup's backward pass: TF `_Lookup.hook.<locals>.hooked.<locals>.gradient`, torch
`_TrainedLookup.backward`, JAX the custom_vjp bwd `_Lookup.hook.<locals>.stepping`.

Write primitives (the route ends at the first: a primitive called inside another is not counted):
- keras Variable `assign`, `assign_add`, `assign_sub` (keras.src.backend.common.variables.Variable);
- TF: `assign*` and `scatter_*` of `BaseResourceVariable` and its subclasses (ResourceVariable
  overrides `assign*`), and their functional forms `tf.compat.v1.scatter_update` etc.;
- torch: in-place tensor ops (`copy_`, `sub_`, `index_copy_`, `_foreach_*_`, `__setitem__`, `out=`...)
  seen by a TorchFunctionMode, kept where the first caller frame outside torch is a package frame and
  the target (or its first list element) shares storage with a variable of the scenario (the model's,
  the layers', the optimizers'). A mode is off inside its own handler, so Keras's `loss.backward()` is
  run from the handler with the mode on (the engine call `torch.autograd.backward` makes);
- JAX: state is functional, so the write is the package call that produces a variable's new value: a
  keras `Variable.assign` (e.g. `embedding_adam_step` assigning its jitted update's result), or
  `x.at[...].set/add/...` (jax's `_IndexUpdateRef`, not `.get`) called directly from a package frame on
  an array of a scenario variable's shape: in jit traces, and in the custom_vjp bwd, which builds the
  new tables with `.at[ids].set` and returns them as gradients that Keras installs later, outside it.

Compiled code runs no Python. Where the measured step writes nothing from Python:
- TF: calls into a `tf.function` from a package frame are recorded too, and the route ends at
  `tf.function(name)`, the compiled function the write runs in, with the length of the route traced
  at step 1 (or a note that an earlier scenario traced it: TF's eager compiled functions are shared);
- otherwise (Keras's compiled train step, an outer tf.function) the route traced at the first step
  that had one is given, marked `[traced at step N; step 3 ran compiled]`.
Where step 1 traced a longer route than the measured step's, `[step 1, tracing: longest L]` is added.

Output, one line per scenario: `backend scenario length: entry -> f1 -> ... -> primitive  [n routes]`
(the longest route; n distinct routes). Run one backend per process (about 15 s each):

    KERAS_BACKEND=jax .venv/bin/python dev/routes.py
    KERAS_BACKEND=tensorflow .venv/bin/python dev/routes.py
    KERAS_BACKEND=torch .venv/bin/python dev/routes.py

With `--max N` the exit status is 1 where a route (or the route traced inside a compiled function) is
longer than N calls, or a scenario raises or writes nothing (tests/test_routes.py runs `--max 5`).
"""

import functools
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import warnings

warnings.filterwarnings("ignore")

import keras
import numpy as np
from keras.src.backend.common import variables as keras_variables

import keras_tpu_optim as kto
from keras_tpu_optim.layers import DistributedEmbedding, Embedding
from keras_tpu_optim.layers.distributed_embedding import FeatureConfig, TableConfig

BACKEND = keras.backend.backend()
PKG = os.path.dirname(os.path.abspath(kto.__file__)) + os.sep
lookup = __import__(f"keras_tpu_optim._backend.{BACKEND}", fromlist=["_Lookup"])


def nested_code(code, qualname_tail):
    """The code object of a function nested (at any depth) in `code` whose qualname ends so."""
    for const in code.co_consts:
        if hasattr(const, "co_qualname"):
            if const.co_qualname.endswith(qualname_tail):
                return const
            found = nested_code(const, qualname_tail)
            if found is not None:
                return found
    return None


UPDATE = (kto.Adafactor.update_step.__code__, kto.EmbeddingAdam.update_step.__code__)
GROUPED = kto.Adafactor._backend_update_step.__code__
BACKWARD = {
    "tensorflow": lambda: nested_code(lookup._Lookup.hook.__code__, "hooked.<locals>.gradient"),
    "torch": lambda: lookup._TrainedLookup.backward.__code__,
    "jax": lambda: nested_code(lookup._Lookup.hook.__code__, "hook.<locals>.stepping"),
}[BACKEND]()


def name_of(code):
    module = os.path.relpath(code.co_filename, PKG)[:-3].replace(os.sep, ".")
    module = module.removeprefix("_backend.").removesuffix(".__init__")
    return f"{module}:{code.co_qualname.replace('.<locals>', '')}"


# Comprehensions run inline in their function from Python 3.12 (PEP 709): not calls of their own.
INLINE = ("<listcomp>", "<dictcomp>", "<setcomp>")


def in_package(frame):
    return frame.f_code.co_filename.startswith(PKG) and frame.f_code.co_name not in INLINE


class Recorder:
    def __init__(self):
        self.entries, self.routes, self.compiled, self.depth = (), None, None, 0
        self.pointers, self.shapes = set(), set()

    def start(self, entries, variables):
        self.entries, self.routes, self.compiled = entries, set(), set()
        self.shapes = {tuple(v.shape) for v in variables}
        if BACKEND == "torch":
            self.pointers = {v.value.untyped_storage().data_ptr() for v in variables}

    def note(self, primitive, caller, compiled=False):
        """Record the route to `primitive`, called from the frame `caller`, if an entry is on the stack
        (`compiled`: a call into a compiled function, kept apart)."""
        if self.routes is None:
            return
        frames, frame = [], caller
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        for entry in self.entries:  # in order of preference
            at = next((i for i, f in enumerate(frames) if f.f_code is entry), None)
            if at is not None:
                inner = [name_of(f.f_code) for f in reversed(frames[:at]) if in_package(f)]
                if not caller.f_code.co_filename.startswith(PKG):  # through framework frames
                    primitive += f" (via {os.path.basename(caller.f_code.co_filename)}:{caller.f_code.co_name})"
                (self.compiled if compiled else self.routes).add(
                    (name_of(entry), *inner, primitive)
                )
                return


R = Recorder()


def patch(cls, method, label, direct=None):
    """Wrap `cls.method` so that its outermost calls are noted; `direct(self)`: also require the first
    caller frame outside the framework to be a package frame and the target to be a scenario variable."""
    original = getattr(cls, method)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if R.routes is not None and R.depth == 0:
            caller = sys._getframe(1)
            if direct is None:
                R.note(label, caller)
            else:
                caller = first_outside(caller, direct[0])
                if caller is not None and in_package(caller) and direct[1](self):
                    R.note(label, caller)
        R.depth += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            R.depth -= 1

    setattr(cls, method, wrapper)


def first_outside(frame, framework_dir):
    while frame is not None and frame.f_code.co_filename.startswith(framework_dir):
        frame = frame.f_back
    return frame


for method in ("assign", "assign_add", "assign_sub"):
    patch(keras_variables.Variable, method, f"KerasVariable.{method}")

if BACKEND == "tensorflow":
    import tensorflow as tf
    from tensorflow.python.eager.polymorphic_function import polymorphic_function
    from tensorflow.python.ops import resource_variable_ops

    tf_dir = os.path.dirname(tf.__file__) + os.sep
    call = polymorphic_function.Function.__call__

    def compiled_call(self, *args, **kwargs):
        """A call into a tf.function from a package frame: where a write runs without Python."""
        if R.routes is not None:
            caller = first_outside(sys._getframe(1), tf_dir)
            if caller is not None and in_package(caller):
                function = getattr(self, "_python_function", None)
                name = getattr(getattr(function, "func", function), "__name__", self._name)
                R.note(f"tf.function({name})", caller, compiled=True)
        return call(self, *args, **kwargs)

    polymorphic_function.Function.__call__ = compiled_call
    for cls in vars(resource_variable_ops).values():  # ResourceVariable overrides `assign*`
        if isinstance(cls, type) and issubclass(cls, resource_variable_ops.BaseResourceVariable):
            for method in list(vars(cls)):
                if method.startswith(("assign", "scatter_", "batch_scatter_update")):
                    patch(cls, method, f"tf.Variable.{method}")
    # The functional forms, which run the variable's op without its methods.
    for name in (
        "scatter_update",
        "scatter_add",
        "scatter_sub",
        "assign",
        "assign_sub",
        "assign_add",
    ):
        original = getattr(tf.compat.v1, name)

        def noted(ref, *args, _original=original, _label=f"tf.compat.v1.{name}", **kwargs):
            if R.routes is not None and R.depth == 0:
                R.note(_label, sys._getframe(1))
            R.depth += 1
            try:
                return _original(ref, *args, **kwargs)
            finally:
                R.depth -= 1

        setattr(tf.compat.v1, name, noted)
elif BACKEND == "jax":
    import jax
    from jax._src.numpy import array_methods

    jax_dir = os.path.dirname(jax.__file__) + os.sep
    for method in (
        "set",
        "apply",
        "add",
        "subtract",
        "multiply",
        "mul",
        "divide",
        "power",
        "min",
        "max",
    ):
        patch(
            array_methods._IndexUpdateRef,
            method,
            f"jax .at[].{method}",
            direct=(jax_dir, lambda ref: tuple(ref.array.shape) in R.shapes),
        )
elif BACKEND == "torch":
    import torch
    from torch.autograd.graph import _engine_run_backward
    from torch.overrides import TorchFunctionMode

    torch_dir = os.path.dirname(torch.__file__) + os.sep
    IN_PLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"}

    def is_variable(t):
        try:
            return t.untyped_storage().data_ptr() in R.pointers
        except Exception:  # noqa: BLE001 - sparse, or not a tensor
            return False

    class InPlaceWrites(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if (
                R.routes is not None
                and R.depth == 0
                and (
                    "out" in kwargs
                    or name in IN_PLACE_DUNDERS
                    or (name.endswith("_") and not name.endswith("__"))
                )
            ):
                target = kwargs.get("out", args[0] if args else None)
                if isinstance(target, (list, tuple)):
                    target = target[0] if target else None
                caller = first_outside(sys._getframe(1), torch_dir)
                if caller is not None and in_package(caller) and is_variable(target):
                    R.note(f"torch:{name}", caller)
            if func is torch.Tensor.backward and len(args) == 1 and not any(kwargs.values()):
                # Keras's `loss.backward()`: the mode is off inside its own handler, so the backward pass
                # is run here with the mode on, by the engine call `torch.autograd.backward` makes.
                with self:
                    loss = args[0]
                    _engine_run_backward(
                        (loss,),
                        (torch.ones_like(loss),),
                        False,
                        False,
                        (),
                        allow_unreachable=True,
                        accumulate_grad=True,
                    )
                return None
            return func(*args, **kwargs)


def measure(scenario, step, variables, entries, steps=3):
    """Run `step` `steps` times, each recorded; print the last step's longest route (or the first traced)."""
    try:
        recorded = []
        for i in range(steps):
            R.start(entries, variables())
            try:
                if BACKEND == "torch":
                    with InPlaceWrites():
                        step()
                else:
                    step()
            finally:
                recorded.append(R.routes)
                compiled = R.compiled
                R.routes = None
    except Exception as error:  # noqa: BLE001 - a line, not a crash
        print(
            f"{BACKEND} {scenario} ERROR: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        )
        FAILED.append(scenario)
        return
    note, routes, inner = "", recorded[-1], 0
    first = next((i for i, r in enumerate(recorded) if r), None)
    if not routes and compiled:  # the write runs inside a compiled function, without Python
        routes = compiled
        if first is not None:
            inner = max(len(r) for r in recorded[first]) - 1
        note = "  [write inside the compiled function; " + (
            f"traced at step {first + 1}: {inner}]"
            if first is not None
            else "traced before this scenario (TF's eager compiled functions are shared)]"
        )
    elif not routes:
        if first is None:
            print(f"{BACKEND} {scenario} -: no write captured in {steps} steps")
            FAILED.append(scenario)
            return
        routes, note = recorded[first], f"  [traced at step {first + 1}; step {steps} ran compiled]"
    longest = max(routes, key=lambda r: (len(r), r))
    traced = max(recorded[0], key=len, default=())
    if not note and len(traced) > len(longest):
        note += f"  [step 1, tracing: longest {len(traced) - 1}, {len(recorded[0])} routes]"
    if longest[0] == name_of(GROUPED):
        note += "  (entry _backend_update_step: update_step not on the stack)"
    if MAX is not None and max(len(longest) - 1, inner) > MAX:
        FAILED.append(scenario)
    print(
        f"{BACKEND} {scenario} {len(longest) - 1}: {' -> '.join(longest)}  [{len(routes)} routes]{note}"
    )
    sys.stdout.flush()


rng = np.random.default_rng(0)
ENTRIES = (*UPDATE, GROUPED)


def optimizer_scenario(scenario, optimizer, shapes, grads_of, dtype="float32", platform=None):
    variables = [keras.Variable(rng.normal(size=s).astype("float32"), dtype=dtype) for s in shapes]
    optimizer.build(variables)
    if platform is not None:
        optimizer._platforms = [platform] * len(variables)
    grads = grads_of(variables)
    all_vars = lambda: variables + list(optimizer.variables)
    modes = {"eager": lambda: optimizer.apply(grads, variables)}
    if BACKEND == "tensorflow":
        modes["tf.function"] = tf.function(modes["eager"], autograph=False)
    for mode, step in modes.items():
        label = f"{scenario}/{mode}" if BACKEND == "tensorflow" else scenario
        measure(label, step, all_vars, ENTRIES)


def dense(dtype="float32"):
    return lambda vs: [keras.ops.convert_to_tensor(rng.normal(size=v.shape), dtype) for v in vs]


def touched_rows(vs):
    grad = np.zeros(vs[0].shape, "float32")
    grad[[3, 17, 17, 500]] = rng.normal(size=(4, vs[0].shape[1]))
    return [keras.ops.convert_to_tensor(grad)]


def sparse_rows(vs):
    ids, values = np.array([3, 17, 17, 500]), rng.normal(size=(4, vs[0].shape[1])).astype("float32")
    if BACKEND == "tensorflow":
        return [tf.IndexedSlices(tf.constant(values), tf.constant(ids), tf.constant(vs[0].shape))]
    return [
        torch.sparse_coo_tensor(torch.tensor(ids)[None], torch.tensor(values), tuple(vs[0].shape))
    ]


def model_scenarios(scenario, make_layer_output, inputs, target):
    modes = {"default": {}}
    if BACKEND == "tensorflow":
        modes = {
            "jit=False": {"jit_compile": False},
            "eager": {"run_eagerly": True},
            "jit=True": {"jit_compile": True},
        }
    for mode, compile_args in modes.items():
        label = f"{scenario}/{mode}" if BACKEND == "tensorflow" else scenario
        try:
            model = keras.Model(*make_layer_output())
            model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", **compile_args)
        except Exception as error:  # noqa: BLE001
            print(
                f"{BACKEND} {label} ERROR: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            )
            continue
        all_vars = lambda m=model: list(m.variables) + list(m.optimizer.variables)
        measure(label, lambda m=model: m.train_on_batch(inputs, target), all_vars, (BACKWARD,))


def embedding_model(optimizer):
    def make():
        ids = keras.Input((4,), dtype="int32")
        rows = Embedding(1000, 8, optimizer=optimizer())(ids)
        return ids, keras.layers.Dense(1)(keras.layers.Flatten()(rows))

    return make


def distributed_model():
    tables = [TableConfig("a", 1000, 8), TableConfig("b", 500, 8)]
    features = {
        f"f{t.name}": FeatureConfig(f"f{t.name}", t, input_shape=(16,), output_shape=(16, 8))
        for t in tables
    }
    ids = {name: keras.Input((), dtype="int32", name=name, batch_size=16) for name in features}
    outputs = DistributedEmbedding(features, optimizer=kto.EmbeddingAdam(1e-3))(ids)
    return ids, keras.ops.concatenate([outputs[name] for name in features], axis=-1)


def main():
    # 1. Adafactor.
    small = [(64, 32), (32,)]
    if BACKEND == "torch":
        optimizer_scenario("adafactor/cpu", kto.Adafactor(), small, dense())
        optimizer_scenario("adafactor/grouped-gpu", kto.Adafactor(), small, dense(), platform="gpu")
        optimizer_scenario("adafactor/blocked-512x512", kto.Adafactor(), [(512, 512)], dense())
    else:
        optimizer_scenario("adafactor", kto.Adafactor(), small, dense())
    optimizer_scenario(
        "adafactor/momentum-sr-bf16",
        kto.Adafactor(beta_1=0.9, stochastic_rounding=True),
        [(64, 32)],
        dense("bfloat16"),
        dtype="bfloat16",
    )
    # 2. EmbeddingAdam.
    table = [(1000, 8)]
    optimizer_scenario("embedding_adam/dense", kto.EmbeddingAdam(1e-3), table, touched_rows)
    if BACKEND == "jax":
        print(
            "jax embedding_adam/sparse skipped: JAX sparse gradients (BCOO) are not measured here"
        )
    else:
        optimizer_scenario("embedding_adam/sparse", kto.EmbeddingAdam(1e-3), table, sparse_rows)
    optimizer_scenario(
        "embedding_adam/lazy_adam=False",
        kto.EmbeddingAdam(1e-3, lazy_adam=False),
        table,
        touched_rows,
    )
    # 3. kto.layers.Embedding trained in its lookup's backward pass.
    ids, y = rng.integers(0, 1000, size=(16, 4)).astype("int32"), rng.normal(size=(16, 1))
    for variant, optimizer in {
        "lazy": lambda: kto.EmbeddingAdam(1e-3),
        "lazy_adam=False": lambda: kto.EmbeddingAdam(1e-3, lazy_adam=False),
        "skip_nonfinite": lambda: kto.EmbeddingAdam(1e-3, skip_nonfinite_updates=True),
    }.items():
        model_scenarios(f"layers.Embedding/{variant}", embedding_model(optimizer), ids, y)
    # 4. DistributedEmbedding, two features in two tables (stacked in one group).
    inputs = {f"f{t}": rng.integers(0, 500, size=(16,)).astype("int32") for t in "ab"}
    model_scenarios(
        "DistributedEmbedding/2-features", distributed_model, inputs, rng.normal(size=(16, 16))
    )


# `--max N`: exit with status 1 where a route is longer than N calls, a scenario fails or writes nothing.
MAX = int(sys.argv[sys.argv.index("--max") + 1]) if "--max" in sys.argv else None
FAILED: list = []

if __name__ == "__main__":
    main()
    if FAILED:
        print(
            f"{BACKEND}: {len(FAILED)} scenario(s) over --max {MAX} or failing: {', '.join(FAILED)}"
        )
        sys.exit(1)
