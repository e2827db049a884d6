"""Float tolerances derived from the dtype and the computation, never from the machine.

Two computations of the same real value that differ only in op order or kernel (``fit`` vs a
custom loop, graph vs eager, oneDNN's fused float16 kernels on AVX512-FP16/AMX CPUs vs plain
ones, ghost norms vs per-example gradients) each carry rounding error. Summing ``terms`` numbers in
a dtype of unit roundoff ``u = eps / 2`` is within ``gamma_terms * sum|x_i| ~= terms * u *
sum|x_i|`` of the exact sum (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
Sec. 4.2), in any order; two such results differ by at most twice that, ``terms * eps * scale``,
with ``scale`` a bound on ``sum|x_i|``. A chain of operations adds the terms of each (a matmul
of fan-in ``k`` counts ``k``, an elementwise op or a cast 1). These are first-order bounds for
well-conditioned values (no cancellation below ``scale``), which is what the tests compare.

Example (weights after 3 SGD steps of learning rate 0.1 with gradients clipped to 0.5, computed
in float16 with about 16 roundings on the longest path)::

    atol = sgd_tolerance("float16", steps=3, learning_rate=0.1, update_scale=0.5, terms=16)
"""

from __future__ import annotations

import numpy as np

#: machine epsilon (the gap between 1 and the next number) of each float dtype: 2^-10 for
#: float16, 2^-7 for bfloat16, 2^-23 for float32, 2^-52 for float64
EPS = {
    "float16": 2.0**-10,
    "bfloat16": 2.0**-7,
    "float32": 2.0**-23,
    "float64": 2.0**-52,
}


def eps(dtype) -> float:
    """Machine epsilon of ``dtype`` (a name, a numpy dtype or a ``tf.DType``)."""
    name = getattr(dtype, "name", None) or np.dtype(dtype).name
    if name not in EPS:
        raise ValueError(f"dtype must be one of {sorted(EPS)}, got {dtype!r}")
    return EPS[name]


def tolerance(dtype, terms: int = 1, scale: float = 1.0) -> float:
    """Bound on ``|a - b|`` for two evaluations in ``dtype`` of the same value that differ only in
    the order of their ``terms`` accumulated roundings (sums, products, casts), the magnitudes
    involved bounded by ``scale``: ``terms * eps(dtype) * scale`` (see the module docstring).

    >>> tolerance("float32", terms=8, scale=2.0) == 8 * 2.0**-23 * 2.0
    True
    """
    if terms < 1 or scale < 0:
        raise ValueError(f"terms must be >= 1 and scale >= 0, got {terms}, {scale}")
    return float(terms * eps(dtype) * scale)


def dense_gradient_terms(widths) -> int:
    """Roundings on the longest path from an input to one per-example gradient entry of a dense
    network of layer widths ``widths`` (input first, logits last) with a cross-entropy loss:
    forward, each layer's matmul (fan-in) and bias, each hidden activation, the log-softmax over
    the classes; backward, each hidden layer's matmul (fan-out) and activation derivative, one
    outer product per layer, and the casts in and out of the compute dtype (2).

    >>> dense_gradient_terms([5, 4, 3])  # (5 + 1) + (4 + 1) + 1 + 3, then (3 + 1) + 2 + 2
    23
    """
    widths = list(widths)
    layers = len(widths) - 1
    forward = sum(w + 1 for w in widths[:-1]) + (layers - 1) + widths[-1]
    backward = sum(w + 1 for w in widths[2:]) + layers + 2
    return forward + backward


def model_gradient_terms(model, classes: int) -> int:
    """An upper count of the roundings on the way from an input to one per-example gradient
    entry of a built Keras model with a cross-entropy loss over ``classes``: for each layer with
    weights, its longest reduction (the fan-in of the kernel, ``prod(kernel.shape[:-1])``, or the
    output positions a convolution's weight gradient sums over, whichever is larger) and 2 (bias,
    activation), counted forward and backward; the log-softmax; 2 casts. Layers without weights
    (flatten, concatenation, pooling of at most the positions counted) are counted by the
    reductions of their neighbours.

    >>> import keras
    >>> m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(3)])
    >>> model_gradient_terms(m, classes=3)  # 2 * ((5 + 2) + (4 + 2)) + 3 + 2
    31
    """
    import math

    total = 0
    for layer in model._flatten_layers(include_self=False, recursive=True):
        kernel = getattr(layer, "kernel", None)
        if kernel is None or getattr(layer, "_layers", None):
            continue
        fan_in = math.prod(kernel.shape[:-1])
        positions = 1
        output = getattr(layer, "output", None)
        shape = getattr(output, "shape", None)
        if shape is not None and len(shape) > 2:
            positions = math.prod(d for d in shape[1:-1] if d is not None)
        total += max(fan_in, positions) + 2
    return 2 * total + classes + 2


def norm_terms(num_params: int) -> int:
    """Roundings of a global L2 norm over ``num_params`` entries: the sum of their squares and
    the square root."""
    return int(num_params) + 1


def sgd_tolerance(
    dtype,
    steps: int,
    learning_rate: float,
    update_scale: float,
    terms: int,
    weight_scale: float = 1.0,
) -> float:
    """Bound on the weight difference after ``steps`` SGD steps of two computations that differ
    in op order or kernel: each step's update ``learning_rate * g`` (``|g_i| <= update_scale``,
    e.g. the clip norm for a mean of clipped gradients, plus the noise's size) carries a relative
    error ``terms * eps(dtype)`` from the gradient's computation in ``dtype`` (float16 under
    ``mixed_float16``), and the float32 weight (``|w| <= weight_scale``) is rounded once more per
    step; errors of earlier steps add up (their effect through the next gradient is of second
    order at these learning rates).

    >>> round(sgd_tolerance("float32", 3, 0.1, 0.5, 59, 1.0) * 1e6, 3)
    1.413
    """
    return steps * (
        tolerance(dtype, terms, learning_rate * update_scale)
        + tolerance("float32", 1, weight_scale)
    )
