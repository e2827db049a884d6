"""Steady-state peak memory of a training step (tracing excluded), one fresh process per mode.

``bench.step_time`` reports the peak RSS increase of the first steps *including* tracing and
compilation, which for small models is mostly graph construction (and, for JL, the XLA
compilation of the fused MaxPool forward rule). This probe warms a mode up first, then reports,
over 5 more steps, the peak RSS increase and the peak of TensorFlow's CPU allocator above its
resting level (``tf.config.experimental.get_memory_info``): the tensors the step itself needs
(activations, per-example work, directions, tangents).

    python -m research.jl_2020.steady_memory --model cnn --modes nonprivate,jl:1

``--allocator``: ``onednn`` (default) measures TensorFlow's default x86 CPU set-up, whose
oneDNN allocator reports only its large allocations (smaller ones go to a separate small-size
allocator that ``get_memory_info`` does not see). ``bfc`` runs each probe with oneDNN's ops off
(``TF_ENABLE_ONEDNN_OPTS=0``) and TensorFlow's BFC allocator for the CPU
(``TF_CPU_ALLOCATOR_USE_BFC=true``), which counts every tensor: use it to compare steps whose
tensors differ in size (Keras's recurrent loops keep many tensors of 64-512 KB).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys

from bench import step_time
from bench.models import DEFAULT_BATCH


def probe(model_name: str, batch: int, mode: str) -> tuple[float, float]:
    """(peak RSS increase MB, peak TF-allocator bytes above the resting level, MB) over 5 steps."""
    import tensorflow as tf

    ds = step_time.dataset(model_name, batch)
    model = step_time.build(model_name, mode, batch)
    step_time.warm_up(model, ds, 3)
    fn, it = model.train_function, iter(ds)
    step_time._sync(fn(it))
    gc.collect()
    base = step_time._rss_mb()
    step_time._reset_hwm()
    tf.config.experimental.reset_memory_stats("CPU:0")
    resting = tf.config.experimental.get_memory_info("CPU:0")["current"]
    with step_time._PeakSampler() as sampler:
        for _ in range(5):
            step_time._sync(fn(it))
    tensors = (tf.config.experimental.get_memory_info("CPU:0")["peak"] - resting) / 2**20
    return max(max(sampler.peak, step_time._hwm_mb()) - base, 0.0), tensors


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="cnn")
    p.add_argument("--batch_size", type=int, default=None)
    p.add_argument("--modes", default="nonprivate,jl:1")
    p.add_argument("--allocator", choices=("onednn", "bfc"), default="onednn",
                   help="bfc: count every tensor (oneDNN ops off, BFC CPU allocator)")
    p.add_argument("--_one", default=None)
    a = p.parse_args()
    batch = a.batch_size or DEFAULT_BATCH[a.model]
    env = dict(os.environ)
    if a.allocator == "bfc":
        env.update(TF_ENABLE_ONEDNN_OPTS="0", TF_CPU_ALLOCATOR_USE_BFC="true")
    if a._one:
        print("STEADY_MB", *probe(a.model, batch, a._one))
        return
    out = {}
    for mode in a.modes.split(","):
        res = subprocess.run(
            [sys.executable, "-m", "research.jl_2020.steady_memory", "--model", a.model,
             "--batch_size", str(batch), "--_one", mode], capture_output=True, text=True, env=env)
        vals = [l.split()[1:] for l in res.stdout.splitlines() if l.startswith("STEADY_MB")]
        out[mode] = (
            {"rss_increase_mb": round(float(vals[0][0]), 1), "tensor_peak_mb": round(float(vals[0][1]), 1)}
            if vals else None
        )
    print(json.dumps({"model": a.model, "batch_size": batch, "allocator": a.allocator,
                      "steady": out}))


if __name__ == "__main__":
    main()
