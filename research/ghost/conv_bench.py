"""Per-example conv kernel gradients of the reference CNN's convolutions: unfolding + batched
matmul vs a depthwise convolution with the batch as channels (kernel gradient as a forward conv).

    python -m research.ghost.conv_bench
"""
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_dp.gradients.ghost.rules import _unfold, _unfold_s2d_depthwise, _unfold_s2d_slices  # noqa: E402,E501

B = 256
CASES = {
    # name: (x shape, kernel, stride, padding, filters)
    "conv1": ((B, 28, 28, 1), 8, 2, "SAME", 16),
    "conv2": ((B, 13, 13, 16), 4, 2, "VALID", 32),
}


def pad_same(x, k, s):
    h = x.shape[1]
    out = -(-h // s)
    total = max((out - 1) * s + k - h, 0)
    lo = total // 2
    return tf.pad(x, [[0, 0], [lo, total - lo], [lo, total - lo], [0, 0]])


def unfold_grads(x, g, k, s, padding):
    p = _unfold(x, [k, k], [s, s], [1, 1], padding)
    a = tf.reshape(p, [B, -1, p.shape[-1]])
    gg = tf.reshape(g, [B, -1, g.shape[-1]])
    return tf.matmul(a, gg, transpose_a=True)  # [B, k*k*C, D]


def unfold_slices(x, k, s, padding):
    if padding == "SAME":
        x = pad_same(x, k, s)
    oh = (x.shape[1] - k) // s + 1
    ow = (x.shape[2] - k) // s + 1
    cols = [x[:, i : i + s * (oh - 1) + 1 : s, j : j + s * (ow - 1) + 1 : s, :]
            for i in range(k) for j in range(k)]
    return tf.concat(cols, axis=-1)


def slices_grads(x, g, k, s, padding):
    p = unfold_slices(x, k, s, padding)
    a = tf.reshape(p, [B, -1, p.shape[-1]])
    gg = tf.reshape(g, [B, -1, g.shape[-1]])
    return tf.matmul(a, gg, transpose_a=True)


def unfold_gather(x, k, s, padding):
    import numpy as np
    if padding == "SAME":
        x = pad_same(x, k, s)
    bb, h, w, c = x.shape
    oh, ow = (h - k) // s + 1, (w - k) // s + 1
    p, q, i, j = np.meshgrid(np.arange(oh), np.arange(ow), np.arange(k), np.arange(k), indexing="ij")
    idx = ((s * p + i) * w + (s * q + j)).reshape(-1)  # (oh, ow, kh, kw)
    xt = tf.reshape(tf.transpose(x, [1, 2, 0, 3]), [h * w, bb * c])
    a = tf.gather(xt, idx)  # [T*kk, B*C]
    a = tf.reshape(a, [oh * ow, k * k, bb, c])
    return tf.reshape(tf.transpose(a, [2, 0, 1, 3]), [bb, oh, ow, k * k * c])


def depthwise_grads(x, g, k, s, padding):
    if padding == "SAME":
        x = pad_same(x, k, s)
    cin, d = x.shape[-1], g.shape[-1]
    inp = tf.transpose(x, [3, 1, 2, 0])  # [Cin, H, W, B]
    filt = tf.transpose(g, [1, 2, 0, 3])  # [oh, ow, B, D]
    out = tf.nn.depthwise_conv2d(inp, filt, [1, 1, 1, 1], "VALID", dilations=[s, s])
    out = out[:, :k, :k]  # [Cin, k, k, B*D]
    out = tf.reshape(out, [cin, k, k, B, d])
    return tf.reshape(tf.transpose(out, [3, 1, 2, 0, 4]), [B, k * k * cin, d])


def bench(fn, n=30):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t = time.process_time()
        fn().numpy()
        ts.append(time.process_time() - t)
    return 1000 * statistics.median(ts)


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    for name, (shape, k, s, padding, d) in CASES.items():
        x = tf.constant(rng.standard_normal(shape), tf.float32)
        w = tf.constant(rng.standard_normal((k, k, shape[-1], d)), tf.float32)
        y = tf.nn.conv2d(x, w, s, padding)
        g = tf.constant(rng.standard_normal(y.shape), tf.float32)
        ref = unfold_grads(x, g, k, s, padding)
        alt = depthwise_grads(x, g, k, s, padding)
        err = float(tf.reduce_max(tf.abs(ref - alt)) / tf.reduce_max(tf.abs(ref)))
        f1 = tf.function(lambda: unfold_grads(x, g, k, s, padding))
        f2 = tf.function(lambda: depthwise_grads(x, g, k, s, padding))
        f3 = tf.function(lambda: tf.nn.conv2d(x, w, s, padding))
        f4 = tf.function(lambda: slices_grads(x, g, k, s, padding))
        f5 = tf.function(lambda: _unfold(x, [k, k], [s, s], [1, 1], padding))
        f6 = tf.function(lambda: _unfold_s2d_slices(x, [k, k], [s, s], padding))
        f7 = tf.function(lambda: _unfold_s2d_depthwise(x, [k, k], [s, s], padding))
        f8 = tf.function(lambda: unfold_gather(x, k, s, padding))
        assert float(tf.reduce_max(tf.abs(f8() - f5()))) == 0.0
        n1 = tf.reduce_sum(f5() ** 2, -1)
        assert float(tf.reduce_max(tf.abs(n1 - tf.reduce_sum(f6() ** 2, -1)))) < 1e-3
        assert float(tf.reduce_max(tf.abs(n1 - tf.reduce_sum(f7() ** 2, -1)))) < 1e-3
        err2 = float(tf.reduce_max(tf.abs(ref - f4())))
        for _ in range(2):
            print(f"{name}: rel err {err:.1e}  unfold+matmul {bench(f1):6.2f} ms cpu  "
                  f"forward conv {bench(f3):6.2f} "
                  f"unfold onehot {bench(f5):6.2f} s2d slices {bench(f6):6.2f} s2d dw {bench(f7):6.2f} gather {bench(f8):6.2f}")
