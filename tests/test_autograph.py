"""tf_dp's code is excluded from AutoGraph (``tf_dp._compat.exclude_from_autograph``), as Keras's
is, and nothing else changes: the user's own functions are still converted where they were.
(``tests/test_import_isolation.py`` checks that each TensorFlow-using module, imported alone,
installs the rule.)"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.autograph.impl import conversion

import tf_dp.keras  # noqa: F401 - installs the rule
from tf_dp._compat import AUTOGRAPH_EXCLUDED as PACKAGE
from tf_dp._compat import exclude_from_autograph
from tf_dp.engine.step import DPEngine


def _user_function(x):
    return x


def test_tf_dp_functions_are_not_converted_and_user_functions_are():
    assert conversion.is_allowlisted(DPEngine.private_gradients)
    assert conversion.is_allowlisted(tf_dp.keras.make_private)
    assert not conversion.is_allowlisted(_user_function)


def test_the_rule_is_added_once():
    from tensorflow.python.autograph.core import config

    assert exclude_from_autograph() and exclude_from_autograph()
    prefixes = [getattr(r, "_prefix", None) for r in config.CONVERSION_RULES]
    assert prefixes.count(PACKAGE) == 1


def test_user_tf_function_still_gets_autograph():
    # a Python `if` on a tensor needs AutoGraph: it still traces in the user's tf.function
    @tf.function
    def f(x):
        if x > 0:
            return x
        return -x

    assert float(f(tf.constant(-2.0))) == 2.0

