"""What tf_dp's four Keras callbacks cost per training step, and the ledger journal's share.

For each set of callbacks (none, each of ``PrivacyReport``, ``PrivacyBudget``,
``BackupAndRestore``, ``LedgerCheckpoint`` alone, all four, and Keras's own
``keras.callbacks.BackupAndRestore`` for comparison), a model of its own trains in
``rounds`` rounds, the sets interleaved within each round (the bench/ protocol: same process,
medians, the spread beside them). Measured per round:

- **batch hooks**: the time spent in each callback's per-batch hooks (``on_train_batch_begin``
  / ``_end``), per step, after the first batch: what a callback adds to every step;
- **first batch**: the first batch's hooks, once per ``fit`` (``PrivacyBudget`` plans there);
- **epoch hooks**: the time in its epoch hooks (``on_epoch_begin`` / ``_end``), per epoch;
- **journal**: the median ``ledger.flush()`` (the train function calls it after every compiled
  call; with ``BackupAndRestore``'s journal attached it also appends the step) with the journal
  minus without it, per step, and that as a share of the median DP step of the set without
  callbacks;
- **fit**: wall time of the round's ``fit`` per step.

Models: ``tiny`` (Dense(2) on 16 features, Poisson batches at q = 0.05, where a callback's cost
weighs most) and the reference ``cnn`` (bench/models.py, batch 256, ``ghost``), whose step the
journal's share is measured against.

Usage::

    python -m bench.callback_overhead --model tiny --rounds 5 --steps 200
    python -m bench.callback_overhead --model cnn --rounds 5 --steps 40 --sets none,backup
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.keras import callbacks as dp_callbacks  # noqa: E402

SETS = ("none", "report", "budget", "backup", "checkpoint", "all", "keras_backup")
BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end")
EPOCH_HOOKS = ("on_epoch_begin", "on_epoch_end")


def _callbacks(name: str, workdir: str) -> list:
    made = {
        "report": lambda: dp_callbacks.PrivacyReport(delta=1e-5),
        "budget": lambda: dp_callbacks.PrivacyBudget(1e9, 1e-5, verbose=False),
        "backup": lambda: dp_callbacks.BackupAndRestore(os.path.join(workdir, "backup")),
        # Keras's own BackupAndRestore: what tf_dp's adds to it is the difference
        "keras_backup": lambda: keras.callbacks.BackupAndRestore(os.path.join(workdir, "kb")),
        "checkpoint": lambda: dp_callbacks.LedgerCheckpoint(
            os.path.join(workdir, "ckpt", "ledger-{epoch:03d}.json"), overwrite=True),
    }
    if name == "none":
        return []
    if name == "all":
        return [made[k]() for k in ("backup", "budget", "report", "checkpoint")]
    return [made[name]()]


def _tiny(seed: int = 0):
    keras.utils.set_random_seed(seed)
    n, q = 6000, 0.05
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    y = rng.integers(0, 2, size=n).astype(np.int32)
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((16,)), keras.layers.Dense(2)]))
    model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=q, seed=seed)
    return model, batches, int(1 / q)


def _cnn(seed: int = 0):
    from bench.models import build_model, make_batch

    keras.utils.set_random_seed(seed)
    model = tf_dp.keras.make_private(build_model("cnn", seed=seed))
    model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1, gradient_mode="ghost"),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = make_batch("cnn", 256, seed=seed)
    model.optimizer.set_sampling(tf_dp.data.Sampling(60_000, 256 / 60_000, policy="shuffle"))
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    return model, data, 234


def _timed(obj: Any, names: tuple, into: list) -> None:
    for name in names:
        original = getattr(obj, name)

        def timed(*args, _original=original, **kwargs):
            t0 = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                into.append(time.perf_counter() - t0)

        setattr(obj, name, timed)


def _machine() -> str:
    """The CPU model, its count, the load average and the TensorFlow/Keras versions."""
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return (f"{cpu}, {os.cpu_count()} CPUs, load {load}, TF {tf.__version__}, "
            f"Keras {keras.__version__}")


def _spread(values: list[float]) -> str:
    v = sorted(values)
    return f"{statistics.median(v):.4f} [{v[0]:.4f}-{v[-1]:.4f}]"


def run(model_name: str, sets: list[str], rounds: int, steps: int) -> dict[str, dict]:
    build = _tiny if model_name == "tiny" else _cnn
    workdir = tempfile.mkdtemp(prefix="tf_dp_cb_bench_")
    state: dict[str, dict] = {}
    for name in sets:
        model, data, epoch_steps = build()
        flushes: list[float] = []
        ledger = model.optimizer.ledger
        flush = ledger.flush_known  # what every flush runs (after each step, and flush())

        def timed_flush(known, _flush=flush, _into=flushes) -> None:
            t0 = time.perf_counter()
            _flush(known)
            _into.append(time.perf_counter() - t0)

        ledger.flush_known = timed_flush
        # warm-up: traces the step (the callbacks' first checks are not what is measured)
        model.fit(data, epochs=1, steps_per_epoch=5, verbose=0)
        state[name] = {"model": model, "data": data, "flushes": flushes,
                       "epoch_steps": min(epoch_steps, steps),
                       "batch": [], "first": [], "epoch": [], "fit": [], "flush": [], "dir": workdir + name}
    for _ in range(rounds):
        for name in sets:
            s = state[name]
            callbacks = _callbacks(name, s["dir"])
            batch_each: list[list[float]] = []
            epoch_t: list[float] = []
            for cb in callbacks:
                batch_each.append([])
                _timed(cb, BATCH_HOOKS, batch_each[-1])
                _timed(cb, EPOCH_HOOKS, epoch_t)
            s["flushes"].clear()
            epochs = max(1, steps // s["epoch_steps"])
            t0 = time.perf_counter()
            s["model"].fit(s["data"], epochs=epochs, steps_per_epoch=s["epoch_steps"], verbose=0,
                           callbacks=callbacks)
            ran = epochs * s["epoch_steps"]
            s["fit"].append(1000 * (time.perf_counter() - t0) / ran)
            # the first batch's two hook calls hold the first check of the fit (a plan from the
            # whole ledger): counted apart, once per fit
            s["first"].append(1000 * sum(sum(t[:2]) for t in batch_each))
            s["batch"].append(1000 * sum(sum(t[2:]) for t in batch_each) / (ran - 1))
            s["epoch"].append(1000 * sum(epoch_t) / epochs)
            s["flush"].append(1000 * statistics.median(s["flushes"]))
            shutil.rmtree(s["dir"], ignore_errors=True)
    shutil.rmtree(workdir, ignore_errors=True)
    return state


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "cnn"), default="tiny")
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="steps per set and round")
    args = parser.parse_args(argv)
    sets = args.sets.split(",")
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise SystemExit(f"--sets: unknown {unknown}; accepted: {', '.join(SETS)}")
    print(f"machine: {_machine()}")
    state = run(args.model, sets, args.rounds, args.steps)
    print(f"model {args.model}, {args.rounds} rounds of {args.steps} steps per set; "
          "median [min-max] over rounds, ms")
    print(f"{'set':<13} {'batch hooks/step':>24} {'first batch/fit':>24} "
          f"{'epoch hooks/epoch':>24} {'flush/step':>24} {'fit/step':>24}")
    for name in sets:
        s = state[name]
        print(f"{name:<13} {_spread(s['batch']):>24} {_spread(s['first']):>24} "
              f"{_spread(s['epoch']):>24} {_spread(s['flush']):>24} {_spread(s['fit']):>24}")
    if "none" in state and "backup" in state:
        journal = [b - n for b, n in zip(state["backup"]["flush"], state["none"]["flush"])]
        step = statistics.median(state["none"]["fit"])
        print(f"journal: {statistics.median(journal):.4f} ms per step "
              f"[{min(journal):.4f}-{max(journal):.4f}], "
              f"{100 * statistics.median(journal) / step:.2f}% of the {step:.3f} ms step "
              "(fit per step without callbacks)")


if __name__ == "__main__":
    main()
