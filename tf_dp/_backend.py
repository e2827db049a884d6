"""The Keras backend check of the TensorFlow-only subpackages (a leaf module: it imports no other
tf_dp module)."""


def require_tensorflow_backend() -> None:
    """Raises ``ImportError`` unless Keras runs on its TensorFlow backend.

    Called when ``tf_dp.keras`` or ``tf_dp.gradients`` is imported: their DP step is written in
    TensorFlow ops (per-example gradients, ``tf.distribute``, the ledger's variables), so under
    another backend (jax, torch, numpy, ...) it cannot run. The check is "the backend is not
    ``tensorflow``", whichever other backend it is.

    Example::

        tf_dp._backend.require_tensorflow_backend()  # ImportError when KERAS_BACKEND=jax
    """
    import keras

    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ImportError(
            f"tf_dp needs Keras's TensorFlow backend for training, but Keras runs on {backend!r}: "
            "set the environment variable KERAS_BACKEND=tensorflow before keras is first imported "
            "(tf_dp.accounting and the command-line tools work under any backend)"
        )
