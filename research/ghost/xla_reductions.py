"""Row sums of squares and finiteness checks under XLA on CPU, by formulation.

    python -m research.ghost.xla_reductions

XLA's CPU backend rewrites a long reduction (a sum over a row of 512 or 784 values, an ``all`` over
a ``[784, 512]`` boolean mask) into a windowed reduction followed by a short one, and runs the
windowed reduction without the vector units. A product with a vector of ones does the same sum
with the matrix-vector kernel. This script times, each as a ``tf.function(jit_compile=True)``
(median of 300 calls, microseconds, the call's own cost included: see ``baseline``):

* ``reduce``: ``reduce_sum(square(t), axis=1)``, the ghost Dense rule's per-example squared norm
  of a ``[B, C]`` factor elsewhere;
* ``matvec``: ``matvec(square(t), ones)``, what ``tf_dp.gradients.ghost.factors._row_squares``
  uses under XLA;
* ``all_mask``: ``reduce_all(is_finite(t))``, the DP step's check of the noised update elsewhere;
* ``all_products``: ``is_finite(ones^T (t * 0) ones)``, ``tf_dp.engine.step.all_finite`` under XLA;
* ``baseline``: one element read, for the cost of a call.

Then the weighted sum of per-example gradients, ``sum_b w_b G_b`` for ``G`` the ``[64, 16384]``
per-example kernel gradients of a ``[64, 128, 128]`` batched product (the Transformer's ``128 x
128`` kernels, computed in the same function, so XLA may fuse it), in milliseconds per call:

* ``G only``: the per-example gradients alone;
* ``matvec``: ``matvec(G, w, transpose_a=True)``, ``tf_dp.gradients.base.weighted_sum`` elsewhere:
  XLA emits this matrix-vector product on a reshaped operand as a naive loop;
* ``two columns``: ``matmul([w, 0], G, transpose_a=True)[0]``, what ``weighted_sum`` uses under XLA
  (a matrix product, which XLA hands to its matrix kernel);
* ``reduce``: ``reduce_sum(G * w[:, None], axis=0)``.

The results are checked against each other first. Research only: the library's choice is made
from these figures (bench/README.md has the step times).
"""
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def _median_us(fn, x, calls=300):
    args = x if isinstance(x, tuple) else (x,)
    for _ in range(20):
        fn(*args).numpy()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn(*args).numpy()
        times.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(times))


def main():
    xla = lambda f: tf.function(f, jit_compile=True)  # noqa: E731
    reduce = xla(lambda t: tf.reduce_sum(tf.square(t), axis=1))
    matvec = xla(lambda t: tf.linalg.matvec(tf.square(t), tf.ones([t.shape[1]])))
    all_mask = xla(lambda t: tf.reduce_all(tf.math.is_finite(t)))
    all_products = xla(lambda t: tf.math.is_finite(tf.tensordot(
        tf.ones([t.shape[0]]), tf.linalg.matvec(t * 0.0, tf.ones([t.shape[1]])), 1)))
    baseline = xla(lambda t: tf.identity(t[0, 0]))
    print(f"{'shape':>12}{'reduce':>9}{'matvec':>9}{'all_mask':>10}{'all_products':>14}"
          f"{'baseline':>10}  (us per call)")
    for shape in [(256, 784), (256, 512), (256, 10), (784, 512), (8000, 128)]:
        t = tf.random.stateless_normal(shape, seed=[0, 1])
        np.testing.assert_allclose(reduce(t).numpy(), matvec(t).numpy(), rtol=1e-5)
        assert bool(all_mask(t)) and bool(all_products(t))
        bad = tf.tensor_scatter_nd_update(t, [[shape[0] - 1, 0]], [np.inf])
        assert not bool(all_mask(bad)) and not bool(all_products(bad))
        print(f"{str(shape):>12}{_median_us(reduce, t):9.1f}{_median_us(matvec, t):9.1f}"
              f"{_median_us(all_mask, t):10.1f}{_median_us(all_products, t):14.1f}"
              f"{_median_us(baseline, t):10.1f}")


def weighted_sums():
    b, t, c = 64, 128, 128
    a = tf.random.stateless_normal([b, t, c], seed=[1, 2])
    g = tf.random.stateless_normal([b, t, c], seed=[3, 4])
    w = tf.random.stateless_uniform([b], seed=[5, 6])

    def per_example(a, g):
        return tf.reshape(tf.matmul(a, g, transpose_a=True), [b, -1])

    routes = {
        "G only": lambda a, g, w: per_example(a, g)[0, :4],
        "matvec": lambda a, g, w: tf.linalg.matvec(per_example(a, g), w, transpose_a=True),
        "two columns": lambda a, g, w: tf.matmul(
            tf.stack([w, tf.zeros_like(w)], 1), per_example(a, g), transpose_a=True)[0],
        "reduce": lambda a, g, w: tf.reduce_sum(per_example(a, g) * w[:, None], 0),
    }
    reference = None
    print(f"{'weighted sum, [64, 16384]':>28}  ms per call")
    for name, fn in routes.items():
        compiled = tf.function(fn, jit_compile=True)
        value = compiled(a, g, w).numpy()
        if name == "matvec":
            reference = value
        elif reference is not None:  # float32 sums of 64 terms in another order
            np.testing.assert_allclose(value, reference, rtol=1e-4, atol=1e-3)
        print(f"{name:>28}  {_median_us(compiled, (a, g, w), calls=40) / 1e3:.3f}")


if __name__ == "__main__":
    main()
    weighted_sums()
