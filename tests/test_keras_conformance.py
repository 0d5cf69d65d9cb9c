"""Keras's own optimizer tests, run against keras_tpu_optim's optimizers.

Keras ships the tests of its optimizers inside the wheel
(`keras/src/optimizers/*_test.py`). This module reads them from the installed
Keras at collection time, so they follow Keras upgrades, and turns them into
tests of our classes:

1. Each Keras test module's source is parsed (`ast`) and rewritten in two
   ways only, line numbers kept (tracebacks point into Keras's file):
   - the case list of every `parameterized.parameters(...)` /
     `parameterized.named_parameters(...)` decorator goes through a hook of
     ours (`_kto_cases`), which swaps Keras's cases for ours: in
     `optimizer_sparse_test.py` our optimizers and configurations
     (`SPARSE_CASES`) replace Keras's; in `optimizer_test.py` a list of Keras
     optimizer names becomes our optimizer's name alone;
   - in the functions listed in `_LITERAL_RENAMES`, string literals naming
     a Keras optimizer instance ("adam", "adam_1") become our optimizer's.
2. The rewritten source is executed in a fresh module (never imported under
   Keras's name), and the names its tests construct optimizers with are
   rebound there: `Adafactor` in `adafactor_test.py` becomes ours; in
   `optimizer_test.py`, `optimizers` becomes a namespace whose `Adam`, `SGD`
   and `get` build the optimizer under test (see `_optimizers_namespace`),
   everything else being Keras's.
3. For each Keras `testing.TestCase` class (and each of our optimizers where
   the module tests one), a subclass is defined here, so pytest collects it
   as a `unittest.TestCase`; Keras's own classes are never bound in this
   module, so pytest does not collect them.
4. Every Keras test is classified (`APPLICABLE`, `NOT_APPLICABLE`);
   `test_every_keras_optimizer_test_is_classified` fails when a Keras upgrade
   adds or removes one. Not-applicable tests are collected and skipped with
   their reason; Keras's own backend skips keep their reasons; by-design
   deviations (`EXPECTED_DEVIATIONS`) are strict xfails.

A Keras without its tests (the keras-nightly wheels) skips this module, the
missing files named in the reason.

`optimizer_test.py`'s SGD numbers: `SGD(learning_rate=lr)` is replaced by our
optimizer in its SGD limit, with a huge epsilon `E` (`SGD_LIMIT_EPSILON`)
and the learning rate scaled by `E`:
- `EmbeddingAdam(learning_rate=lr*E, beta_1=0, beta_2=0, epsilon=E)`:
  `m = g`, `v = g^2`, no bias correction, so the step is
  `lr*E * g / sqrt(g^2 + E^2) = lr * g * (1 + O(g^2/E^2))`;
- `Adafactor(learning_rate=lr*E, epsilon_1=E^2, relative_step=False,
  multiply_by_parameter_scale=False)`: the second moment (full or factored)
  is `g^2 + E^2 ~ E^2`, so the step is `lr*E * g/E = lr * g`, far from update
  clipping.
With `E = 1e4` and the tests' gradients (|g| <= 4) the float32 error is that
of rounding, so Keras's SGD numbers (EMA, gradient accumulation, loss
scaling, overwrite_with_gradient, a callable learning rate) check our
optimizers' handling of those features exactly. `Adam(learning_rate, ...)`
becomes `EmbeddingAdam` with Adam's arguments, or `Adafactor(learning_rate,
multiply_by_parameter_scale=False)` (an absolute step size, as Adam's); the
tests that use Adam check behaviour, not Adam's numbers.
"""

from __future__ import annotations

import ast
import functools
import re
import types
import unittest
import warnings
from pathlib import Path

import keras
import pytest
from keras.src.utils.naming import to_snake_case

import keras_tpu_optim as kto

KERAS_OPTIMIZERS_DIR = Path(keras.src.optimizers.__file__).parent
KERAS_TEST_FILES = ("optimizer_sparse_test.py", "adafactor_test.py", "optimizer_test.py")
SUBJECTS = {"Adafactor": kto.Adafactor, "EmbeddingAdam": kto.EmbeddingAdam}
SGD_LIMIT_EPSILON = 1e4

# ------------------------------------------------------------ classification
# Keyed "<keras test file>::<keras test method, before parameterization>".

APPLICABLE = {
    # optimizer_sparse_test.py, over SPARSE_CASES.
    "optimizer_sparse_test.py::test_sparse_correctness": (
        "A sparse gradient gives the same variables as the same gradient densified, 5 steps "
        "(rows 0, 2, 4 of a 5x3x2 variable; TF IndexedSlices with tuple indices, JAX BCOO)."
    ),
    # adafactor_test.py, with our Adafactor.
    "adafactor_test.py::test_config": "get_config/from_config round trip (run_class_serialization_test).",
    "adafactor_test.py::test_single_step_1d": "Keras's numbers, unfactored variable.",
    "adafactor_test.py::test_single_step_2d": "Keras's numbers, factored variable.",
    "adafactor_test.py::test_weight_decay": "Keras's decoupled weight decay and its exclusions.",
    "adafactor_test.py::test_correctness_with_golden": (
        "Keras's golden with relative_step=False: an expected deviation (EXPECTED_DEVIATIONS)."
    ),
    "adafactor_test.py::test_clip_norm": "clipnorm via _clip_gradients.",
    "adafactor_test.py::test_clip_value": "clipvalue via _clip_gradients.",
    # optimizer_test.py, once per optimizer of ours (SGD -> sgd_limit, Adam -> adam_substitute).
    "optimizer_test.py::test_iterations_counter": "iterations counts applied steps (Adam -> ours).",
    "optimizer_test.py::test_empty_gradients": (
        "all-None gradients raise; None gradients are filtered with a warning (SGD limit)."
    ),
    "optimizer_test.py::test_clip_args": "clipnorm/clipvalue/global_clipnorm attributes and their mutual exclusion.",
    "optimizer_test.py::test_clip_norm": "clipnorm via _clip_gradients.",
    "optimizer_test.py::test_clip_value": "clipvalue via _clip_gradients.",
    "optimizer_test.py::test_global_clip_norm": "global_clipnorm via _clip_gradients.",
    "optimizer_test.py::test_ema": "EMA values and ema_overwrite_frequency (SGD limit, Keras's numbers).",
    "optimizer_test.py::test_ema_with_model_fit": "EMA through model.fit, averages installed at the end (SGD limit).",
    "optimizer_test.py::test_constraints_are_applied": "variable constraints applied after the step.",
    "optimizer_test.py::test_static_loss_scaling": "loss_scale_factor unscales gradients (SGD limit).",
    "optimizer_test.py::test_set_weights": (
        "set_weights refuses an unbuilt optimizer, copies a built one (Adam -> ours)."
    ),
    "optimizer_test.py::test_gradient_accumulation": (
        "gradient_accumulation_steps: accumulators, iterations, the mean applied (SGD limit)."
    ),
    "optimizer_test.py::test_tf_checkpointing": (
        "tf.train.Checkpoint of model and optimizer restores predictions (TF only, Adam -> ours)."
    ),
    "optimizer_test.py::test_callable_learning_rate": "a callable learning rate (SGD limit).",
    "optimizer_test.py::test_overwrite_with_gradient": "overwrite_with_gradient variables (SGD limit).",
    "optimizer_test.py::test_overwrite_with_gradient_with_gradient_accumulation": (
        "overwrite_with_gradient with gradient accumulation (SGD limit)."
    ),
    "optimizer_test.py::test_gradient_accumulation_with_weigth_decay": (
        "3-step accumulation with weight decay equals one step on the mean gradient (ours, by name)."
    ),
    "optimizer_test.py::test_setting_lr_to_callable_untracks_lr_var": (
        "a schedule replacing a float learning rate untracks its variable."
    ),
    "optimizer_test.py::test_pickleable_optimizers": "pickle round trip keeps the config (ours, by name).",
    "optimizer_test.py::test_mixed_with_tf_variables": (
        "plain tf.Variables among the variables (TF only, Adam -> ours)."
    ),
    "optimizer_test.py::test_optimizer_auto_naming": (
        "default names are uniquified per class, explicit names and serialization keep them "
        "(Adam -> ours, its expected names renamed; SGD and AdamW stay Keras's)."
    ),
}

NOT_APPLICABLE = {
    "optimizer_sparse_test.py::test_sparse_gradients": (
        "checks Keras's implementation rule that every write goes through "
        "Optimizer.assign/assign_add/assign_sub (it mocks them out, so nothing is written, and "
        "fails on any direct tf.Variable/KerasVariable assign). Ours write the variables "
        "directly by design (TF: row scatters and XLA-compiled steps on the tf.Variable; JAX: "
        "the result of an in-place gather/update/scatter), for an O(rows touched) step; that "
        "sparse updates stay sparse is checked by test_sparse_correctness here and by "
        "tests/test_embedding_adam.py (untouched rows bit for bit)."
    ),
    "optimizer_test.py::test_get_method": (
        "Keras's built-in string identifiers ('sgd', 'adamw') resolve to Keras's classes; ours "
        "are not built-ins (they load by registered name, tests/test_saving.py)."
    ),
}

# By-design deviations: strict xfails. Keyed "<our class here>::<test method>".
EXPECTED_DEVIATIONS = {
    "TestKerasAdafactorTest::test_correctness_with_golden": (
        "documented deviation: our Adafactor honours relative_step=False (step size = "
        "learning_rate), Keras 3 ignores the flag and always caps it at 1/sqrt(t); the golden "
        "was computed with the cap, so from step 5 (1/sqrt(5) < 0.5) the numbers differ."
    ),
    "TestKerasOptimizerTest_EmbeddingAdam::test_clip_args": (
        "documented deviation: EmbeddingAdam's clipvalue is tf.tpu.experimental.embedding.Adam's "
        "and may be combined with clipnorm/global_clipnorm, applied after them (README, "
        "docs/algorithms.md); Keras forbids the combination."
    ),
    "TestKerasOptimizerTest_EmbeddingAdam::test_clip_value": (
        "documented deviation: EmbeddingAdam clips values inside the row update, per row after "
        "duplicate ids are summed and only on touched rows (README, docs/algorithms.md); "
        "Keras clips every gradient element in _clip_gradients, which would touch untouched rows."
    ),
}

# ------------------------------------------------------ optimizer_sparse_test


def _lso(optimizer_class, **kwargs):
    def make():
        return keras.optimizers.LossScaleOptimizer(optimizer_class(**kwargs))

    return make


# Keras's case keys; expect_*_sparse_variable_updates belong to
# test_sparse_gradients, which is not applicable (NOT_APPLICABLE).
SPARSE_CASES = [
    # Keras's own Adafactor case, with ours.
    {
        "testcase_name": "kto_adafactor",
        "optimizer_class": kto.Adafactor,
        "init_kwargs": {"clip_threshold": 0.5},
    },
    {
        "testcase_name": "kto_adafactor_options",
        "optimizer_class": kto.Adafactor,
        "init_kwargs": {
            "learning_rate": 0.1,
            "relative_step": False,
            "beta_1": 0.9,
            "min_dim_size_to_factor": 3,
            "multiply_by_parameter_scale": False,
        },
    },
    {"testcase_name": "kto_embedding_adam_lazy", "optimizer_class": kto.EmbeddingAdam},
    {
        "testcase_name": "kto_embedding_adam_not_lazy",
        "optimizer_class": kto.EmbeddingAdam,
        "init_kwargs": {"lazy_adam": False},
    },
    {
        "testcase_name": "kto_embedding_adam_options",
        "optimizer_class": kto.EmbeddingAdam,
        "init_kwargs": {
            "learning_rate": 0.1,
            "sum_inside_sqrt": False,
            "clipvalue": (-1.0, 8.0),
            "clip_weight_min": 0.75,
            "clip_weight_max": 2.0,
            "weight_decay_factor": 0.01,
            "multiply_weight_decay_factor_by_learning_rate": True,
        },
    },
    {
        "testcase_name": "kto_embedding_adam_last_occurrence_wins",
        "optimizer_class": kto.EmbeddingAdam,
        "init_kwargs": {"use_gradient_accumulation": False, "learning_rate": 0.1},
    },
    {
        "testcase_name": "kto_embedding_adam_not_lazy_weight_decay",
        "optimizer_class": kto.EmbeddingAdam,
        "init_kwargs": {"lazy_adam": False, "weight_decay": 0.05, "learning_rate": 0.1},
    },
    {
        "testcase_name": "loss_scale_optimizer_kto_adafactor",
        "optimizer_class": _lso(kto.Adafactor, clip_threshold=0.5),
    },
    {
        "testcase_name": "loss_scale_optimizer_kto_embedding_adam",
        "optimizer_class": _lso(kto.EmbeddingAdam),
    },
    {
        "testcase_name": "loss_scale_optimizer_kto_embedding_adam_not_lazy",
        "optimizer_class": _lso(kto.EmbeddingAdam, lazy_adam=False),
    },
]


def _sparse_cases(test_name, *keras_cases):
    return SPARSE_CASES


# ------------------------------------------------------------ optimizer_test


def _default_name(cls):
    """The name Keras's `auto_name` gives the first unnamed instance of `cls`."""
    return to_snake_case(cls.__name__)


def _scaled_learning_rate(learning_rate, factor):
    if callable(learning_rate) and not isinstance(
        learning_rate, keras.optimizers.schedules.LearningRateSchedule
    ):
        return lambda: learning_rate() * factor
    if isinstance(learning_rate, (int, float)):
        return learning_rate * factor
    raise NotImplementedError(f"SGD limit: learning_rate={learning_rate!r} is not supported")


def sgd_limit(subject, learning_rate=0.01, momentum=0.0, nesterov=False, **kwargs):
    """`keras.optimizers.SGD(learning_rate, **kwargs)` as `subject` in its SGD limit (module docstring)."""
    if momentum or nesterov:
        raise NotImplementedError("SGD limit: momentum/nesterov have no counterpart")
    learning_rate = _scaled_learning_rate(learning_rate, SGD_LIMIT_EPSILON)
    if subject is kto.EmbeddingAdam:
        return subject(
            learning_rate=learning_rate, beta_1=0.0, beta_2=0.0, epsilon=SGD_LIMIT_EPSILON, **kwargs
        )
    if subject is kto.Adafactor:
        return subject(
            learning_rate=learning_rate,
            epsilon_1=SGD_LIMIT_EPSILON**2,
            relative_step=False,
            multiply_by_parameter_scale=False,
            **kwargs,
        )
    raise NotImplementedError(subject)


def adam_substitute(
    subject, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False, **kwargs
):
    """`keras.optimizers.Adam(...)` as `subject`: EmbeddingAdam with Adam's options (its dense
    numbers are Adam's but for epsilon's place), Adafactor with an absolute step size."""
    if amsgrad:
        raise NotImplementedError("amsgrad has no counterpart")
    if subject is kto.EmbeddingAdam:
        return subject(
            learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, **kwargs
        )
    if (beta_1, beta_2, epsilon) != (0.9, 0.999, 1e-7):
        raise NotImplementedError("Adam's beta_1/beta_2/epsilon have no Adafactor counterpart")
    # Adam's learning rate is an absolute step size; Adafactor's default one is
    # relative to the parameter's RMS (test_tf_checkpointing needs a step of
    # Adam's size to move the predictions by more than 1e-3).
    return subject(learning_rate=learning_rate, multiply_by_parameter_scale=False, **kwargs)


# Per Keras test: the Keras classes it keeps (not substituted).
_KEEP_KERAS_CLASSES = {"test_optimizer_auto_naming": {"SGD"}}


def _optimizers_namespace(subject, test_name):
    """`keras.src.optimizers` with `Adam`, `SGD` and `get` building `subject`."""
    keras_optimizers = keras.src.optimizers
    namespace = types.SimpleNamespace(
        **{
            name: getattr(keras_optimizers, name)
            for name in dir(keras_optimizers)
            if not name.startswith("__")
        }
    )
    keep = _KEEP_KERAS_CLASSES.get(test_name, set())
    if "Adam" not in keep:
        namespace.Adam = functools.partial(adam_substitute, subject)
    if "SGD" not in keep:
        namespace.SGD = functools.partial(sgd_limit, subject)
    our_name = _default_name(subject)

    def get(identifier):
        if identifier == our_name:
            return subject()
        if isinstance(identifier, dict) and identifier.get("class_name") == our_name:
            return subject(**identifier.get("config", {}))
        return keras_optimizers.get(identifier)

    namespace.get = get
    return namespace


def _is_optimizer_name_list(cases):
    return bool(cases) and all(
        isinstance(case, tuple) and len(case) == 1 and isinstance(case[0], str) for case in cases
    )


def _name_cases(subject):
    """Lists of Keras optimizer names become our optimizer's name alone."""

    def cases(test_name, *keras_cases):
        if len(keras_cases) == 1 and isinstance(keras_cases[0], list):
            keras_cases = keras_cases[0]
        keras_cases = list(keras_cases)
        if _is_optimizer_name_list(keras_cases):
            return [(_default_name(subject),)]
        return keras_cases

    return cases


# Per Keras test function: string literals naming Keras optimizer instances.
_LITERAL_RENAMES = {"test_optimizer_auto_naming": re.compile(r"^adam(_\d+)?$")}

# ---------------------------------------------------------------- generation


class _Rewriter(ast.NodeTransformer):
    """Routes parameterized case lists through `_kto_cases`; renames literals (`_LITERAL_RENAMES`)."""

    def __init__(self, renamed_to):
        self.renamed_to = renamed_to
        self.rename = None

    def visit_FunctionDef(self, node):
        for decorator in node.decorator_list:
            if (
                isinstance(decorator, ast.Call)
                and isinstance(decorator.func, ast.Attribute)
                and decorator.func.attr in ("parameters", "named_parameters", "product")
                and not decorator.keywords
            ):
                hook = ast.Call(
                    func=ast.Name(id="_kto_cases", ctx=ast.Load()),
                    args=[ast.Constant(node.name), *decorator.args],
                    keywords=[],
                )
                decorator.args = [ast.copy_location(hook, decorator)]
        pattern = _LITERAL_RENAMES.get(node.name) if self.renamed_to else None
        self.rename, outer = pattern, self.rename
        self.generic_visit(node)
        self.rename = outer
        return node

    def visit_Constant(self, node):
        if self.rename is not None and isinstance(node.value, str):
            match = self.rename.match(node.value)
            if match:
                return ast.copy_location(
                    ast.Constant(self.renamed_to + (match.group(1) or "")), node
                )
        return node


def _load_keras_tests(filename, module_name, cases_hook, renamed_to=None):
    """Keras's `filename`, rewritten (see the module docstring) and executed in a fresh module."""
    path = KERAS_OPTIMIZERS_DIR / filename
    tree = _Rewriter(renamed_to).visit(ast.parse(path.read_text(), filename=str(path)))
    ast.fix_missing_locations(tree)
    module = types.ModuleType(f"{__name__}.{module_name}")
    module.__file__ = str(path)
    module._kto_cases = cases_hook
    with warnings.catch_warnings():
        # Keras's conftest registers this mark (used by its numpy-backend runs); not ours.
        warnings.filterwarnings("ignore", "Unknown pytest.mark.requires_trainable_backend")
        exec(compile(tree, str(path), "exec"), module.__dict__)
    return module


def _keras_test_classes(module):
    return [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, unittest.TestCase)
        and value.__module__ == module.__name__
    ]


def _original_name(function):
    """A test method's name before absl's parameterization."""
    return getattr(function, "__wrapped__", function).__name__


def _keras_test_methods(keras_class):
    return {
        name: getattr(keras_class, name) for name in dir(keras_class) if name.startswith("test")
    }


def _copy_of(function):
    @functools.wraps(function)
    def test(self):
        return function(self)

    return test


def _conformance_class(class_name, keras_class, filename, set_up=None):
    """A subclass of Keras's test class here, with the classification's marks."""
    attrs = {
        "__module__": __name__,
        "__qualname__": class_name,
        "_test_params_reprs": dict(getattr(keras_class, "_test_params_reprs", {})),
    }
    originals = {}
    for name, function in _keras_test_methods(keras_class).items():
        original = originals[name] = _original_name(function)
        test = _copy_of(function)
        key = f"{filename}::{original}"
        if key in NOT_APPLICABLE:
            test = pytest.mark.skip(reason=f"not applicable: {NOT_APPLICABLE[key]}")(test)
        test_id = f"{class_name}::{name}"
        if test_id in EXPECTED_DEVIATIONS:
            test = pytest.mark.xfail(strict=True, reason=EXPECTED_DEVIATIONS[test_id])(test)
        attrs[name] = test
    if set_up is not None:

        def setUp(self):
            super(cls, self).setUp()
            set_up(originals[self._testMethodName])

        attrs["setUp"] = setUp
    cls = type(keras_class)(class_name, (keras_class,), attrs)
    globals()[class_name] = cls
    return cls


def _generate():
    loaded = {}

    sparse = _load_keras_tests("optimizer_sparse_test.py", "optimizer_sparse_test", _sparse_cases)
    loaded["optimizer_sparse_test.py"] = [sparse]
    for keras_class in _keras_test_classes(sparse):
        _conformance_class(
            f"TestKeras{keras_class.__name__}", keras_class, "optimizer_sparse_test.py"
        )

    adafactor = _load_keras_tests("adafactor_test.py", "adafactor_test", _name_cases(kto.Adafactor))
    adafactor.Adafactor = kto.Adafactor
    loaded["adafactor_test.py"] = [adafactor]
    for keras_class in _keras_test_classes(adafactor):
        _conformance_class(f"TestKeras{keras_class.__name__}", keras_class, "adafactor_test.py")

    loaded["optimizer_test.py"] = []
    for subject_name, subject in SUBJECTS.items():
        module = _load_keras_tests(
            "optimizer_test.py",
            f"optimizer_test_{subject_name}",
            _name_cases(subject),
            renamed_to=_default_name(subject),
        )
        loaded["optimizer_test.py"].append(module)

        def set_up(test_name, module=module, subject=subject):
            module.optimizers = _optimizers_namespace(subject, test_name)

        for keras_class in _keras_test_classes(module):
            _conformance_class(
                f"TestKeras{keras_class.__name__}_{subject_name}",
                keras_class,
                "optimizer_test.py",
                set_up,
            )
    return loaded


# Keras's nightly wheels (keras-nightly) leave its tests out: nothing to run here then. A release
# that ships tests but not one of these files is a rename for us to follow, and fails collection.
if not any(KERAS_OPTIMIZERS_DIR.glob("*_test.py")):
    pytest.skip(
        f"Keras {keras.__version__} ships no tests: {', '.join(KERAS_TEST_FILES)} "
        f"absent from {KERAS_OPTIMIZERS_DIR}",
        allow_module_level=True,
    )
_LOADED = _generate()


@pytest.mark.backend_neutral
def test_every_keras_optimizer_test_is_classified():
    """A Keras upgrade that adds, renames or removes one of these tests must be looked at."""
    found = {
        f"{filename}::{_original_name(function)}"
        for filename, modules in _LOADED.items()
        for module in modules
        for keras_class in _keras_test_classes(module)
        for function in _keras_test_methods(keras_class).values()
    }
    assert set(_LOADED) == set(KERAS_TEST_FILES)
    classified = set(APPLICABLE) | set(NOT_APPLICABLE)
    assert not set(APPLICABLE) & set(NOT_APPLICABLE)
    assert found - classified == set(), "Keras tests not classified in APPLICABLE or NOT_APPLICABLE"
    assert classified - found == set(), "classified tests that Keras no longer has"
    for test_id in EXPECTED_DEVIATIONS:
        class_name, method = test_id.split("::")
        assert hasattr(globals().get(class_name), method), (
            f"EXPECTED_DEVIATIONS: no generated test {test_id}"
        )
