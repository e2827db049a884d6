"""Conformance sweep: every built-in Keras layer with trainable weights (in a minimal model), every
``keras.applications`` model (``weights=None``, small input, after ``fix_for_dp``) and every
keras-hub task class buildable from a tiny backbone config (enumerated from ``keras_hub.models``),
each checked by :func:`tf_dp.keras.conformance.check_model` in a process of its own (a crash,
segfault or timeout is a recorded failure).

    python -m bench.conformance --out docs/coverage.md            # the whole sweep, the table
    python -m bench.conformance --cases layer:Dense,hub:GPT2CausalLM+lora --format json
    python -m bench.conformance --list                            # the cases and the unbuildable
    python -m bench.conformance --resume sweep.jsonl --table_only --out docs/coverage.md
    python -m bench.conformance --case layer:Dense                # one case, in this process

Case names: ``layer:<keras.layers class>``, ``app:<keras.applications function>``,
``hub:<keras_hub.models task class>`` (``+lora``: with ``backbone.enable_lora(4)``).
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
    "head_size": 4,
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
}

#: task families the harness can make inputs for (base class name -> kind)
HUB_KINDS = ("CausalLM", "TextClassifier", "ImageClassifier")
HUB_NOT_YET = {
    "MaskedLM": "needs mask_positions/mask_ids inputs: not made by the harness yet",
    "Seq2SeqLM": "needs encoder and decoder inputs: not made by the harness yet",
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


def _build_layer(name):
    import keras

    cls = getattr(keras.layers, name)
    rng = np.random.default_rng(0)
    attempts = [
        ((4,), (SEQ, 3)),
        ((), (SEQ, 3)),
        ((4, 3), (6, 6, 3)),
        ((4, 2), (4, 4, 4, 2)),
    ]
    attempts = [((4,), (5,))] + attempts + [((4, 3), (SEQ, 3)), ((4, 2), (6, 6, 2))]
    if name == "Embedding":
        attempts = [((VOCAB, 4), "tokens")]
    last = "no constructor/input combination tried"
    for args, shape in attempts:
        try:
            layer = cls(*args)
            if shape == "tokens":
                inp = keras.Input((SEQ,), dtype="int32")
                x = rng.integers(0, VOCAB, (BATCH, SEQ)).astype("int32")
            else:
                inp = keras.Input(shape)
                x = rng.normal(size=(BATCH, *shape)).astype("float32")
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


def _build_hub(name):
    import keras_hub

    lora = name.endswith("+lora")
    name = name.removesuffix("+lora")
    cls = getattr(keras_hub.models, name)
    kind = _hub_kind(cls)
    backbone_cls = cls.backbone_cls
    kwargs = {}
    for p, spec in inspect.signature(backbone_cls.__init__).parameters.items():
        if p in ("self", "kwargs", "args"):
            continue
        if p in TINY:
            kwargs[p] = TINY[p]
        elif p == "image_shape" and kind == "ImageClassifier":
            kwargs[p] = (IMAGE, IMAGE, 3)
        elif spec.default is inspect.Parameter.empty:
            raise NotConstructible(
                f"{backbone_cls.__name__} needs {p!r} (no tiny value known)"
            )
    try:
        backbone = backbone_cls(**kwargs)
    except Exception as e:
        raise NotConstructible(
            f"{backbone_cls.__name__} not buildable from a tiny config: {type(e).__name__}: "
            f"{str(e)[:200]}"
        ) from e
    rng = np.random.default_rng(0)
    if kind == "ImageClassifier":
        task = cls(backbone=backbone, num_classes=3, preprocessor=None)
        shape = [d if d is not None else IMAGE for d in task.inputs[0].shape[1:]]
        x = rng.normal(size=(BATCH, *shape)).astype("float32")
        return task, x, np.arange(BATCH) % 3, "sce"
    x = {}
    for inp in backbone.inputs:
        key = inp.name.split(":")[0]
        if "padding_mask" in key or key == "mask":
            x[key] = np.ones((BATCH, SEQ), "int32")
        elif key in ("token_ids", "segment_ids", "token_type_ids") or "int" in str(
            inp.dtype
        ):
            high = VOCAB if key == "token_ids" else 2
            x[key] = rng.integers(0, high, (BATCH, SEQ)).astype("int32")
        else:
            raise NotConstructible(
                f"input {key!r} ({inp.dtype}) not made by the harness"
            )
    if kind == "TextClassifier":
        task = cls(backbone=backbone, num_classes=3, preprocessor=None)
        return task, x, np.arange(BATCH) % 3, "sce"
    task = cls(backbone=backbone, preprocessor=None)
    if lora:
        backbone.enable_lora(4)
    y = np.roll(x["token_ids"], -1, axis=1)
    return task, x, y, "sce"


def build_case(case: str):
    kind, _, name = case.partition(":")
    return {"layer": _build_layer, "app": _build_app, "hub": _build_hub}[kind](name)


def run_case(case: str, timing_repeats: int = 3) -> dict:
    """Builds and checks one case in this process; the record as a dict with ``case`` and
    ``status`` (``"checked"``, ``"not constructible"``)."""
    import keras

    from tf_dp.keras.conformance import check_model

    keras.utils.set_random_seed(0)
    try:
        model, x, y, _ = build_case(case)
    except NotConstructible as e:
        return {"case": case, "status": "not constructible", "error": str(e)}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    record = check_model(model, x, y, loss, timing_repeats=timing_repeats).as_dict()
    record.update(case=case, status="checked")
    return record


def run_isolated(case: str, timeout: float = 900.0, timing_repeats: int = 3) -> dict:
    """Runs :func:`run_case` in a subprocess: a crash or timeout is a recorded failure."""
    return run_isolated_together([case], timeout, timing_repeats)[0]


def run_isolated_together(
    cases: list, timeout: float = 900.0, timing_repeats: int = 3
) -> list:
    """Runs :func:`run_case` for ``cases`` one after the other in one subprocess (one import of
    TensorFlow; the sweep uses one per case): after a crash or timeout, the case that was running
    and those after it are recorded as failures."""
    case = ",".join(cases)
    cmd = [
        sys.executable,
        "-m",
        "bench.conformance",
        "--case",
        case,
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
    return [
        found.get(c) or {"case": c, "status": status, "error": error} for c in cases
    ]


# ---------------------------------------------------------------- the table


def _yn(v):
    return "Y" if v else "N"


def _summary(results: list, skipped: dict, pending) -> str:
    checked = [r for r in results if r.get("status") == "checked"]
    trains = [
        r for r in checked if r["trains"] and r["ledger_ok"] and not r.get("error")
    ]
    lora = sorted(
        r["step_ratio"]
        for r in checked
        if r["case"].endswith("+lora") and np.isfinite(r.get("step_ratio") or np.nan)
    )
    text = (
        f"{len(checked)} checked, {len(trains)} train (ledger kept), "
        f"{sum(bool(r['exact']) for r in checked)} exact, "
        f"{sum(r['mode'] == 'ghost' for r in checked)} all on fast rules, "
        f"{sum(r['mode'] != 'ghost' for r in checked)} with a fallback, "
        f"{sum(r.get('status') in ('crashed', 'timeout') for r in results)} crashed or timed "
        f"out; {len(skipped)} not swept (reasons below); {len(pending)} not yet run."
    )
    if lora:
        q = np.percentile(lora, [25, 50, 75])
        text += (
            f" DP / non-private step ratio of the {len(lora)} LoRA decoders: median {q[1]:.2f}, "
            f"quartiles {q[0]:.2f}-{q[2]:.2f}, range {lora[0]:.2f}-{lora[-1]:.2f}."
        )
    return text


def table(results: list, skipped: dict, pending: list = ()) -> str:
    skipped = dict(skipped)
    for r in results:
        if r.get("status") == "not constructible":
            skipped[r["case"]] = "not constructible: " + str(r.get("error", ""))
    results = [r for r in results if r.get("status") != "not constructible"]
    lines = [
        "# Coverage: models and layers under DP training",
        "",
        "Generated by `python -m bench.conformance --out docs/coverage.md` (do not edit by hand).",
        (
            "Each row ran in its own process: `tf_dp.keras.conformance.check_model` on a batch of "
            f'{BATCH}, `gradient_mode="auto"`: *trains* (a finite loss, a second step, a `.keras` '
            "save and reload and a third step with ledger steps == 3), *exact* (the step with noise 0 "
            "equals a per-example GradientTape reference within float32's bound), *rule* (`ghost`: "
            "every variable on an exact fast rule; otherwise the layers that fall back to per-example "
            "gradients), *ratio* (median DP / non-private step time of interleaved one-step fits, shared CPU)."
        ),
        "",
        "Summary: " + _summary(results, skipped, pending),
        "",
        "| case | trains | exact | rule or fallback | ratio | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.get("status") != "checked":
            lines.append(
                f"| {r['case']} | N | N | - | - | {r['status']}: "
                f"{str(r.get('error', '')).replace('|', '/')[:150]} |"
            )
            continue
        trains = r["trains"] and r["ledger_ok"] and not r.get("error")
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
    parser.add_argument("--resume", help="a --jsonl file whose cases are not run again")
    parser.add_argument(
        "--table_only",
        action="store_true",
        help="with --resume and --out: write the table from the recorded results only, listing "
        "the cases not yet run",
    )
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--timing_repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.case:
        for case in args.case.split(","):
            print(json.dumps(run_case(case, args.timing_repeats)), flush=True)
        return
    cases, skipped = all_cases()
    if args.cases:
        cases = args.cases.split(",")
    if args.list:
        print("\n".join(cases))
        for k, v in skipped.items():
            print(f"# {k}: {v}")
        return
    done = {}
    if args.resume and os.path.exists(args.resume):
        with open(args.resume) as f:
            done = {r["case"]: r for r in map(json.loads, f)}
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
