"""Private names: every private Keras / TensorFlow name goes through tf_dp/_compat.py (and still
exists in the installed versions); no private attribute crosses a tf_dp package boundary; the
engine imports no Keras."""

import ast
import collections
import importlib
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp import _compat

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tf_dp")
#: Public API of namedtuples, despite the underscore.
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}


def _modules():
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT).split(os.sep)
                package = rel[0] if len(rel) > 1 else ""
                with open(path) as f:
                    yield os.path.relpath(path, ROOT), package, ast.parse(f.read())


def _defined_names():
    """Every name a tf_dp package defines -> the packages that define it: functions, classes,
    assigned names, ``self.x`` / ``cls.x`` attributes, arguments, keys of dict literals and
    setattr targets. An attribute stored on another object (``obj._x = ...``) defines ``_x`` only
    if no package defines it otherwise (an attribute tf_dp attaches to a Keras object)."""
    defs = collections.defaultdict(set)
    foreign_stores = collections.defaultdict(set)
    for _, package, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs[node.name].add(package)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    defs[node.attr].add(package)
                else:
                    foreign_stores[node.attr].add(package)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defs[node.id].add(package)
            elif isinstance(node, ast.arg):
                defs[node.arg].add(package)
            elif isinstance(node, ast.Dict):
                for key in node.keys:
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        defs[key.value].add(package)
            elif isinstance(node, ast.Call) and len(node.args) > 1 and isinstance(
                node.args[1], ast.Constant
            ) and (getattr(node.func, "id", None) == "setattr"
                   or getattr(node.func, "attr", None) == "__setattr__"):
                defs[str(node.args[1].value)].add(package)
    for name, packages in foreign_stores.items():
        if name not in defs:
            defs[name] |= packages
    return defs


def _private_reads(tree):
    """``(line, name)`` of every access ``x._name`` (read or write; x not self/cls) and
    ``getattr(x, "_name")``."""
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                name = node.attr
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
            "getattr", "hasattr"
        ) and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
            name = node.args[1].value
        if isinstance(name, str) and name.startswith("_") and not name.startswith("__"):
            yield node.lineno, name


def test_no_private_attribute_crosses_a_package_boundary():
    defs = _defined_names()
    crossing = []
    for path, package, tree in _modules():
        if path == "_compat.py":
            continue
        for line, name in _private_reads(tree):
            owners = defs.get(name, set())
            if owners and package not in owners:
                crossing.append(f"{path}:{line} {name} (defined in {sorted(owners)})")
        for node in ast.walk(tree):  # from tf_dp.<other package> import _private
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tf_dp."):
                source = node.module.split(".")[1]
                for alias in node.names:
                    if alias.name.startswith("_") and source != package and not (
                        alias.name == "_compat"
                    ):
                        crossing.append(f"{path}:{node.lineno} imports {node.module}.{alias.name}")
    assert not crossing, "\n".join(crossing)


def test_private_keras_and_tensorflow_names_only_in_compat():
    defs = _defined_names()
    foreign = []
    for path, _, tree in _modules():
        if path == "_compat.py":
            continue
        for line, name in _private_reads(tree):
            if name not in defs and name not in NAMEDTUPLE_API:
                foreign.append(f"{path}:{line} {name}")
        for node in ast.walk(tree):
            modules = []
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            for module in modules:
                if module.startswith(("keras.src", "tensorflow.python")):
                    foreign.append(f"{path}:{node.lineno} imports {module}")
    assert not foreign, "use tf_dp/_compat.py for:\n" + "\n".join(foreign)


def test_every_private_name_listed_in_compat_exists_in_the_installed_versions():
    inputs = keras.Input((3,), name="x")
    embedded = keras.layers.Embedding(5, 2, mask_zero=True)(keras.ops.cast(inputs, "int32"))
    outputs = keras.layers.Dense(2)(keras.layers.Flatten()(embedded))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    model.fit(np.ones((2, 3)), np.zeros((2, 2)), verbose=0)
    mask = keras.layers.Embedding(5, 2, mask_zero=True)(np.array([[1, 0]]))
    import keras_hub
    from keras_hub.src.models.t5.t5_multi_head_attention import T5MultiHeadAttention

    head = keras_hub.layers.MaskedLMHead(vocabulary_size=5, intermediate_activation="gelu")
    head.build((None, 3, 4), (None, 2))  # untied: it owns its projection kernel
    objects = {
        "keras.Layer": model.layers[-1],
        "keras.layers.Dense": model.layers[-1],
        "keras.layers.Embedding": model.layers[1] if isinstance(
            model.layers[1], keras.layers.Embedding) else model.layers[2],
        "keras.Model": model,
        "keras functional model": model,
        "keras CompileMetrics": model._compile_metrics,
        "keras CompileLoss": model._compile_loss,
        "keras tensor": mask,
        "keras.Variable": model.trainable_variables[0],
        "keras_hub MaskedLMHead": head,
        "keras_hub T5MultiHeadAttention": T5MultiHeadAttention,
    }
    missing = []
    for owner, name in _compat.PRIVATE_NAMES:
        target = objects.get(owner)
        if target is None:
            target = importlib.import_module(owner)
        if not hasattr(target, name):
            missing.append(f"{owner}.{name}")
    assert not missing, missing
    assert _compat.functional_class() is type(model)
    assert isinstance(_compat.tf_variable(model.trainable_variables[0]), tf.Variable)
    assert [layer.name for layer in _compat.flatten_layers(model, include_self=False)] == [
        layer.name for layer in model.layers]
    assert _compat.loss_tracker(model) is not None and _compat.compiled_metrics(model) is not None


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(ROOT, "engine"))))
def test_engine_imports_no_keras(name):
    if not name.endswith(".py"):
        return
    with open(os.path.join(ROOT, "engine", name)) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "keras" for a in node.names), name
        if isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] != "keras", name
            assert not (node.module or "").startswith("tf_dp.keras"), name
