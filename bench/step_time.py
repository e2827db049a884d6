"""Step time and peak memory of DP gradient modes vs non-private training, side by side.

Usage::

    python -m bench.step_time --model cnn --batch_size 256 \
        --modes nonprivate,vectorized,microbatch --format text
    python -m bench.step_time --model lstm --batch_size 64 --modes nonprivate,vectorized,jl:1 \
        --format json

Modes: ``nonprivate`` (the plain Keras model and optimizer), or any registered ``gradient_mode``
(``tf_dp.gradients.gradient_modes()``: ``vectorized``, ``microbatch``, ``auto``, and ``ghost`` /
``jl`` once registered). A mode may carry an integer option after a colon: ``jl:R`` (``R`` JL
projections) and ``microbatch:M`` (``M`` microbatches; plain ``microbatch`` uses
``M = batch_size``); ``auto:P``, ``vectorized:P`` and ``ghost:P`` clip each batch in physical
batches of at most ``P`` examples (``max_physical_batch_size=P``). Microbatches are random
groups: each example goes to one of the ``M`` microbatches independently and uniformly at
random, so with ``M = batch_size`` some hold several examples and some are empty (sensitivity
``2C``, not the clipped sum of ``vectorized``). A DP mode followed by ``+journal`` (or
``+journal_fsync``) also journals its ledger to a file in a temporary directory
(``PrivacyLedger.attach_journal``, ``fsync=False``/``True``): one append per step, timed with it.
A DP mode followed by ``+usersK`` (e.g. ``ghost+users4``) clips at the user level: the same
batch is read as ``batch_size / K`` user slots of ``K`` records (``K`` must divide the batch
size), each slot's summed gradient clipped to ``C`` (``tf_dp.gradients.per_user``), with a
user-level sampling declared (``tf_dp.data.Sampling(unit="user", records_per_unit=K)``).

Timing (all modes in ONE process, see ``bench/README.md``): each mode gets its own fresh model
(same weights), compiled and warmed up through ``model.fit`` (the real Keras 3 path, traced
``tf.function`` train step). Then the timed steps call the model's compiled ``train_function`` --
the function ``fit`` calls once per step -- on an iterator over the same batch, waiting for the
step's result each time. Modes are interleaved in rounds (a few steps of each mode per round) so
that load from other processes on the machine hits every mode alike. Reported: the median step
time, its ratio to ``nonprivate``'s median, and the peak memory (measured in a fresh subprocess
per mode unless ``--memory none``/``inprocess``); beside them the 10th-90th percentile of the
step times, ``nonprivate``'s absolute median, the spread of the per-round ratios (each round's
median over ``nonprivate``'s median in that round) and a line naming the CPU model, its flags,
the load average and the TensorFlow build. ``--compare`` interleaves the modes every 2 steps
(more, shorter rounds) for comparing modes on a loaded machine::

    python -m bench.step_time --model mlp --modes nonprivate,auto --memory none --compare
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from bench.models import MODELS, build_model, make_batch  # noqa: E402

NOISE_MULTIPLIER = 1.1
L2_NORM_CLIP = 1.0
LEARNING_RATE = 0.05

#: Set from the command line: ``jit_compile`` for every model, and the ``tf.distribute`` strategy
#: (``None``, or a MirroredStrategy over two logical CPU devices) models are built under.
SETTINGS: dict[str, Any] = {"jit_compile": False, "strategy": None}


def _scope():
    strategy = SETTINGS["strategy"]
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def configure(jit_compile: bool, strategy: str) -> None:
    """Applies ``--jit_compile`` and ``--strategy`` (call before any TensorFlow op runs)."""
    SETTINGS["jit_compile"] = bool(jit_compile)
    if strategy == "mirrored":
        cpus = tf.config.list_physical_devices("CPU")
        gpus = tf.config.list_physical_devices("GPU")
        if len(gpus) >= 2:
            SETTINGS["strategy"] = tf.distribute.MirroredStrategy()
        else:  # split the CPU into two logical devices
            tf.config.set_logical_device_configuration(
                cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
            )
            SETTINGS["strategy"] = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def parse_mode(mode: str) -> tuple[str, Optional[int]]:
    """``"jl:1"`` -> ``("jl", 1)``; ``"vectorized"`` -> ``("vectorized", None)``."""
    if ":" in mode:
        name, opt = mode.split(":", 1)
        try:
            value = int(opt)
        except ValueError:
            raise SystemExit(f"mode {mode!r}: the option after ':' must be an integer") from None
        return name, value
    return mode, None


def _loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build(model_name: str, mode: str, batch_size: int, seed: int = 0) -> keras.Model:
    """A compiled model for ``mode`` (fresh weights from ``seed``)."""
    with _scope():
        return _build(model_name, mode, batch_size, seed)


def split_suffixes(mode: str) -> tuple[str, Optional[str], Optional[str]]:
    """``"ghost+grid+journal"`` -> ``("ghost", "grid", "journal")``: the mode, its noise mode
    (``continuous`` or ``grid``) and its journal (``journal`` or ``journal_fsync``), each
    optional and in any order."""
    base, *suffixes = mode.split("+")
    noise_mode = journal = None
    for suffix in suffixes:
        if suffix in ("continuous", "grid") and noise_mode is None:
            noise_mode = suffix
        elif suffix in ("journal", "journal_fsync") and journal is None:
            journal = suffix
        else:
            raise SystemExit(
                f"mode {mode!r}: a suffix after '+' must be continuous or grid (noise mode) "
                "and/or journal or journal_fsync, each at most once"
            )
    return base, noise_mode, journal


def user_suffix(mode: str) -> tuple[str, Optional[int]]:
    """``"ghost+users4"`` -> ``("ghost", 4)``; a mode without ``+usersK`` -> ``(mode, None)``."""
    parts = mode.split("+")
    users = [p for p in parts if p.startswith("users")]
    if not users:
        return mode, None
    k = users[0][len("users"):]
    if len(users) > 1 or not k.isdigit() or int(k) < 1:
        raise SystemExit(f"mode {mode!r}: '+usersK' takes K, an integer >= 1, once")
    return "+".join(p for p in parts if not p.startswith("users")), int(k)


def _build(model_name: str, mode: str, batch_size: int, seed: int) -> keras.Model:
    model = build_model(model_name, seed=seed)
    mode, users = user_suffix(mode)
    mode, noise_mode, journal = split_suffixes(mode)
    name, option = parse_mode(mode)
    jit = SETTINGS["jit_compile"]
    if name == "nonprivate":
        if journal is not None:
            raise SystemExit("a non-private model has no ledger to journal")
        model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=_loss(), jit_compile=jit)
        return model
    import tf_dp.keras as dpk
    from tf_dp.gradients import gradient_modes

    if name not in gradient_modes():
        raise SystemExit(f"unknown mode {name!r}; registered: nonprivate, {gradient_modes()}")
    kwargs: dict[str, Any] = {"gradient_mode": name}
    if name == "microbatch":
        kwargs["num_microbatches"] = option or batch_size
    elif name == "jl":
        kwargs["jl_projections"] = option or 1
    elif option is not None:  # auto:P, vectorized:P, ghost:P
        kwargs["max_physical_batch_size"] = option
    if noise_mode:
        kwargs["noise_mode"] = noise_mode
    optimizer = dpk.DPKerasSGDOptimizer(
        l2_norm_clip=L2_NORM_CLIP,
        noise_multiplier=NOISE_MULTIPLIER,
        learning_rate=LEARNING_RATE,
        **kwargs,
    )
    model = dpk.make_private(model)
    model.compile(optimizer=optimizer, loss=_loss(), jit_compile=jit)
    # The dataset below repeats one batch: declare the sampling a 60000-example shuffled epoch
    # would have (it only affects the ledger, not the time).
    if users is None:
        optimizer.set_sampling(60000, batch_size / 60000, "shuffle")
    else:  # 60000 records of 60000 / K users; batch_size / K user slots of K rows
        if batch_size % users:
            raise SystemExit(f"+users{users}: {users} must divide the batch size {batch_size}")
        from tf_dp.data import Sampling

        n_users = 60000 // users
        optimizer.set_sampling(Sampling(n_users, batch_size / users / n_users, "poisson",
                                        unit="user", records_per_unit=users))
    if journal is not None:  # the ledger journal, appended after every compiled call
        import tempfile

        path = os.path.join(tempfile.mkdtemp(prefix="tf_dp_bench_"), "privacy_journal.jsonl")
        optimizer.ledger.attach_journal(path, fsync=journal == "journal_fsync")
    return model


def dataset(model_name: str, batch_size: int) -> tf.data.Dataset:
    x, y = make_batch(model_name, batch_size)
    return tf.data.Dataset.from_tensors((x, y)).repeat()


def _sync(logs: Any) -> None:
    for v in tf.nest.flatten(logs):
        if hasattr(v, "numpy"):
            v.numpy()


def warm_up(model: keras.Model, ds: tf.data.Dataset, steps: int) -> None:
    # shuffle=False: the dataset repeats one batch (Keras would warn that it ignores shuffle).
    model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False)


def _time_flushes(ledger: Any, into: list[float]) -> None:
    """Times every ledger flush (the train function runs one after each step, through
    ``flush_known``; with a journal attached it also appends the step to the journal) into
    ``into`` (seconds)."""
    flush = ledger.flush_known

    def timed_flush(known: Any) -> None:
        t0 = time.perf_counter()
        flush(known)
        into.append(time.perf_counter() - t0)

    ledger.flush_known = timed_flush


def time_modes(
    model_name: str,
    batch_size: int,
    modes: list[str],
    warmup: int,
    steps: int,
    rounds: int,
    flush_times: Optional[dict[str, list[float]]] = None,
) -> dict[str, list[float]]:
    """Step times (seconds) per mode, interleaved in ``rounds`` rounds of ``steps`` steps.

    ``flush_times``, if given, receives for each DP mode the time of each ledger flush (the
    journal's append included) during the timed rounds."""
    ds = dataset(model_name, batch_size)
    models, iterators = {}, {}
    for mode in modes:
        model = build(model_name, mode, batch_size)
        warm_up(model, ds, warmup)
        ledger = getattr(model.optimizer, "ledger", None)
        if flush_times is not None and ledger is not None:
            flush_times[mode] = []
            _time_flushes(ledger, flush_times[mode])
        models[mode] = model
        strategy = SETTINGS["strategy"]
        iterators[mode] = iter(
            ds if strategy is None else strategy.experimental_distribute_dataset(ds)
        )
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode in modes:
            fn, it = models[mode].train_function, iterators[mode]
            _sync(fn(it))  # one untimed step after switching modes
            for _ in range(steps):
                t0 = time.perf_counter()
                _sync(fn(it))
                times[mode].append(time.perf_counter() - t0)
    return times


# -- machine ---------------------------------------------------------------------------------------

#: CPU flags that decide how fast TensorFlow's kernels are (oneDNN picks its code by them).
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile",
             "amx_bf16", "amx_int8")


def machine() -> dict[str, Any]:
    """The CPU model, its count and speed-relevant flags, the load average and the TensorFlow
    build: what a step time depends on besides the code (``/proc/cpuinfo``; ``"unknown"``
    elsewhere)."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default (on for x86)")
    return {
        "cpu": model,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "flags": [f for f in KEY_FLAGS if f in flags],
        "load_average": load,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "onednn": onednn,
    }


def spread(values: list[float]) -> dict[str, float]:
    """Median, 10th and 90th percentiles and extremes of ``values`` (nearest-rank)."""
    v = sorted(values)

    def pct(p: float) -> float:
        return v[min(len(v) - 1, max(0, int(round(p * (len(v) - 1)))))]

    return {"median": statistics.median(v), "p10": pct(0.1), "p90": pct(0.9), "min": v[0],
            "max": v[-1]}


def paired_ratios(times: dict[str, list[float]], steps: int) -> dict[str, list[float]]:
    """Per round, each mode's median step over ``nonprivate``'s median step of the same round:
    the ratios of steps run minutes apart do not mix the machine's load of different moments."""
    base = times["nonprivate"]
    rounds = len(base) // steps
    out: dict[str, list[float]] = {}
    for mode, t in times.items():
        out[mode] = [
            statistics.median(t[r * steps:(r + 1) * steps])
            / statistics.median(base[r * steps:(r + 1) * steps])
            for r in range(rounds)
        ]
    return out


# -- memory ----------------------------------------------------------------------------------------


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class _PeakSampler:
    """Samples the RSS every few milliseconds in a thread; ``peak`` is the largest seen."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.peak = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_mb())
            time.sleep(self.interval)

    def __enter__(self) -> "_PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def _reset_hwm() -> bool:
    """Resets the kernel's peak-RSS counter (VmHWM) of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def probe_memory(model_name: str, batch_size: int, mode: str, steps: int = 3) -> float:
    """Peak RSS increase (MB) of the first ``steps`` training steps (tracing included) over
    the RSS of the process with the model, optimizer and data built. Run in a fresh process."""
    ds = dataset(model_name, batch_size)
    model = build(model_name, mode, batch_size)
    gc.collect()
    base = _rss_mb()
    exact = _reset_hwm()
    with _PeakSampler() as sampler:
        warm_up(model, ds, steps)
    peak = max(sampler.peak, _hwm_mb() if exact else 0.0)
    return max(peak - base, 0.0)


def memory_subprocess(model_name: str, batch_size: int, mode: str) -> Optional[float]:
    cmd = [
        sys.executable,
        "-m",
        "bench.step_time",
        "--model",
        model_name,
        "--batch_size",
        str(batch_size),
        "--_probe_memory",
        mode,
        "--strategy",
        "mirrored" if SETTINGS["strategy"] is not None else "none",
    ] + (["--jit_compile"] if SETTINGS["jit_compile"] else [])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("PEAK_MEM_MB "):
            return float(line.split()[1])
    sys.stderr.write(f"memory probe for {mode!r} failed:\n{proc.stderr[-2000:]}\n")
    return None


# -- main ------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "nonprivate" not in modes:
        modes = ["nonprivate"] + modes
    flushes: dict[str, list[float]] = {}
    times = time_modes(
        args.model, args.batch_size, modes, args.warmup, args.steps, args.rounds, flushes
    )
    medians = {m: statistics.median(t) * 1000.0 for m, t in times.items()}
    rounds = paired_ratios(times, args.steps)
    flush_ms = {m: statistics.median(t) * 1000.0 for m, t in flushes.items() if t}
    memory: dict[str, Optional[float]] = {}
    if args.memory == "subprocess":
        for mode in modes:
            memory[mode] = memory_subprocess(args.model, args.batch_size, mode)
    elif args.memory == "inprocess":
        ds = dataset(args.model, args.batch_size)
        for mode in modes:
            model = build(args.model, mode, args.batch_size)
            gc.collect()
            base = _rss_mb()
            with _PeakSampler() as s:
                warm_up(model, ds, 3)
            memory[mode] = max(s.peak - base, 0.0)
            del model
            gc.collect()
    result = {
        "model": args.model,
        "batch_size": args.batch_size,
        "jit_compile": SETTINGS["jit_compile"],
        "strategy": "mirrored" if SETTINGS["strategy"] is not None else "none",
        "steps_timed": args.steps * args.rounds,
        "memory_method": args.memory,
        "machine": machine(),
        "modes": {
            m: {
                "ms_per_step": round(medians[m], 3),
                "ms_p10_p90": [round(1000.0 * spread(times[m])[k], 3) for k in ("p10", "p90")],
                "nonprivate_ms": round(medians["nonprivate"], 3),
                "ratio": round(medians[m] / medians["nonprivate"], 3),
                "ratio_by_round": [round(r, 3) for r in rounds[m]],
                "ratio_round_spread": {k: round(v, 3) for k, v in spread(rounds[m]).items()},
                "peak_mem_mb": None if memory.get(m) is None else round(memory[m], 1),
                "flush_ms": None if m not in flush_ms else round(flush_ms[m], 4),
            }
            for m in modes
        },
    }
    return result


def format_text(result: dict[str, Any]) -> str:
    mach = result["machine"]
    lines = [
        f"model={result['model']} batch_size={result['batch_size']} "
        f"jit_compile={result['jit_compile']} strategy={result['strategy']} "
        f"(median of {result['steps_timed']} steps per mode, same process; "
        f"memory: {result['memory_method']})",
        f"cpu: {mach['cpu']} x{mach['cpus']} [{' '.join(mach['flags'])}] load "
        f"{mach['load_average']} TF {mach['tensorflow']} Keras {mach['keras']} "
        f"oneDNN {mach['onednn']}",
        f"{'mode':<22}{'ms/step':>9}{'p10-p90 ms':>14}{'ratio':>8}"
        f"{'round ratios p10-p90':>23}{'peak MB':>9}{'flush ms':>10}",
    ]
    for mode, r in result["modes"].items():
        mem = "-" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.0f}"
        flush = "-" if r.get("flush_ms") is None else f"{r['flush_ms']:.3f}"
        lo, hi = r["ms_p10_p90"]
        ms_range = f"{lo:.1f}-{hi:.1f}"
        rs = r["ratio_round_spread"]
        ratio_range = f"{rs['p10']:.2f}-{rs['p90']:.2f}x"
        lines.append(
            f"{mode:<22}{r['ms_per_step']:>9.2f}{ms_range:>14}{r['ratio']:>7.2f}x"
            f"{ratio_range:>23}{mem:>9}{flush:>10}"
        )
    np_ms = result["modes"]["nonprivate"]["ms_per_step"]
    lines.append(f"(ratio = median step / nonprivate's median step, {np_ms:.2f} ms; round ratios: "
                 "per round, median step / nonprivate's median step in that round)")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="cnn")
    p.add_argument("--batch_size", type=int, default=None, help="default: bench.models.DEFAULT_BATCH")
    p.add_argument("--modes", default="nonprivate,vectorized,microbatch")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--warmup", type=int, default=5, help="fit steps per mode before timing")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode per round")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds over the modes")
    p.add_argument(
        "--memory",
        choices=("subprocess", "inprocess", "none"),
        default="subprocess",
        help="peak memory: a fresh process per mode (default), in this process, or skip",
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="interleave the modes every 2 steps (rounds x steps / 2 rounds) and report each "
        "mode's spread of per-round ratios: for comparing modes on a loaded machine",
    )
    p.add_argument("--jit_compile", action="store_true", help="compile every model with XLA")
    p.add_argument(
        "--strategy",
        choices=("none", "mirrored"),
        default="none",
        help="mirrored: MirroredStrategy over 2 GPUs, or 2 logical CPU devices without GPUs",
    )
    p.add_argument("--_probe_memory", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    configure(args.jit_compile, args.strategy)
    if args.batch_size is None:
        from bench.models import DEFAULT_BATCH

        args.batch_size = DEFAULT_BATCH[args.model]
    if args.batch_size < 1:
        p.error("--batch_size must be >= 1")
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1")
    if args.compare:  # finer interleaving, same number of timed steps
        args.rounds, args.steps = max(3, args.rounds * args.steps // 2), 2
    if args._probe_memory:
        print(f"PEAK_MEM_MB {probe_memory(args.model, args.batch_size, args._probe_memory):.1f}")
        return
    result = run(args)
    print(json.dumps(result, indent=2) if args.format == "json" else format_text(result))


if __name__ == "__main__":
    main()
