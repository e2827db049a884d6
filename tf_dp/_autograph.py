"""tf_dp's code is traced as written, never rewritten by AutoGraph (as Keras's own code is not).

A ``tf.function`` with ``autograph=True`` (the default, and the one tf_dp's own training loops
used) rewrites every Python function it reaches, module by module, unless AutoGraph's conversion
rules exclude the module: TensorFlow excludes ``tensorflow`` and ``keras``, and Keras 3 traces its
train step with ``do_not_convert``, so a Keras model's layers run unconverted in ``fit``.
tf_dp's DP step is written in TensorFlow ops with Python control flow only on static values, so
converting it buys nothing, and it cost most of the first step's trace time: 133 functions at
about 0.2 s each for a small Dense model (``tests/test_budget_planner.py``'s three-steps-per-call
test: 57 s with conversion, 5.4 s without, 2-core AMD EPYC). :func:`exclude_from_autograph`
adds tf_dp to the excluded modules. The user's own code called from the step (the model's
layers, a loss) runs as it does in Keras's ``fit``: unconverted.
"""

from __future__ import annotations

PACKAGE = "tf_dp"


def exclude_from_autograph() -> bool:
    """Adds a do-not-convert rule for the ``tf_dp`` package to AutoGraph's conversion rules (once;
    idempotent), when TensorFlow is loaded: each TensorFlow-using subpackage of tf_dp calls it
    at the end of its import. Returns False when TensorFlow is not loaded yet, or has no such
    rules (its private module moved: tf_dp then still works, converted, with slower first traces).

    Example::

        from tf_dp._autograph import exclude_from_autograph
        exclude_from_autograph()  # True: tf_dp functions are traced as written
    """
    import sys

    if "tensorflow" not in sys.modules:  # nothing traces tf_dp code without TensorFlow loaded
        return False
    try:
        from tensorflow.python.autograph.core import config, config_lib
    except ImportError:  # pragma: no cover - a TensorFlow without AutoGraph's rule table
        return False
    rules = tuple(getattr(config, "CONVERSION_RULES", ()))
    for rule in rules:
        if isinstance(rule, config_lib.DoNotConvert) and getattr(rule, "_prefix", None) == PACKAGE:
            return True
    config.CONVERSION_RULES = (config_lib.DoNotConvert(PACKAGE),) + rules
    return True
