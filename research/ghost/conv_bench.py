"""CPU time of unfolding the reference CNN's convolution inputs into patches (the ghost conv rule's
main cost), by method, and of the layer's forward convolution for scale.

    python -m research.ghost.conv_bench

Measured on a 2-core CPU without GPU (TF 2.21, Keras 3.15; CPU ms, medians): conv1 (8x8 s2
same, C=1) one-hot conv 5.5-6, gather 5.8, space-to-depth + one-hot depthwise 4.5, forward conv 2;
conv2 (4x4 s2 valid, C=16) one-hot conv 10, gather of pixel rows [H*W, B*C] then transpose 3 (the
transpose of the patches to batch-major is the expensive part), gather along the pixel axis of
[B, H*W, C] 1.5, forward conv 1.5. ``tf.image.extract_patches``, which this script does not time,
took 36-47 ms in a separate measurement on the same machine. A gather along the pixel axis is slow
for C = 1 (15 ms: single-float slices). The rule uses the pixel-axis gather for C >= 8, the
one-hot convolution below. ``compare_two_stage()``: rows by a one-hot conv then columns by a
one-hot depthwise conv, 4.8 vs 5.2 ms on conv1 -- too small a gain to use.
``compare_width_then_gather()``: width windows by a 1 x kw one-hot conv, then a gather of
kw*C-float slices: 5-9 vs 5.4-8 ms on conv1, 2.8 vs 1.5 ms on conv2 -- no gain.
"""
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_dp.gradients.ghost.conv import _same_pads, _unfold, _unfold_gather  # noqa: E402

B = 256
CASES = {
    # name: (x shape, kernel, stride, padding, filters)
    "conv1": ((B, 28, 28, 1), 8, 2, "SAME", 16),
    "conv2": ((B, 13, 13, 16), 4, 2, "VALID", 32),
}


def onehot(x, k, s, padding):
    kk = k * k * x.shape[-1]
    eye = tf.reshape(tf.eye(kk), [k, k, x.shape[-1], kk])
    return tf.nn.conv2d(x, eye, s, padding)


def s2d_depthwise(x, k, s, padding):
    """Patches in (s, s, C, k/s, k/s) order; s must divide k."""
    h = x.shape[1]
    if padding == "SAME":
        lo, hi = _same_pads(h, k, s, 1)
        x = tf.pad(x, [[0, 0], [lo, hi], [lo, hi], [0, 0]])
    hp, c = x.shape[1], x.shape[-1]
    oh, kb = (hp - k) // s + 1, k // s
    hb = oh - 1 + kb
    x = x[:, : hb * s, : hb * s]
    x = tf.reshape(tf.transpose(tf.reshape(x, [B, hb, s, hb, s, c]), [0, 1, 3, 2, 4, 5]),
                   [B, hb, hb, s * s * c])
    eye = tf.tile(tf.reshape(tf.eye(kb * kb), [kb, kb, 1, kb * kb]), [1, 1, s * s * c, 1])
    return tf.nn.depthwise_conv2d(x, eye, [1, 1, 1, 1], "VALID")


def cpu_ms(fn, n=30):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t = time.process_time()
        tf.nest.map_structure(lambda t: t.numpy(), fn())
        ts.append(time.process_time() - t)
    return 1000 * statistics.median(ts)


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    for name, (shape, k, s, padding, d) in CASES.items():
        x = tf.constant(rng.standard_normal(shape), tf.float32)
        w = tf.constant(rng.standard_normal((k, k, shape[-1], d)), tf.float32)
        fns = {
            "forward conv": tf.function(lambda: tf.nn.conv2d(x, w, s, padding)),
            "one-hot conv": tf.function(lambda: onehot(x, k, s, padding)),
            "rule": tf.function(lambda: _unfold(x, [k, k], [s, s], [1, 1], padding)),
            "gather": tf.function(lambda: _unfold_gather(x, [k, k], [s, s], [1, 1], padding)),
            "s2d depthwise": tf.function(lambda: s2d_depthwise(x, k, s, padding)),
        }
        ref = fns["one-hot conv"]()
        assert float(tf.reduce_max(tf.abs(fns["gather"]() - ref))) == 0.0
        sq = tf.reduce_sum(ref**2, -1)
        assert float(tf.reduce_max(tf.abs(tf.reduce_sum(fns["s2d depthwise"]() ** 2, -1) - sq))) < 1e-3
        for _ in range(2):
            print(name, "  ".join(f"{m} {cpu_ms(f):6.2f}" for m, f in fns.items()), "(CPU ms)")


def two_stage(x, k, s, padding):
    """Rows by a one-hot conv [k, 1, C, k C] (stride (s, 1)), then columns by a one-hot depthwise
    conv [1, k, k C, k] (stride (1, s)): channel order (kh, C, kw); (kh, kw) for C = 1."""
    c = x.shape[-1]
    if padding == "SAME":
        lo, hi = _same_pads(x.shape[1], k, s, 1)
        x = tf.pad(x, [[0, 0], [lo, hi], [lo, hi], [0, 0]])
    e1 = tf.reshape(tf.eye(k * c), [k, 1, c, k * c])
    rows = tf.nn.conv2d(x, e1, [1, s, 1, 1], "VALID")
    e2 = tf.tile(tf.reshape(tf.eye(k), [1, k, 1, k]), [1, 1, k * c, 1])
    return tf.nn.depthwise_conv2d(rows, e2, [1, 1, s, 1], "VALID")


def compare_two_stage():
    x = tf.constant(np.random.default_rng(1).standard_normal((B, 28, 28, 1)), tf.float32)
    f1 = tf.function(lambda: _unfold(x, [8, 8], [2, 2], [1, 1], "SAME"))
    f2 = tf.function(lambda: two_stage(x, 8, 2, "SAME"))
    assert float(tf.reduce_max(tf.abs(f1() - f2()))) == 0.0
    for _ in range(3):
        print(f"conv1 unfold: rule {cpu_ms(f1):.2f}  two-stage {cpu_ms(f2):.2f}")


def width_then_gather(x, ks, st, padding):
    """Width windows by a one-hot conv [1, kw, C, kw C] (stride (1, sw)), then a gather of
    (row, column) slices of kw*C floats; standard (kh, kw, C) order."""
    (kh, kw), (sh, sw), c = ks, st, x.shape[-1]
    if padding == "SAME":
        pt, pb = _same_pads(x.shape[1], kh, sh, 1)
        pl, pr = _same_pads(x.shape[2], kw, sw, 1)
        x = tf.pad(x, [[0, 0], [pt, pb], [pl, pr], [0, 0]])
    hp, wp = x.shape[1], x.shape[2]
    oh, ow = (hp - kh) // sh + 1, (wp - kw) // sw + 1
    e = tf.reshape(tf.eye(kw * c), [1, kw, c, kw * c])
    xw = tf.nn.conv2d(x, e, [1, 1, sw, 1], "VALID")  # [B, hp, ow, kw*c]
    p, q, i = np.meshgrid(np.arange(oh), np.arange(ow), np.arange(kh), indexing="ij")
    idx = ((sh * p + i) * ow + q).reshape(-1).astype(np.int32)
    rows = tf.reshape(xw, [-1, hp * ow, kw * c])
    return tf.reshape(tf.gather(rows, idx, axis=1), [-1, oh, ow, kh * kw * c])


def compare_width_then_gather():
    for shape, k, s, pad in (((B, 28, 28, 1), 8, 2, "SAME"), ((B, 13, 13, 16), 4, 2, "VALID")):
        x = tf.constant(np.random.default_rng(1).standard_normal(shape), tf.float32)
        f1 = tf.function(lambda: _unfold(x, [k, k], [s, s], [1, 1], pad))
        f2 = tf.function(lambda: width_then_gather(x, [k, k], [s, s], pad))
        assert float(tf.reduce_max(tf.abs(f1() - f2()))) == 0.0
        for _ in range(3):
            print(f"C={shape[-1]} unfold: rule {cpu_ms(f1):.2f}  width+gather {cpu_ms(f2):.2f}")
