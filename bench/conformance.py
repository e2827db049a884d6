"""Conformance sweep: every built-in Keras layer with trainable weights (in a minimal model), every
``keras.applications`` model (``weights=None``, small input, after ``fix_for_dp``) and every
keras-hub task class buildable from a tiny backbone config (enumerated from ``keras_hub.models``),
each checked by :func:`tf_dp.keras.conformance.check_model` in a process of its own (a crash,
segfault or timeout is a recorded failure).

    python -m bench.conformance --out docs/coverage.md            # the whole sweep, the table
    python -m bench.conformance --cases layer:Dense,hub:GPT2CausalLM+lora --format json
    python -m bench.conformance --list                            # the cases and the unbuildable
    python -m bench.conformance --resume bench/coverage_results.jsonl --table_only \
        --out docs/coverage.md                                    # the table from the results
    python -m bench.conformance --resume a.jsonl,b.jsonl --merged_out merged.jsonl --table_only \
        --out docs/coverage.md                                    # merge runs (last record wins)
    python -m bench.conformance --case layer:Dense                # one case, in this process

Case names: ``layer:<keras.layers class>``, ``app:<keras.applications function>``,
``hub:<keras_hub.models task class>`` (``+lora``: with ``backbone.enable_lora(4)``, or with
``target_layer_names`` from ``LORA_TARGETS`` where keras-hub's default names match no layer).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time

import numpy as np

BATCH = 4
SEQ = 8
VOCAB = 64
IMAGE = 32
MASKS = 2

#: tiny values for keras-hub backbone constructor arguments, by name
TINY = {
    "vocabulary_size": VOCAB,
    "num_layers": 1,
    "num_heads": 2,
    "num_query_heads": 2,
    "num_key_value_heads": 1,
    "hidden_dim": 16,
    "intermediate_dim": 32,
    "head_dim": 8,
    "max_sequence_length": 16,
    "num_segments": 2,
    "num_classes": 3,
    "bucket_size": 4,
    "num_buckets": 4,
    "max_distance": 8,
    "embedding_size": 8,
    "embedding_dim": 8,
    "num_groups": 1,
    "num_inner_repetitions": 1,
    "num_experts": 2,
    "top_k": 1,
    "num_experts_per_tok": 1,
    "moe_intermediate_dim": 8,
    "shared_expert_intermediate_dim": 8,
    "shared_expert_intermediate_size": 8,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 8,
    "intermediate_size": 16,
    "head_size": 8,  # = hidden_dim / num_heads (RoformerV2 adds a head_size-wide projection)
    "max_position_embeddings": 16,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "layer_norm_epsilon": 1e-6,
    "partial_rotary_factor": 1.0,
    "patch_size": 4,
    "mlp_dim": 16,
    "embed_dim": 8,
    "window_size": 4,
    "vocab_size": VOCAB,
    "image_size": IMAGE,
    "pad_token_id": 0,
    "sliding_window": 4,
    "sliding_window_size": 4,
    "key_value_dim": 8,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 4,
    "altup_num_inputs": 2,
    "laurel_rank": 2,
    "stem_kernel_size": 3,
    "stem_strides": 1,
    "max_drop_path_rate": 0.0,
    "hidden_dims": [8],
    "stage_type": "csp",
    "last_layer_filter": 8,
    "output_num_filters": 8,
    "depthwise_filters": 8,
    "depthwise_stride": 1,
    "depthwise_residual": False,
}

#: list-valued (per stage or per layer) backbone settings: the value of one stage's entry, by a
#: word of the argument's name (the first match in this order; a tuple: the candidates, tried in
#: turn); lists get one entry per stage (``TINY_STAGES``) or per layer (names with ``layer``:
#: ``num_layers``'s tiny value)
TINY_LIST_ENTRY = (
    ("rope_layer_enabled", True),
    ("layer_types", ("full_attention", "attention", "sliding_attention")),
    ("block_types", "v1"),
    ("coefficients", 1.0),
    ("pooling", False),
    ("downsample", False),
    ("use_", False),
    ("repeats", 1),
    ("blocks", 1),
    ("depth", 1),
    ("num_heads", 1),
    ("sr_ratios", 1),
    ("kernel_size", 3),
    ("patch_sizes", 3),
    ("strides", 1),
    ("expansion", 1),
    ("se_ratio", 0.25),
    ("squeeze_and_excite", 0.25),
    ("activation", "relu"),
    ("padding", "same"),
    ("filters", (8, 64)),
    ("hidden_sizes", 8),
    ("dims", 8),
    ("channels", 8),
)
TINY_STAGES = 1
#: string settings without a default: the accepted values, tried in this order (by name)
TINY_CHOICES = {
    "block_type": ("basic_block", "dark_block", "bottleneck_block"),
    "hidden_act": ("relu",),
    "hidden_activation": ("gelu_approximate", "gelu"),
}
#: prefixes/suffixes of an argument name whose stem has a tiny value (``encoder_hidden_dim``)
TINY_AFFIXES = ("encoder_", "decoder_", "text_", "vit_", "_enc", "_dec")

#: task families the harness can make inputs for (base class name -> kind)
HUB_KINDS = ("CausalLM", "TextClassifier", "ImageClassifier", "MaskedLM", "Seq2SeqLM")
HUB_NOT_YET = {
    "ObjectDetector": "needs box targets: not made by the harness",
    "ImageSegmenter": "needs per-pixel targets: not made by the harness",
    "TextToImage": "generative diffusion task: no supervised loss",
    "AudioToText": "needs audio inputs: not made by the harness",
}


# ---------------------------------------------------------------- enumeration


def layer_cases() -> tuple[list, dict]:
    import keras

    cases, skipped = [], {}
    for name in sorted(dir(keras.layers)):
        cls = getattr(keras.layers, name)
        if not (inspect.isclass(cls) and issubclass(cls, keras.layers.Layer)):
            continue
        if name in ("Layer", "InputLayer", "Wrapper", "RNN", "TFSMLayer"):
            skipped[f"layer:{name}"] = "base class or wrapper (no weights of its own)"
            continue
        cases.append(f"layer:{name}")
    return cases, skipped


def app_cases() -> tuple[list, dict]:
    import keras

    cases = []
    for name in sorted(dir(keras.applications)):
        if name[0].isupper() and callable(getattr(keras.applications, name)):
            cases.append(f"app:{name}")
    return cases, {}


def _hub_kind(cls) -> str | None:
    for base in cls.__mro__:
        for kind in HUB_KINDS + tuple(HUB_NOT_YET):
            if base.__name__ == kind:
                return kind
    return None


def hub_cases() -> tuple[list, dict]:
    try:
        import keras_hub
    except ImportError as e:
        return [], {"hub:*": f"keras_hub not importable: {e}"}
    cases, skipped = [], {}
    for name in sorted(dir(keras_hub.models)):
        cls = getattr(keras_hub.models, name)
        if not inspect.isclass(cls) or not issubclass(cls, keras_hub.models.Task):
            continue
        kind = _hub_kind(cls)
        if getattr(cls, "backbone_cls", None) is None or kind == name:
            continue  # base classes
        if kind is None:
            family = [
                b.__name__ for b in cls.__mro__ if keras_hub.models.Task in b.__bases__
            ]
            skipped[f"hub:{name}"] = (
                f"task family {family[0] if family else '?'}: inputs/targets not made by "
                "the harness"
            )
            continue
        if kind in HUB_NOT_YET:
            skipped[f"hub:{name}"] = HUB_NOT_YET[kind]
            continue
        cases.append(f"hub:{name}")
        if kind == "CausalLM":
            cases.append(f"hub:{name}+lora")
    return cases, skipped


def all_cases() -> tuple[list, dict]:
    cases, skipped = [], {}
    for f in (layer_cases, app_cases, hub_cases):
        c, s = f()
        cases += c
        skipped.update(s)
    return cases, skipped


# ---------------------------------------------------------------- building one case


class NotConstructible(Exception):
    """The harness cannot build this case (the reason is the message)."""


def _layer_structures(keras, name: str) -> list:
    """Constructions of layers that a generic ``cls(*args)`` cannot make: wrappers (around a
    Dense or an LSTM), RNN cells (inside ``keras.layers.RNN``), attention layers (called on a
    query and a value), ``EinsumDense`` (an equation), ``ConvLSTM3D`` (a 6-d input). Each:
    (layer factory, input shape, call style: ``"one"``, ``"query_value"``, ``"list"``)."""
    cls = getattr(keras.layers, name)
    dense, lstm = (lambda: keras.layers.Dense(4)), (lambda: keras.layers.LSTM(4))
    table = {
        "Bidirectional": (lambda: cls(lstm()), (SEQ, 3), "one"),
        "TimeDistributed": (lambda: cls(dense()), (SEQ, 3), "one"),
        "SpectralNormalization": (lambda: cls(dense()), (5,), "one"),
        "MultiHeadAttention": (lambda: cls(num_heads=2, key_dim=4), (SEQ, 3), "query_value"),
        "GroupQueryAttention": (
            lambda: cls(head_dim=4, num_query_heads=2, num_key_value_heads=1),
            (SEQ, 3),
            "query_value",
        ),
        "Attention": (lambda: cls(use_scale=True), (SEQ, 3), "list"),
        "AdditiveAttention": (lambda: cls(use_scale=True), (SEQ, 3), "list"),
        "EinsumDense": (
            lambda: cls("abc,cd->abd", output_shape=(SEQ, 4), bias_axes="d"),
            (SEQ, 3),
            "one",
        ),
        "ConvLSTM3D": (lambda: cls(2, 3), (2, 4, 4, 4, 2), "one"),
        "StackedRNNCells": (
            lambda: keras.layers.RNN(
                cls([keras.layers.LSTMCell(4), keras.layers.GRUCell(4)])
            ),
            (SEQ, 3),
            "one",
        ),
    }
    if name in table:
        return [table[name]]
    if name.endswith("Cell"):
        return [(lambda: keras.layers.RNN(cls(4)), (SEQ, 3), "one")]
    return []


def _build_layer(name):
    import keras

    cls = getattr(keras.layers, name)
    rng = np.random.default_rng(0)
    shapes = [(5,), (SEQ, 3), (SEQ, 3), (6, 6, 3), (4, 4, 4, 2), (SEQ, 3), (6, 6, 2)]
    argss = [(4,), (4,), (), (4, 3), (4, 2), (4, 3), (4, 2)]
    attempts = [
        (lambda a=a: cls(*a), shape, "one") for a, shape in zip(argss, shapes)
    ]
    if name.endswith("Embedding"):  # token ids, not floats (a float cast to an id can be < 0)
        attempts = [(lambda: cls(VOCAB, 4), "tokens", "one")]
    attempts = _layer_structures(keras, name) or attempts
    last = "no constructor/input combination tried"
    for make, shape, style in attempts:
        try:
            layer = make()
            if shape == "tokens":
                inp = keras.Input((SEQ,), dtype="int32")
                x = rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32")
            else:
                inp = keras.Input(shape)
                x = rng.normal(size=(BATCH, *shape)).astype("float32")
            if style == "query_value":
                out = layer(inp, inp)
            elif style == "list":
                out = layer([inp, inp])
            else:
                out = layer(inp)
            if not layer.trainable_weights:
                raise NotConstructible("no trainable weights")
            out = keras.layers.Flatten()(out) if len(out.shape) > 2 else out
            out = keras.layers.Dense(3)(out)
            return keras.Model(inp, out), x, np.arange(BATCH) % 3, "sce"
        except NotConstructible:
            raise
        except Exception as e:  # noqa: BLE001 - try the next constructor/input shape
            last = f"{type(e).__name__}: {str(e)[:160]}"
    raise NotConstructible(f"not buildable in a minimal model ({last})")


def _build_app(name):
    import keras

    import tf_dp

    fn = getattr(keras.applications, name)
    params = inspect.signature(fn).parameters
    kwargs = {"weights": None, "classes": 3}
    if "classifier_activation" in params:
        kwargs["classifier_activation"] = None
    model = None
    for size in (IMAGE, 75, 197):
        try:
            model = fn(input_shape=(size, size, 3), **kwargs)
            break
        except ValueError as e:
            last = str(e)[:160]
    if model is None:
        raise NotConstructible(f"no small input size accepted ({last})")
    model, _ = tf_dp.keras.fix_for_dp(model)  # (the copy, the report)
    x = np.random.default_rng(0).normal(size=(BATCH, size, size, 3)).astype("float32")
    return model, x, np.arange(BATCH) % 3, "sce"


def _tiny_scalar(name: str):
    """A tiny value for a scalar argument, by its name or its stem (``encoder_hidden_dim``)."""
    if name in TINY:
        return TINY[name]
    for affix in TINY_AFFIXES:
        stem = name.removeprefix(affix) if affix.endswith("_") else name.removesuffix(affix)
        if stem != name and stem in TINY:
            return TINY[stem]
    return None


def _list_entry(name: str):
    for word, value in TINY_LIST_ENTRY:
        if word in name:
            return value if isinstance(value, tuple) else (value,)
    return None


def _backbone_configs(backbone_cls, kind: str):
    """Candidate tiny configs of ``backbone_cls``, derived from its signature: scalars from
    ``TINY`` (by name or stem), list-valued settings (``stackwise_*``, ``layerwise_*``, plural
    names) with one entry per stage or layer from ``TINY_LIST_ENTRY``, strings from
    ``TINY_CHOICES``. Variants, tried in turn: ambiguous settings (``stem_filters``: int or
    list?) as lists, as scalars, stage lists nested (one list of blocks per stage), per-stage
    scalars (``num_heads`` beside ``depths``) as lists; each candidate entry or string in turn.
    Raises NotConstructible naming the first argument with no tiny value."""
    fixed, listed, strings = {}, {}, {}
    for p, spec in inspect.signature(backbone_cls.__init__).parameters.items():
        if p in ("self", "kwargs", "args"):
            continue
        value = _tiny_scalar(p)
        stagewise = p.startswith(("stackwise_", "layerwise_"))
        if value is not None:
            fixed[p] = value
        elif p == "image_shape" and kind == "ImageClassifier":
            fixed[p] = (IMAGE, IMAGE, 3)
        elif spec.default is not inspect.Parameter.empty and not (
            stagewise and spec.default is None
        ):
            continue
        elif p in TINY_CHOICES:
            strings[p] = TINY_CHOICES[p]
        elif _list_entry(p) is not None:
            length = TINY["num_layers"] if "layer" in p else TINY_STAGES
            always = stagewise or p.endswith(("s", "_list", "_block"))
            listed[p] = (_list_entry(p), length, always)
        elif any(w in p for w in ("encoder", "qformer", "language_model", "decoder")):
            raise NotConstructible(
                f"{backbone_cls.__name__} needs a sub-model {p!r} (a separately built "
                "backbone or layer, not a setting): not made by the harness"
            )
        else:
            raise NotConstructible(
                f"{backbone_cls.__name__} needs {p!r} (no tiny value known for it)"
            )
    choices = max(
        [len(c) for c in strings.values()] + [len(e) for e, _, _ in listed.values()],
        default=1,
    )
    for shape in ("flat", "scalar", "nested", "per_stage"):
        for k in range(choices):
            config = dict(fixed)
            for p, c in strings.items():
                config[p] = c[min(k, len(c) - 1)]
            for p, (entries, length, always) in listed.items():
                entry = entries[min(k, len(entries) - 1)]
                if shape == "scalar" and not always:
                    config[p] = entry
                elif shape == "nested" and p.startswith("stackwise_"):
                    config[p] = [[entry]] * length
                else:
                    config[p] = [entry] * length
            if shape == "per_stage":
                if not listed:
                    continue
                for p, value in fixed.items():
                    if isinstance(value, int) and _list_entry(p) is not None:
                        config[p] = [value] * TINY_STAGES
            yield config


def _hub_backbone(backbone_cls, kind: str):
    errors = []
    for config in _backbone_configs(backbone_cls, kind):
        try:
            return backbone_cls(**config)
        except Exception as e:  # noqa: BLE001 - try the next candidate config
            errors.append(f"{type(e).__name__}: {str(e)[:160]}")
    raise NotConstructible(
        f"{backbone_cls.__name__} not buildable from a tiny config ({len(errors)} tried; "
        f"first: {errors[0]}; last: {errors[-1]})"
    )


def _hub_inputs(task, rng) -> dict:
    """Random inputs for a text task's named inputs: token ids (any ``*token_ids``), padding
    masks (all ones), segment ids, masked-LM positions (``MASKS`` distinct positions), images
    (a vision-language model's ``images``, unknown sizes ``IMAGE``)."""
    x = {}
    for inp in task.inputs:
        key = inp.name.split(":")[0]
        if "padding_mask" in key or key == "mask":
            x[key] = np.ones((BATCH, SEQ), "int32")
        elif key == "mask_positions":
            x[key] = np.stack(
                [np.sort(rng.choice(SEQ, MASKS, replace=False)) for _ in range(BATCH)]
            ).astype("int32")
        elif "token_ids" in key:
            x[key] = rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32")
        elif key in ("segment_ids", "token_type_ids") or "int" in str(inp.dtype):
            x[key] = rng.integers(0, 2, (BATCH, SEQ)).astype("int32")
        elif "image" in key and "float" in str(inp.dtype):
            shape = [d if d is not None else IMAGE for d in inp.shape[1:]]
            x[key] = rng.normal(size=(BATCH, *shape)).astype("float32")
        else:
            raise NotConstructible(
                f"input {key!r} ({inp.dtype}) not made by the harness"
            )
    return x


#: attention projections given LoRA adapters where keras-hub's ``default_lora_layer_names()``
#: name none of a backbone's layers (GPT-NeoX's fused ``query_key_value``, SmolLM's ``q_proj``)
LORA_TARGETS = frozenset({"query_key_value", "q_proj", "v_proj", "in_proj_qkv", "qkv"})


def _task(cls, **kwargs):
    try:
        return cls(**kwargs)
    except TypeError as e:  # a task with settings of its own beyond the backbone's
        raise NotConstructible(f"{cls.__name__}: {str(e)[:200]}") from e


def _build_hub(name):
    import keras
    import keras_hub

    from tf_dp import _compat

    lora = name.endswith("+lora")
    name = name.removesuffix("+lora")
    cls = getattr(keras_hub.models, name)
    kind = _hub_kind(cls)
    backbone = _hub_backbone(cls.backbone_cls, kind)
    rng = np.random.default_rng(0)
    if kind == "ImageClassifier":
        task = _task(cls, backbone=backbone, num_classes=3, preprocessor=None)
        if any(
            isinstance(layer, keras.layers.BatchNormalization)
            for layer in _compat.flatten_layers(task, include_self=False)
        ):  # as for keras.applications: the user's documented path (a plain functional copy)
            import tf_dp

            task, _ = tf_dp.keras.fix_for_dp(task)
        shape = [d if d is not None else IMAGE for d in task.inputs[0].shape[1:]]
        x = rng.normal(size=(BATCH, *shape)).astype("float32")
        return task, x, np.arange(BATCH) % 3, "sce"
    if kind == "TextClassifier":
        task = _task(cls, backbone=backbone, num_classes=3, preprocessor=None)
        return task, _hub_inputs(task, rng), np.arange(BATCH) % 3, "sce"
    task = _task(cls, backbone=backbone, preprocessor=None)
    if lora:
        backbone.enable_lora(4)
        if not task.trainable_variables:  # keras-hub's default names match no layer of this one
            names = {
                layer.name
                for layer in _compat.flatten_layers(backbone, include_self=False)
                if hasattr(layer, "enable_lora") and layer.name in LORA_TARGETS
            }
            if not names:
                raise NotConstructible(
                    f"{cls.__name__}: backbone.enable_lora(4) enables no adapter (no layer named "
                    f"{backbone.default_lora_layer_names()} or {sorted(LORA_TARGETS)})"
                )
            backbone.enable_lora(4, target_layer_names=sorted(names))
    x = _hub_inputs(task, rng)
    if kind == "MaskedLM":  # the original tokens at the masked positions
        y = rng.integers(0, VOCAB, (BATCH, MASKS)).astype("int32")
    else:  # next token (of the decoder's sequence for a seq2seq LM)
        key = "decoder_token_ids" if "decoder_token_ids" in x else "token_ids"
        y = np.roll(x[key], -1, axis=1)
    return task, x, y, "sce"


def build_case(case: str):
    kind, _, name = case.partition(":")
    return {"layer": _build_layer, "app": _build_app, "hub": _build_hub}[kind](name)


def run_case(case: str, timing_repeats: int = 3, floatx: str | None = None) -> dict:
    """Builds and checks one case in this process; the record as a dict with ``case`` and
    ``status`` (``"checked"``, ``"not constructible"``). ``floatx`` (e.g. ``"float64"``) builds
    the model in that float type (``keras.config.set_floatx``) and casts the float inputs: it
    tells a rule's error from float32 rounding amplified through a deep model."""
    import keras

    from tf_dp.keras.conformance import check_model

    if floatx is not None:
        keras.config.set_floatx(floatx)
    keras.utils.set_random_seed(0)
    try:
        model, x, y, _ = build_case(case)
    except NotConstructible as e:
        return {"case": case, "status": "not constructible", "error": str(e)}
    if floatx is not None:
        x = tf_nest_cast(x, floatx)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    record = check_model(model, x, y, loss, timing_repeats=timing_repeats).as_dict()
    record.update(case=case, status="checked")
    if floatx is not None:  # what the model was built in
        record["weights_dtype"] = sorted({str(w.dtype) for w in model.weights})
    return record


def tf_nest_cast(x, dtype: str):
    """The float arrays of ``x`` (an array or a dict of arrays) cast to ``dtype``."""
    def cast(a):
        a = np.asarray(a)
        return a.astype(dtype) if np.issubdtype(a.dtype, np.floating) else a

    return {k: cast(v) for k, v in x.items()} if isinstance(x, dict) else cast(x)


def run_isolated(case: str, timeout: float = 900.0, timing_repeats: int = 3) -> dict:
    """Runs :func:`run_case` in a subprocess: a crash or timeout is a recorded failure."""
    return run_isolated_together([case], timeout, timing_repeats)[0]


def run_isolated_together(
    cases: list, timeout: float = 900.0, timing_repeats: int = 3
) -> list:
    """Runs :func:`run_case` for ``cases`` one after the other in one subprocess (one import of
    TensorFlow; the sweep uses one per case). After a crash or timeout, the case that was running
    is recorded as the failure and the cases after it run in a new subprocess (``timeout`` per
    subprocess), so one crash fails one case."""
    records, pending = {}, list(cases)
    while pending:
        found, status, error = _run_in_one_process(pending, timeout, timing_repeats)
        records.update(found)
        missing = [c for c in pending if c not in found]
        if not missing:
            break
        # the cases run in order: the first without a record is the one the process died in
        records[missing[0]] = {"case": missing[0], "status": status, "error": error}
        pending = pending[pending.index(missing[0]) + 1:]
    return [records[c] for c in cases]


def _run_in_one_process(cases: list, timeout: float, timing_repeats: int):
    """One subprocess running ``cases`` in order: ``({case: record}, status, error)`` where the
    status and error describe how the process ended if it ended early."""
    cmd = [
        sys.executable,
        "-m",
        "bench.conformance",
        "--case",
        ",".join(cases),
        "--timing_repeats",
        str(timing_repeats),
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    start = time.time()
    try:
        proc = subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=timeout, cwd=root
        )
    except subprocess.TimeoutExpired as e:
        stdout, status = e.stdout or "", "timeout"
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
        error = f"no result in {timeout:.0f} s"
    else:
        stdout, status = proc.stdout, "crashed"
        error = f"exit code {proc.returncode}: {proc.stderr[-300:]}"
    found = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            out = json.loads(line)
            out["seconds"] = round(time.time() - start, 1)
            found[out["case"]] = out
    return found, status, error


# ---------------------------------------------------------------- the table


def _yn(v):
    return "Y" if v else "N"


FAMILIES = (("hub", "keras-hub task classes"), ("app", "keras.applications"), ("layer", "Keras layers"))
#: errors raised before any step for what DP training does not support (a clear refusal)
REFUSALS = ("NotImplementedError", "ValueError", "TypeError")


def _trains(r) -> bool:
    return bool(r["trains"] and r["ledger_ok"] and not r.get("error"))


def _refused(r) -> bool:
    return bool(
        r.get("error") and not r["trains"] and r["error"].startswith(REFUSALS)
    )


def _lora_ratios(results) -> list:
    return sorted(
        r["step_ratio"]
        for r in results
        if r.get("status") == "checked"
        and r["case"].endswith("+lora")
        and np.isfinite(r.get("step_ratio") or np.nan)
    )


def _summary(results: list, skipped: dict, pending) -> list:
    """The summary lines: per family, what was checked, trains, is exact, falls back, was
    refused, failed or crashed; the LoRA decoders' step-ratio distribution."""
    lines = [
        "| family | checked | train | exact | all fast rules | with a fallback | refused | "
        "step failed | crashed or timed out | not constructible or not swept | not yet run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for prefix, label in FAMILIES:
        mine = [r for r in results if r["case"].startswith(prefix + ":")]
        checked = [r for r in mine if r.get("status") == "checked"]
        trains = [r for r in checked if _trains(r)]
        refused = [r for r in checked if _refused(r)]
        lines.append(
            f"| {label} | {len(checked)} | {len(trains)} | "
            f"{sum(bool(r['exact']) for r in checked)} | "
            f"{sum(r['mode'] == 'ghost' for r in trains)} | "
            f"{sum(r['mode'] != 'ghost' for r in trains)} | {len(refused)} | "
            f"{len(checked) - len(trains) - len(refused)} | "
            f"{sum(r.get('status') in ('crashed', 'timeout') for r in mine)} | "
            f"{sum(k.startswith(prefix + ':') for k in skipped)} | "
            f"{sum(c.startswith(prefix + ':') for c in pending)} |"
        )
    lora = _lora_ratios(results)
    if lora:
        q = np.percentile(lora, [10, 25, 50, 75, 90])
        lines += [
            "",
            f"DP / non-private step ratio of the {len(lora)} keras-hub decoders with LoRA "
            f"(`enable_lora(4)`) whose step ran: median {q[2]:.2f}; 10/25/75/90th percentiles "
            f"{q[0]:.2f} / {q[1]:.2f} / {q[3]:.2f} / {q[4]:.2f}; range {lora[0]:.2f}-{lora[-1]:.2f}; "
            f"{sum(v <= 1.3 for v in lora)} of {len(lora)} at or below 1.3. Sorted: "
            + ", ".join(f"{v:.2f}" for v in lora)
            + ".",
        ]
    return lines


def table(results: list, skipped: dict, pending: list = ()) -> str:
    skipped = dict(skipped)
    for r in results:
        if r.get("status") == "not constructible":
            skipped[r["case"]] = "not constructible: " + str(r.get("error", ""))
    results = [r for r in results if r.get("status") != "not constructible"]
    lines = [
        "# Coverage: models and layers under DP training",
        "",
        "Generated (do not edit by hand) from the recorded results by `python -m bench.conformance "
        "--resume bench/coverage_results.jsonl --table_only --out docs/coverage.md`; the sweep "
        "itself: `python -m bench.conformance --jsonl FILE --out docs/coverage.md` (see "
        "[conformance.md](conformance.md)).",
        "",
        (
            f"Inputs: keras-hub tasks from tiny backbone configs derived from the class signature "
            f"(width 16, 1 layer, 1 stage, vocabulary {VOCAB}, sequence {SEQ}, images "
            f"{IMAGE}x{IMAGE}; masked LMs with {MASKS} masked positions; causal LMs also with "
            f"`enable_lora(4)`, or `enable_lora(4, target_layer_names=...)` with the backbone's "
            f"attention projections among {sorted(LORA_TARGETS)} where keras-hub's default names "
            "match none of its layers; the checked model keeps the adapters and the frozen weights "
            "across the harness's `.keras` copy; image classifiers with BatchNormalization after "
            "`tf_dp.keras.fix_for_dp`); `keras.applications` models with "
            f"`weights=None`, 3 classes, the "
            f"smallest of {IMAGE}, 75 and 197 px they accept, after `tf_dp.keras.fix_for_dp` "
            "(BatchNormalization -> GroupNormalization); each Keras layer in a minimal model."
        ),
        "",
        (
            "Each row ran in its own process: `tf_dp.keras.conformance.check_model` on a batch of "
            f'{BATCH}, `gradient_mode="auto"`: *trains* (a finite loss, a second step, a `.keras` '
            "save and reload and a third step with ledger steps == 3), *exact* (the step with noise 0 "
            "equals a per-example GradientTape reference within float32's bound), *rule* (`ghost`: "
            "every variable on an exact fast rule; otherwise the layers that fall back to per-example "
            "gradients), *ratio* (median DP / non-private step time of interleaved one-step fits, shared CPU)."
        ),
        "",
        (
            "*exact* is judged against a worst-case float32 rounding bound (`tolerance`, counted "
            "from fan-ins and positions; for images it grows with the squared number of input "
            "positions, so it is loose there): the records in `bench/coverage_results.jsonl` give "
            "`max_error` and `step_size` for a closer look. A `timeout` row ran out of the "
            "`--timeout` budget (900 s) on a shared 2-core machine, where tracing a big model's "
            "first DP step alone takes minutes: rerun it with a larger `--timeout`."
        ),
        "",
        "## Summary",
        "",
        *_summary(results, skipped, pending),
        "",
        "## Results",
        "",
        "| case | trains | exact | rule or fallback | ratio | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.get("status") != "checked":
            lines.append(
                f"| {r['case']} | N | N | - | - | {r['status']}: "
                f"{str(r.get('error', '')).replace('|', '/').replace(chr(10), ' ')[-150:]} |"
            )
            continue
        trains = _trains(r)
        rule = (
            "ghost"
            if r["mode"] == "ghost"
            else (f"{r['mode']}: " + ", ".join(r["fallback_reasons"]))[:150]
        )
        ratio = (
            f"{r['step_ratio']:.2f}"
            if r.get("step_ratio") == r.get("step_ratio")
            else "-"
        )
        note = str(r.get("error") or "").replace("|", "/").replace("\n", " ")[:150]
        lines.append(
            f"| {r['case']} | {_yn(trains)} | {_yn(r['exact'])} | {rule} | {ratio} | "
            f"{note} |"
        )
    if skipped:
        lines += ["", "## Not swept", "", "| case | reason |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in sorted(skipped.items())]
    if pending:
        lines += [
            "",
            "## Not yet run (the sweep did not reach them in this generation)",
            "",
            ", ".join(pending),
        ]
    return "\n".join(lines) + "\n"


def read_results(paths) -> dict:
    """Case -> record from ``--jsonl`` files (missing ones ignored); a case recorded more than
    once: the last record wins, files in the order given."""
    done = {}
    for path in paths:
        if path and os.path.exists(path):
            with open(path) as f:
                done.update((r["case"], r) for r in map(json.loads, filter(str.strip, f)))
    return done


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--case", help="run one case in this process, print its record as JSON"
    )
    parser.add_argument("--cases", help="comma-separated cases (default: all)")
    parser.add_argument(
        "--list", action="store_true", help="print the cases and the skipped"
    )
    parser.add_argument("--out", help="write the coverage table (markdown) here")
    parser.add_argument(
        "--jsonl", help="append each record to this file as it finishes"
    )
    parser.add_argument(
        "--resume",
        help="--jsonl file(s), comma-separated, whose cases are not run again (a case recorded "
        "more than once: the last record wins, files in the order given)",
    )
    parser.add_argument(
        "--merged_out",
        help="write the --resume records (the last of each case) to this jsonl file",
    )
    parser.add_argument(
        "--table_only",
        action="store_true",
        help="with --resume and --out: write the table from the recorded results only, listing "
        "the cases not yet run",
    )
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--timing_repeats", type=int, default=3)
    parser.add_argument(
        "--floatx",
        help="with --case: build the model in this float type (e.g. float64) to tell a rule's "
        "error from float32 rounding",
    )
    args = parser.parse_args(argv)
    if args.case:
        for case in args.case.split(","):
            print(json.dumps(run_case(case, args.timing_repeats, args.floatx)), flush=True)
        return
    cases, skipped = all_cases()
    if args.cases:
        cases = args.cases.split(",")
    if args.list:
        print("\n".join(cases))
        for k, v in skipped.items():
            print(f"# {k}: {v}")
        return
    done = read_results((args.resume or "").split(","))
    if args.merged_out:
        with open(args.merged_out, "w") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in done.values())
    if args.table_only:
        results = [done[c] for c in cases if c in done]
        pending = [c for c in cases if c not in done]
        with open(args.out, "w") as f:
            f.write(table(results, skipped, pending))
        return
    results = []
    for case in cases:
        r = done.get(case) or run_isolated(case, args.timeout, args.timing_repeats)
        results.append(r)
        if args.jsonl and case not in done:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(r) + "\n")
        if args.format == "text":
            print(
                case,
                r["status"],
                r.get("exact"),
                r.get("mode"),
                r.get("step_ratio"),
                r.get("error", "") or "",
                flush=True,
            )
    if args.format == "json":
        print(json.dumps(results))
    if args.out:
        with open(args.out, "w") as f:
            f.write(table(results, skipped))


if __name__ == "__main__":
    main()
