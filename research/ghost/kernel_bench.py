"""CPU time of the pieces of the ghost conv rule on the reference CNN (per-example kernel
gradients, their squared norms), by formulation.

    python -m research.ghost.kernel_bench

Findings (2-core CPU without GPU, TF 2.21, Keras 3.15): ``g^T a`` beats ``a^T g`` by ~1.5x (used);
squared norms by ``reduce_sum(square)`` beat einsum/bmm forms; on conv2 the Gram route and the
materialised route cost the same (the Gram route is used: less memory). ``compare_grouped()``:
per-example kernel gradients by one backprop-filter with the batch as channel groups are exact but
no faster (conv1 6-8 vs 6-7 ms; conv2 8-9 vs 3-4 ms), and in the full step they raised the CNN's
peak memory from ~78 to ~98 MB, so they are not used.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from research.ghost.conv_bench import cpu_ms  # noqa: E402
from tf_dp.gradients.ghost.conv import _unfold  # noqa: E402

B = 256
rng = np.random.default_rng(0)


def grouped_conv1(x, g):
    """Per-example kernel grads as one grouped backprop-filter (batch as channel groups)."""
    xi = tf.transpose(x, [3, 1, 2, 0])  # Cin = 1: [1, H, W, B]
    gi = tf.reshape(tf.transpose(g, [1, 2, 0, 3]), [1, 14, 14, B * 16])
    f = tf.raw_ops.Conv2DBackpropFilter(
        input=xi, filter_sizes=[8, 8, 1, B * 16], out_backprop=gi, strides=[1, 2, 2, 1],
        padding="SAME")
    return tf.transpose(tf.reshape(f, [64, B, 16]), [1, 0, 2])


def main():
    for name, t, c, d in (("conv1", 196, 64, 16), ("conv2", 25, 256, 32)):
        a = tf.constant(rng.random((B, t, c)), tf.float32)
        g = tf.constant(rng.random((B, t, d)), tf.float32)
        m = tf.matmul(a, g, transpose_a=True)
        mf = tf.reshape(m, [B, -1])
        fs = {
            "matmul_ta": lambda: tf.matmul(a, g, transpose_a=True),
            "matmul_gT": lambda: tf.matmul(g, a, transpose_a=True),
            "einsum": lambda: tf.einsum("btc,btd->bcd", a, g),
            "sq_reduce": lambda: tf.reduce_sum(tf.square(mf), 1),
            "sq_einsum": lambda: tf.einsum("bk,bk->b", mf, mf),
            "sq_norm": lambda: tf.square(tf.norm(mf, axis=1)),
            "sq_bmm": lambda: tf.reshape(tf.matmul(mf[:, None, :], mf[:, :, None]), [B]),
            "wsum_tensordot": lambda: tf.tensordot(tf.ones([B]), mf, axes=1),
        }
        fs = {k: tf.function(f) for k, f in fs.items()}
        print(name, "  ".join(f"{k} {cpu_ms(f):.2f}" for k, f in fs.items()))
    x = tf.constant(rng.random((B, 28, 28, 1)), tf.float32)
    g = tf.constant(rng.random((B, 14, 14, 16)), tf.float32)

    def unfold_matmul():
        p = tf.reshape(_unfold(x, [8, 8], [2, 2], [1, 1], "SAME"), [B, 196, 64])
        return tf.matmul(p, tf.reshape(g, [B, 196, 16]), transpose_a=True)

    ref = unfold_matmul()
    got = grouped_conv1(x, g)
    print("grouped vs unfold max rel err", float(tf.reduce_max(tf.abs(ref - got)) / tf.reduce_max(ref)))
    f1, f2 = tf.function(unfold_matmul), tf.function(lambda: grouped_conv1(x, g))
    for _ in range(2):
        print(f"conv1 per-example grads: unfold+matmul {cpu_ms(f1):.2f}  grouped {cpu_ms(f2):.2f}")


if __name__ == "__main__":
    main()


def gram_vs_materialised():
    for name, t, c, d in (("conv2", 25, 256, 32), ("conv1", 196, 64, 16)):
        a = tf.constant(rng.random((B, t, c)), tf.float32)
        g = tf.constant(rng.random((B, t, d)), tf.float32)
        w = tf.constant(rng.random(B), tf.float32)

        def gram():
            aa = tf.matmul(a, a, transpose_b=True)
            gg = tf.matmul(g, g, transpose_b=True)
            sq = tf.reduce_sum(aa * gg, axis=[1, 2])
            s = tf.matmul(tf.reshape(a, [-1, c]), tf.reshape(g * w[:, None, None], [-1, d]),
                          transpose_a=True)
            return sq, s

        def mat():
            m = tf.matmul(g, a, transpose_a=True)  # [B, D, C]
            sq = tf.reduce_sum(tf.square(tf.reshape(m, [B, -1])), 1)
            s = tf.transpose(tf.reshape(tf.tensordot(w, tf.reshape(m, [B, -1]), 1), [d, c]))
            return sq, s

        r1, r2 = gram(), mat()
        np.testing.assert_allclose(r1[0].numpy(), r2[0].numpy(), rtol=1e-4)
        np.testing.assert_allclose(r1[1].numpy(), r2[1].numpy(), rtol=1e-4)
        f1, f2 = tf.function(gram), tf.function(mat)
        for _ in range(2):
            print(f"{name} norms+weighted sum: gram {cpu_ms(f1):.2f}  materialised {cpu_ms(f2):.2f}")


if __name__ == "__main__":
    gram_vs_materialised()


def grouped(x, g, k, s, padding):
    """Per-example kernel gradients [B, k, k, C, D] by one backprop-filter with B groups."""
    b, h, w, c = x.shape
    oh, ow, d = g.shape[1], g.shape[2], g.shape[3]
    xi = tf.reshape(tf.transpose(x, [1, 2, 0, 3]), [1, h, w, b * c])
    gi = tf.reshape(tf.transpose(g, [1, 2, 0, 3]), [1, oh, ow, b * d])
    f = tf.raw_ops.Conv2DBackpropFilter(
        input=xi, filter_sizes=[k, k, c, b * d], out_backprop=gi, strides=[1, s, s, 1],
        padding=padding)
    return tf.transpose(tf.reshape(f, [k, k, c, b, d]), [3, 0, 1, 2, 4])


def compare_grouped():
    for name, xs, k, s, padding, d in (("conv1", (B, 28, 28, 1), 8, 2, "SAME", 16),
                                       ("conv2", (B, 13, 13, 16), 4, 2, "VALID", 32)):
        x = tf.constant(rng.random(xs), tf.float32)
        oh = (xs[1] - k) // s + 1 if padding == "VALID" else -(-xs[1] // s)
        g = tf.constant(rng.random((B, oh, oh, d)), tf.float32)

        def unfold_mm():
            p = _unfold(x, [k, k], [s, s], [1, 1], padding)
            return tf.matmul(tf.reshape(g, [B, -1, d]), tf.reshape(p, [B, -1, k * k * xs[3]]),
                             transpose_a=True)

        ref = tf.transpose(unfold_mm(), [0, 2, 1])
        got = tf.reshape(grouped(x, g, k, s, padding), [B, -1, d])
        print(name, "max rel err", float(tf.reduce_max(tf.abs(ref - got)) / tf.reduce_max(ref)))
        f1, f2 = tf.function(unfold_mm), tf.function(lambda: grouped(x, g, k, s, padding))
        for _ in range(2):
            print(f"{name} per-example grads: unfold+matmul {cpu_ms(f1):.2f}  grouped {cpu_ms(f2):.2f}")
