"""Per-op CPU time of one DP (or non-private) train step, from a TF profiler trace.

    python -m research.ghost.op_profile --model cnn --mode ghost [--by_type] [--jit_compile]

Runs the bench's compiled ``train_function`` under ``tf.profiler.experimental`` for a few steps
and sums the durations of the executor's op events by op name (summed over threads, so it is CPU
time, not wall time), with the number of op events per step (``--by_type``: by op type).
Under ``--jit_compile`` the compiled step is one event; ``--all_events`` adds every trace line,
where XLA's thunks appear by HLO instruction name (``MatMul.28``, ``broadcast_divide_fusion.4``).
Research only.
"""
import argparse
import collections
import glob
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: E402

from bench import step_time as st  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--mode", default="ghost")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--jit_compile", action="store_true", help="compile the step with XLA")
    ap.add_argument("--by_type", action="store_true",
                    help="sum by op type (the part after ':') instead of by op name")
    ap.add_argument("--all_events", action="store_true",
                    help="every trace line and event (host calls, XLA's HLO thunks by instruction "
                         "name); events nest, so the sum counts time more than once")
    a = ap.parse_args()
    st.configure(a.jit_compile, "none")
    ds = st.dataset(a.model, a.batch_size)
    model = st.build(a.model, a.mode, a.batch_size)
    st.warm_up(model, ds, 3)
    fn, it = model.train_function, iter(ds)
    logdir = tempfile.mkdtemp()
    tf.profiler.experimental.start(logdir)
    for _ in range(a.steps):
        st._sync(fn(it))
    tf.profiler.experimental.stop()
    path = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    totals = collections.Counter()
    counts = collections.Counter()
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            if not a.all_events and "tf_Compute" not in line.name and \
                    "tf_inter" not in line.name.lower() and "Eigen" not in line.name and \
                    "tf_" not in line.name:
                continue
            for ev in line.events:
                name = names.get(ev.metadata_id, "?")
                if a.all_events or (":" in name and not name.startswith("__inference")):
                    key = name.rsplit(":", 1)[-1] if a.by_type else name
                    totals[key] += ev.duration_ps / 1e9 / a.steps
                    counts[name.rsplit(":", 1)[-1]] += 1 / a.steps
    total = sum(totals.values())
    print(f"{a.model} {a.mode}: op events {total:.2f} ms per step (summed over threads), "
          f"{sum(counts.values()):.0f} op events per step")
    if a.by_type:
        print("events per step by type:", ", ".join(f"{k} {v:.0f}" for k, v in counts.most_common(30)))
    for name, ms in totals.most_common(a.top):
        print(f"{ms:8.3f}  {name[:110]}")


if __name__ == "__main__":
    main()
