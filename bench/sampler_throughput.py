"""Poisson sampling from files on disk: batches per second against the reference CNN's DP step.

Usage::

    python -m bench.sampler_throughput --records 10000000 --q 1e-3 --formats tfrecord,arrayrecord \
        --rounds 3 --batches 10

User-level sampling alone (no files, no model)::

    python -m bench.sampler_throughput --users 1000000,10000000 --q 1e-4,1e-3 --batches 20

``--users`` switches to this case: for each number of users ``U`` (2 records each, an in-memory
``ArraySource`` of 4-byte records, ``max_records_per_user=2``) and each rate ``q``, the
time to pull one batch from ``tf_dp.data.poisson_sample`` and from ``tf_dp.data.poisson_batches``
(3 batches drawn untimed first), as the total time of ``--batches`` pulls in a row divided by
their number (the samplers prefetch 2 batches in the background, so this is their throughput): the
per-step cost of drawing the users and their records, which is what grows (or not) with ``U``. Reported with the time to build the sampler
(grouping the records by user, once).

Builds (once; reused when present) ``--records`` small records in ``--dir`` (default
``/tmp/tf_dp_sampler_bench``): 4 TFRecord files (``tf.io.TFRecordWriter``) and 4 ArrayRecord
files (``group_size:1``). A record is 16 raw bytes: its index (int64) and a label (int64). The
parse function decodes a batch with ``np.frombuffer``: ``x`` = the index as a float32 feature,
``y`` = the label.

In one process, interleaved in ``--rounds`` rounds (so that load from other processes hits
every measurement alike):

- the sampler: ``tf_dp.data.poisson_sample`` at rate ``q`` over each format's files (3 batches
  drawn untimed first); the time to pull each of ``--batches`` batches per round, i.e. the rate
  at which ``fit`` could take them (each holds about ``q n`` records). Reported: the median, as
  batches/s and records/s;
- the reference CNN (``bench/models.py``, batch 256) made private (``--mode``, default ``ghost``),
  warmed up through ``fit``: the time of each of ``--batches`` compiled DP train steps per round
  (as ``bench/step_time.py`` times them). It consumes ``256 / median step`` records per second.
  Ratio: records delivered / records consumed per second (at batch ``q n`` the CNN would take
  ``q n / 256`` times as long per step, steps assumed linear in the batch);
- memory (a fresh subprocess, without the model; tf.data's generator machinery warmed up on a
  10-record array first): RSS growth from before the source is opened to
  just after (the index, wherever the format keeps it: ``TFRecordSource.index_bytes``, or inside
  ArrayRecord's readers) and to the peak of sampling (VmHWM), against the index plus 10 delivered
  batches (padded ``x``, ``y``, weights and the records' ``bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

FILES = 4
RECORD_BYTES = 16


def parse(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """16-byte records (int64 index, int64 label) -> (x float32 [k, 1], y int64 [k])."""
    raw = np.frombuffer(b"".join(records), dtype=np.int64).reshape(-1, 2)
    return raw[:, :1].astype(np.float32), raw[:, 1].copy()


def _record_chunks(n: int, files: int, chunk: int = 1_000_000):
    for f, rows in enumerate(np.array_split(np.arange(n, dtype=np.int64), files)):
        yield f, [rows[i : i + chunk] for i in range(0, len(rows), chunk)]


def build_files(directory: str, n: int, fmt: str) -> list[str]:
    """The ``fmt`` files of ``n`` records in ``directory`` (written once, then reused)."""
    os.makedirs(directory, exist_ok=True)
    ext = {"tfrecord": "tfrecord", "arrayrecord": "array_record"}[fmt]
    paths = [os.path.join(directory, f"n{n}-{f}.{ext}") for f in range(FILES)]
    done = os.path.join(directory, f"n{n}.{ext}.done")
    if os.path.exists(done):
        return paths
    t0 = time.perf_counter()
    for f, chunks in _record_chunks(n, FILES):
        if fmt == "tfrecord":
            writer = tf.io.TFRecordWriter(paths[f])
        else:
            from array_record.python.array_record_module import ArrayRecordWriter

            writer = ArrayRecordWriter(paths[f], "group_size:1")
        for rows in chunks:
            blob = np.stack([rows, rows % 10], axis=1).tobytes()
            for i in range(len(rows)):
                writer.write(blob[i * RECORD_BYTES : (i + 1) * RECORD_BYTES])
        writer.close()
    open(done, "w").close()
    print(f"wrote {n} {fmt} records in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return paths


def open_source(fmt: str, paths: list[str]) -> Any:
    import tf_dp.data as data

    cls = data.TFRecordSource if fmt == "tfrecord" else data.ArrayRecordSource
    return cls(paths, parse_fn=parse)


def sampler_iterator(source: Any, q: float, batches: int) -> tuple[Any, int]:
    """An iterator over ``batches`` Poisson batches of ``source`` (3 drawn untimed first)."""
    from tf_dp.data import poisson_sample

    pb = poisson_sample(source, sampling_probability=q, steps_per_epoch=batches + 3, seed=0)
    it = iter(pb.dataset)
    for _ in range(3):
        next(it)
    return it, pb.max_batch_size


def time_batches(it: Any, count: int) -> tuple[list[float], int]:
    """Seconds to pull each of ``count`` batches from ``it``, and the real records pulled."""
    times, rows = [], 0
    for _ in range(count):
        t0 = time.perf_counter()
        _, _, w = next(it)
        rows += int(np.count_nonzero(w.numpy()))
        times.append(time.perf_counter() - t0)
    return times, rows


def cnn_model(mode: str) -> tuple[Any, Any]:
    """The reference CNN made private (batch 256, warmed up) and an iterator over its batch."""
    from bench import step_time

    ds = step_time.dataset("cnn", 256)
    model = step_time.build("cnn", mode, 256)
    step_time.warm_up(model, ds, 5)
    return model, iter(ds)


def time_cnn_steps(model: Any, it: Any, count: int) -> list[float]:
    from bench import step_time

    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        step_time._sync(model.train_function(it))
        times.append(time.perf_counter() - t0)
    return times


def probe_memory(fmt: str, paths: list[str], q: float, batches: int) -> dict[str, float]:
    """Peak RSS growth (MB) of opening and sampling, and the index + 10 batches it is held to."""
    from bench.step_time import _hwm_mb, _reset_hwm, _rss_mb
    from tf_dp.data import ArraySource, poisson_sample

    # tf.data's and the sampler's fixed machinery (a generator dataset, its thread), warmed up on a
    # 10-record array before the baseline: what is measured is what grows with the source.
    tiny = ArraySource(np.zeros((10, 1), np.float32), np.zeros(10, np.int64))
    list(poisson_sample(tiny, 0.5, steps_per_epoch=3, seed=0).dataset.as_numpy_iterator())
    base = _rss_mb()
    _reset_hwm()
    source = open_source(fmt, paths)
    opened = _rss_mb() - base  # the index, wherever the format keeps it
    pb = poisson_sample(source, sampling_probability=q, steps_per_epoch=batches, seed=1)
    batch_bytes = 0
    for bx, by, bw in pb.dataset.as_numpy_iterator():
        raw = bw.shape[0] * (RECORD_BYTES + sys.getsizeof(b"") + 8)  # bytes objects + pointers
        batch_bytes = max(batch_bytes, bx.nbytes + by.nbytes + bw.nbytes + raw)
    peak = _hwm_mb() - base
    index = getattr(source, "index_bytes", 0) / 2**20
    return {"peak_growth_mb": peak, "open_growth_mb": opened, "index_mb": index,
            "batch_mb": batch_bytes / 2**20, "bound_mb": index + 10 * batch_bytes / 2**20}


def memory_subprocess(fmt: str, n: int, directory: str, q: float, batches: int) -> Optional[dict]:
    cmd = [sys.executable, "-m", "bench.sampler_throughput", "--_probe_memory", fmt,
           "--records", str(n), "--dir", directory, "--q", str(q), "--batches", str(batches)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("MEMORY "):
            return json.loads(line[len("MEMORY "):])
    sys.stderr.write(f"memory probe for {fmt} failed:\n{proc.stderr[-2000:]}\n")
    return None


def bench_users(n_users: int, q: float, batches: int) -> dict[str, float]:
    """Mean ms per user-level batch of ``poisson_sample`` and ``poisson_batches`` (throughput)."""
    from tf_dp.data import ArraySource, poisson_batches, poisson_sample

    ids = np.repeat(np.arange(n_users, dtype=np.int64), 2)
    x = np.zeros((len(ids), 1), np.float32)
    y = np.zeros(len(ids), np.int32)
    out = {}
    for name in ("source", "arrays"):
        args = dict(sampling_probability=q, steps_per_epoch=batches + 3, seed=0, user_ids=ids,
                    max_records_per_user=2)
        t0 = time.perf_counter()
        if name == "source":
            pb = poisson_sample(ArraySource(x, y), **args)
        else:
            pb = poisson_batches(x, y, **args)
        it = iter(pb.dataset)
        for _ in range(3):
            next(it)
        out[f"{name}_build_s"] = time.perf_counter() - t0
        times, _ = time_batches(it, batches)
        out[f"{name}_ms"] = 1e3 * sum(times) / len(times)
    return out


def main_users(users: list[int], qs: list[float], batches: int) -> None:
    print(f"user-level sampler, 2 records per user, k = 2; mean of {batches} batches in a row; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    print("| users | q | mean users / batch | poisson_sample ms / batch | poisson_batches ms / batch "
          "| build s (sample / batches) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n_users in users:
        for q in qs:
            r = bench_users(n_users, q, batches)
            print(f"| {n_users:.0e} | {q:g} | {n_users * q:.0f} | {r['source_ms']:.2f} | "
                  f"{r['arrays_ms']:.2f} | {r['source_build_s']:.1f} / {r['arrays_build_s']:.1f} |",
                  flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=10_000_000)
    p.add_argument("--q", default="1e-3", help="rate; with --users a comma-separated list")
    p.add_argument("--users", default=None,
                   help="comma-separated numbers of users: times the user-level sampler only")
    p.add_argument("--batches", type=int, default=10, help="batches (and CNN steps) per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--formats", default="tfrecord,arrayrecord")
    p.add_argument("--mode", default="ghost", help="gradient_mode of the reference CNN")
    p.add_argument("--dir", default="/tmp/tf_dp_sampler_bench")
    p.add_argument("--_probe_memory", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.users:
        main_users([int(float(u)) for u in args.users.split(",")],
                   [float(q) for q in args.q.split(",")], args.batches)
        return
    args.q = float(args.q)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if args._probe_memory:
        paths = build_files(args.dir, args.records, args._probe_memory)
        result = probe_memory(args._probe_memory, paths, args.q, args.batches)
        print("MEMORY " + json.dumps(result))
        return
    rows: dict[str, dict[str, Any]] = {}
    iterators = {}
    for fmt in formats:
        paths = build_files(args.dir, args.records, fmt)
        t0 = time.perf_counter()
        source = open_source(fmt, paths)
        rows[fmt] = {"open_s": time.perf_counter() - t0, "times": [], "rows": 0}
        iterators[fmt], _ = sampler_iterator(source, args.q, args.rounds * args.batches)
    model, cnn_it = cnn_model(args.mode)
    cnn_times: list[float] = []
    for _ in range(args.rounds):  # interleaved, so that load from elsewhere hits all alike
        for fmt in formats:
            times, count = time_batches(iterators[fmt], args.batches)
            rows[fmt]["times"] += times
            rows[fmt]["rows"] += count
        cnn_times += time_cnn_steps(model, cnn_it, args.batches)
    step = statistics.median(cnn_times)
    consumed = 256 / step
    for fmt, r in rows.items():
        r["batches_per_s"] = 1.0 / statistics.median(r["times"])
        r["mean_batch"] = r["rows"] / len(r["times"])
        r["records_per_s"] = r["batches_per_s"] * r["mean_batch"]
        r["memory"] = memory_subprocess(fmt, args.records, args.dir, args.q, args.batches)
    print(f"n = {args.records}, q = {args.q:g}; reference CNN DP step ({args.mode}, batch 256): "
          f"median {step * 1e3:.1f} ms = {consumed:.0f} records/s")
    print("| format | open (index) s | batches/s | mean batch | records/s | x CNN consumption "
          "| RSS growth: open / peak MB | index + 10 batches MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    nan = float("nan")
    for fmt, r in rows.items():
        m = r["memory"] or {}
        bound = (f"{m.get('bound_mb', nan):.1f} ({m.get('index_mb', nan):.1f} + 10 x "
                 f"{m.get('batch_mb', nan):.2f})")
        print(f"| {fmt} | {r['open_s']:.1f} | {r['batches_per_s']:.1f} | {r['mean_batch']:.0f} | "
              f"{r['records_per_s']:.0f} | {r['records_per_s'] / consumed:.1f}x | "
              f"{m.get('open_growth_mb', nan):.1f} / {m.get('peak_growth_mb', nan):.1f} | "
              f"{bound} |")

if __name__ == "__main__":
    main()
