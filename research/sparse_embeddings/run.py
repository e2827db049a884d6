"""Utility at equal certified epsilon: DP-SGD with dense table noise vs DP-AdaFEST (sparse) on a
synthetic recommendation task with power-law item frequencies, trained with ``model.fit``.

``python -m research.sparse_embeddings.run --seeds 0,1,2`` (from the repository root)

Task: ``--items`` items, each of one of two genres (public to nobody: the model must learn it);
a user has a preferred genre ``g`` and a history of ``--length`` items, each drawn from genre
``g`` with probability ``--affinity`` (else from the other genre), Zipf(1.1)-distributed by
popularity within its genre; the label is ``g``. The Bayes rate is the majority vote of the
history's genres (printed). Model: Embedding(items, 8) -> mean -> Dense(1), logistic loss, SGD
(learning rate 20 for the DP runs, 10 for the non-private one, which diverges at 50).
Batches: ``tf_dp.data.poisson_batches`` at rate ``q = batch / n``. Both DP runs clip jointly at
C = 1 and certify the same epsilon: dense adds ``N(0, (z C)^2)`` to the whole table each step;
sparse (``sparse_embeddings=SparseEmbeddingConfig(threshold, sigma1)``) splits ``z`` into a
selection noise multiplier ``sigma1`` and a gradient one ``sigma2`` with
``sigma1^-2 + sigma2^-2 = z^-2``. Epsilon is computed (PLD) from each run's own ledger.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np


def data(seed, n, items, length, affinity):
    rng = np.random.default_rng(1000 + seed)
    genre_of = rng.integers(0, 2, items)
    by_genre = [rng.permutation(np.flatnonzero(genre_of == k)) for k in (0, 1)]  # popularity
    g = rng.integers(0, 2, n)
    same = rng.random((n, length)) < affinity
    which = np.where(same, g[:, None], 1 - g[:, None])
    rank = rng.zipf(1.1, size=(n, length)) - 1
    ids = np.empty((n, length), np.int64)
    for k in (0, 1):
        m = which == k
        ids[m] = by_genre[k][np.minimum(rank[m], len(by_genre[k]) - 1)]
    bayes = np.mean(np.where(same.sum(1) * 2 == length, 0.5, (same.sum(1) * 2 > length)))
    return ids.astype(np.int32), g.astype(np.float32)[:, None], float(bayes)


def train(mode, seed, args, x, y, xt, yt):
    import keras
    import tensorflow as tf

    import tf_dp
    from tf_dp.accounting import compute_epsilon

    keras.utils.set_random_seed(seed)
    inp = keras.Input((args.length,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(args.items, 8)(inp))
    model = keras.Model(inp, keras.layers.Dense(1)(h))
    loss = keras.losses.BinaryCrossentropy(from_logits=True)
    q = args.batch / len(x)
    steps_per_epoch = 100
    epochs = max(1, args.steps // steps_per_epoch)
    eps = None
    if mode == "nonprivate":
        model.compile(optimizer=keras.optimizers.SGD(args.lr_nonprivate), loss=loss)
        model.fit(x, y, batch_size=args.batch, epochs=max(1, round(epochs * steps_per_epoch * q)),
                  verbose=0)
    else:
        if mode == "dense":
            opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=args.z,
                                                  learning_rate=args.lr)
        else:
            sigma2 = (args.z**-2 - args.sigma1**-2) ** -0.5
            opt = tf_dp.keras.DPKerasSGDOptimizer(
                l2_norm_clip=1.0, noise_multiplier=sigma2, learning_rate=args.lr,
                sparse_embeddings=tf_dp.keras.SparseEmbeddingConfig(
                    threshold=args.threshold, selection_noise_multiplier=args.sigma1))
        model = tf_dp.keras.make_private(model)
        model.compile(optimizer=opt, loss=loss)
        batches = tf_dp.data.poisson_batches(x, y, sampling_probability=q,
                                             steps_per_epoch=steps_per_epoch)
        model.fit(batches, epochs=epochs, verbose=0)
        eps = compute_epsilon(opt.ledger, args.delta, "pld").epsilon
    logits = model.predict(xt, batch_size=4096, verbose=0).ravel()
    del tf
    return float(np.mean((logits > 0) == (yt.ravel() > 0.5))), eps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--n", type=int, default=50_000)
    p.add_argument("--items", type=int, default=20_000)
    p.add_argument("--length", type=int, default=10)
    p.add_argument("--affinity", type=float, default=0.7)
    p.add_argument("--batch", type=int, default=500)
    p.add_argument("--lr", type=float, default=20.0, help="DP runs (clipped at C = 1)")
    p.add_argument("--lr_nonprivate", type=float, default=10.0,
                   help="non-private run (unclipped: 50 diverges)")
    p.add_argument("--z", type=float, default=1.0)
    p.add_argument("--sigma1", type=float, default=3.0)
    p.add_argument("--threshold", type=float, default=10.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--modes", default="nonprivate,dense,sparse")
    args = p.parse_args(argv)
    out = {"args": vars(args), "runs": []}
    for seed in [int(s) for s in args.seeds.split(",")]:
        x, y, bayes = data(seed, args.n + 10_000, args.items, args.length, args.affinity)
        for mode in args.modes.split(","):
            acc, eps = train(mode, seed, args, x[: args.n], y[: args.n], x[args.n :], y[args.n :])
            out["runs"].append({"seed": seed, "mode": mode, "test_accuracy": acc,
                                "epsilon_pld": eps, "bayes_accuracy": bayes})
            print(json.dumps(out["runs"][-1]), flush=True)
    summary = {}
    for mode in args.modes.split(","):
        accs = [r["test_accuracy"] for r in out["runs"] if r["mode"] == mode]
        summary[mode] = {"mean": statistics.mean(accs), "min": min(accs), "max": max(accs)}
    out["summary"] = summary
    print(json.dumps(summary, indent=1))
    return out


if __name__ == "__main__":
    main()
