"""``model.fit`` of a private model under ``tf.distribute.MultiWorkerMirroredStrategy``.

Two things differ from one worker:

- **Input.** Each worker Poisson-samples its own shard (``tf_dp.data.poisson_batches(...,
  num_shards=W, shard_index=w)``), and the global step must process exactly the union of the
  workers' samples. ``strategy.experimental_distribute_dataset`` (what Keras does with a
  ``tf.data.Dataset``) treats every element as a *global* batch and splits it into one piece per
  replica in the cluster, each worker running all its pieces as separate steps: a worker's sample
  would be spread over several global steps, and a step would no longer hold one Poisson sample.
  :func:`distribute_poisson_batches` hands Keras a dataset distributed by
  ``strategy.distribute_datasets_from_function`` instead: each worker's element is its own
  sample, split between its local replicas only.
- **Keras 3 (3.10-3.15) under multi-worker strategies.** Its ``fit`` reduces the first data batch
  with ``strategy.reduce("MEAN", ...)`` before building (which fails on a ``PerReplica`` batch in
  eager mode), and reduces scalar step outputs with ``axis=0`` (which fails on rank-0 tensors).
  :func:`keras_multi_worker_fixes` replaces both, for the duration of one ``fit`` of a private
  model: the build uses the first local replica's batch (only shapes matter), and scalar outputs
  are averaged over replicas with ``axis=None``. Both replaced paths raise in the unpatched code,
  so no working behaviour changes.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import tensorflow as tf

from tf_dp import _compat


def num_workers(strategy: Any) -> int:
    """Worker processes of a (multi-worker) ``tf.distribute`` strategy; 1 for all others."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return 1
    spec = resolver.cluster_spec().as_dict()
    return max(1, len(spec.get("worker", [])) + len(spec.get("chief", [])))


def distribute_poisson_batches(
    strategy: Any, dataset: tf.data.Dataset, max_batch_size: int, unit_rows: int = 1
):
    """This worker's Poisson batches as one global step's share, split between local replicas.

    Every element of ``dataset`` is this worker's whole sample of a step, padded to
    ``max_batch_size`` rows (user-level: user slots of ``unit_rows`` rows each). With ``L``
    local replicas it is cut into ``L`` consecutive pieces of equal size, in whole slots
    (``max_batch_size`` must then be a multiple of ``L * unit_rows``), which
    ``distribute_datasets_from_function`` deals to the local replicas in turn: one element per
    global step, whatever the number of workers. A sample larger than ``max_batch_size`` (it is
    never truncated) is padded to a multiple of ``L * unit_rows`` rows and cut into ``L`` larger
    pieces, so that no piece of it reaches another step. A worker that sampled no unit at a
    step still gives its all-padding batch (weight 0 everywhere), which adds nothing to the sum.
    """

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        local = context.num_replicas_in_sync // max(1, context.num_input_pipelines)
        if local <= 1:
            return dataset
        if max_batch_size % (local * unit_rows):
            raise ValueError(
                f"poisson_batches(max_batch_size={max_batch_size // unit_rows}) must be a "
                f"multiple of the {local} replicas of each worker, so that each replica gets an "
                "equal piece"
            )
        from tf_dp.data.poisson import pad_to_multiple

        def pieces(*batch):
            def cut(t):  # [L, rows / L, ...]: piece i is rows i * rows / L .. (i + 1) * rows / L
                t = tf.convert_to_tensor(t)
                inner = [tf.shape(t)[i + 1] if d is None else d for i, d in
                         enumerate(t.shape[1:].as_list())]
                return tf.reshape(t, tf.stack([local, -1, *inner]))

            return tf.data.Dataset.from_tensor_slices(tf.nest.map_structure(cut, batch))

        # one step's sample, whatever its size, gives exactly L pieces of whole slots
        return pad_to_multiple(dataset, local * unit_rows).flat_map(pieces)

    options = tf.distribute.InputOptions(experimental_fetch_to_device=True)
    return strategy.distribute_datasets_from_function(dataset_fn, options)


def _first_local_batch(model: Any, iterator: Any = None, data_batch: Any = None) -> None:
    """Keras's ``_maybe_symbolic_build`` without the cross-worker reduction of the data."""
    strategy = model.distribute_strategy
    if iterator is not None:
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tf.nest.map_structure(
                lambda v: strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues)
                else v,
                batch,
            )
            break
    with strategy.scope():
        _compat.symbolic_build(model, data_batch)


@contextlib.contextmanager
def keras_multi_worker_fixes(model: Any):
    """While active (one ``fit``), the two Keras multi-worker failures above are avoided."""
    keras_trainer = _compat.keras_tf_trainer()
    original_reduce = keras_trainer.reduce_per_replica
    multi_worker = _compat.is_multi_worker

    def reduce_per_replica(values, strategy, reduction):
        if multi_worker(strategy) and reduction in ("auto", "mean"):

            def mean(v):
                if isinstance(v, tf.distribute.DistributedValues) or tf.is_tensor(v):
                    return strategy.reduce("MEAN", v, axis=None)
                return v

            return tf.nest.map_structure(mean, values)
        return original_reduce(values, strategy, reduction)

    name = _compat.MAYBE_SYMBOLIC_BUILD
    had_own = name in vars(model)
    own = vars(model).get(name)
    keras_trainer.reduce_per_replica = reduce_per_replica
    setattr(model, name, types.MethodType(_first_local_batch, model))
    try:
        yield
    finally:
        keras_trainer.reduce_per_replica = original_reduce
        if had_own:
            setattr(model, name, own)
        else:
            delattr(model, name)
