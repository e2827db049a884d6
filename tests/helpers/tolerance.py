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
    1.412
    """
    return steps * (
        tolerance(dtype, terms, learning_rate * update_scale)
        + tolerance("float32", 1, weight_scale)
    )
