"""Per-example kernel gradients of the reference CNN's first convolution under XLA, by route.

    python -m research.ghost.xla_conv_routes

The convolution: 28 x 28 x 1 inputs, 16 filters of 8 x 8, stride 2, SAME padding (14 x 14
outputs), batch 256. Routes, each as a ``tf.function`` with and without ``jit_compile=True``
(median of 40 calls, ms), all returning ``[B, 8 * 8 * 1, 16]``:

* ``kernel``: tf_dp's native kernel (``TfDpConvKernelGrads``; under XLA its custom call,
  ``tf_dp.dp_query.native.conv_kernel_grads_xla``): what the ghost rule uses where the native ops
  are built;
* ``unfold``: the rule's route without them (``conv._unfold``: under XLA a one-hot convolution for
  one channel) and a batched product over the 196 positions;
* ``patches``: ``tf.image.extract_patches`` instead of the rule's unfold;
* ``slices``: the patches gathered by 64 strided slices instead of the patch op;
* ``depthwise``: the input as ``[C, H, W, B]`` convolved depthwise with the output gradient as a
  ``[14, 14, B, F]`` filter dilated by the stride (the batch as channels, so nothing is summed over
  it);
* ``nonprivate``: TensorFlow's filter gradient (summed over the batch) for scale.

The routes' values are compared with the ``patches`` route first. Inside the DP step the times
differ from these (other fusions, the threads shared): there the depthwise route's convolution
took 8.1 ms where the unfold route took about 3 ms (``python -m research.ghost.op_profile --model
cnn --mode auto --jit_compile --all_events``). Research only.
"""
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

from tf_dp import _compat  # noqa: E402
from tf_dp.dp_query import native  # noqa: E402
from tf_dp.gradients.ghost import conv as ghost_conv  # noqa: E402

B, H, C, F, K, S, O = 256, 28, 1, 16, 8, 2, 14
PAD = max((O - 1) * S + K - H, 0)  # SAME: 6 rows and columns, 3 before


def _padded(x):
    lo = PAD // 2
    return tf.pad(x, [[0, 0], [lo, PAD - lo], [lo, PAD - lo], [0, 0]])


def patches(x, g):
    p = tf.image.extract_patches(x, [1, K, K, 1], [1, S, S, 1], [1, 1, 1, 1], "SAME")
    return tf.einsum("btk,btf->bkf", tf.reshape(p, [B, O * O, K * K * C]),
                     tf.reshape(g, [B, O * O, F]))


def kernel(x, g):
    if _compat.graph_in_xla_context():
        return native.conv_kernel_grads_xla(x, g, [K, K], [S, S], [1, 1], "SAME")
    return native.conv_kernel_grads_op(x, g, [K, K], [S, S], [1, 1], "SAME")


def unfold(x, g):
    # the rule's unfold where the native ops are not used
    native.set_enabled(False)
    try:
        p = ghost_conv._unfold(x, [K, K], [S, S], [1, 1], "SAME")
    finally:
        native.set_enabled(None)
    return tf.einsum("btk,btf->bkf", tf.reshape(p, [B, O * O, K * K * C]),
                     tf.reshape(g, [B, O * O, F]))


def slices(x, g):
    xp = _padded(x)
    end = S * (O - 1) + 1
    cols = [xp[:, i:i + end:S, j:j + end:S, :] for i in range(K) for j in range(K)]
    p = tf.reshape(tf.concat(cols, axis=-1), [B, O * O, K * K * C])
    return tf.einsum("btk,btf->bkf", p, tf.reshape(g, [B, O * O, F]))


def depthwise(x, g):
    xt = tf.transpose(_padded(x), [3, 1, 2, 0])  # [C, Hp, Wp, B]
    ft = tf.transpose(g, [1, 2, 0, 3])  # [O, O, B, F]
    out = tf.nn.depthwise_conv2d(xt, ft, [1, 1, 1, 1], "VALID", dilations=[S, S])
    out = tf.reshape(out[:, :K, :K, :], [C, K, K, B, F])
    return tf.reshape(tf.transpose(out, [3, 1, 2, 0, 4]), [B, K * K * C, F])


def nonprivate(x, g):
    return tf.raw_ops.Conv2DBackpropFilter(input=x, filter_sizes=[K, K, C, F], out_backprop=g,
                                           strides=[1, S, S, 1], padding="SAME")


def main():
    x = tf.random.stateless_normal([B, H, H, C], [1, 2])
    g = tf.random.stateless_normal([B, O, O, F], [3, 4])
    ref = patches(x, g)
    for f in (kernel, unfold, slices, depthwise):
        err = float(tf.reduce_max(tf.abs(f(x, g) - ref)))
        print(f"{f.__name__}: max |difference| from patches {err:.3g} "
              f"(max |value| {float(tf.reduce_max(tf.abs(ref))):.3g})")
    for jit in (False, True):
        for f in (kernel, unfold, patches, slices, depthwise, nonprivate):
            fn = tf.function(f, jit_compile=jit)
            for _ in range(5):
                fn(x, g)
            ts = []
            for _ in range(40):
                t0 = time.perf_counter()
                fn(x, g).numpy()
                ts.append(time.perf_counter() - t0)
            print(f"{'XLA' if jit else 'TF '} {f.__name__:10s} {1e3 * statistics.median(ts):.2f} ms")


if __name__ == "__main__":
    main()
