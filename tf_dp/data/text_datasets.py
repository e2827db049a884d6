"""Text data for the tutorials and research scripts: IMDb when it can be fetched, else the fortunes.

``load_imdb_or_fortunes()`` tries the IMDb movie reviews through ``keras.datasets.imdb``; without
network access it falls back to a small real corpus that Debian ships, the ``fortunes`` package
(``apt-get install fortunes``), whose quotations are filed by topic in
``/usr/share/games/fortunes``: the task becomes "which of four topics (computers, politics,
science, men-women) is this text filed under?", about 3,000 texts. The returned name says which
(``"fortunes (FALLBACK, not IMDb)"``). It never falls back to synthetic data.

Example::

    (x, y), (xt, yt), name, classes = tf_dp.data.load_imdb_or_fortunes(10000, 200)
    print(f"training on {name}: classes {classes}")

Both come as padded word-index arrays ``[N, maxlen]`` (int32; 0 is padding, 1 an unknown word
for the fortunes, most frequent words first). The vocabulary is counted on data (Keras's IMDb
index on the whole data set, the fortunes on their training split): it is a function of the data
that DP training does not cover; in a real deployment take it from public data.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Optional, Sequence

import numpy as np

from tf_dp.data.datasets import DataNotFoundError

#: Where Debian's ``fortunes`` package installs its files.
DEBIAN_FORTUNES_DIR = "/usr/share/games/fortunes"

#: The fortune files of the fallback task, in label order.
FORTUNE_TOPICS = ("computers", "politics", "science", "men-women")

_logger = logging.getLogger("tf_dp")


def read_fortunes(directory: str, topics: Sequence[str] = FORTUNE_TOPICS):
    """``(texts, labels)`` of the fortune files ``topics`` in ``directory`` (label = position)."""
    texts, labels = [], []
    for label, topic in enumerate(topics):
        with open(os.path.join(directory, topic), encoding="utf-8", errors="replace") as f:
            entries = f.read().split("\n%\n")
        for entry in entries:
            entry = entry.strip().strip("%").strip()
            if entry:
                texts.append(entry)
                labels.append(label)
    return texts, np.array(labels, dtype=np.int32)


def tokenize(text: str) -> list[str]:
    """Lower-case words (letters, digits and apostrophes)."""
    return re.findall(r"[a-z0-9']+", text.lower())


def encode_fortunes(
    directory: str,
    num_words: int,
    maxlen: int,
    test_fraction: float = 0.2,
    seed: int = 0,
    topics: Sequence[str] = FORTUNE_TOPICS,
):
    """The fortunes as padded word-index arrays, split ``1 - test_fraction`` / ``test_fraction``
    by a permutation from ``seed``. The vocabulary (index 0: padding, 1: unknown word, then the
    ``num_words - 2`` most frequent words) is counted on the training split only."""
    texts, labels = read_fortunes(directory, topics)
    order = np.random.default_rng(seed).permutation(len(texts))
    n_test = int(round(test_fraction * len(texts)))
    test_idx, train_idx = order[:n_test], order[n_test:]
    counts: dict[str, int] = {}
    for i in train_idx:
        for word in tokenize(texts[i]):
            counts[word] = counts.get(word, 0) + 1
    vocabulary = sorted(counts, key=lambda w: (-counts[w], w))[: num_words - 2]
    index = {word: i + 2 for i, word in enumerate(vocabulary)}

    def encode(ids):
        out = np.zeros((len(ids), maxlen), dtype=np.int32)
        for row, i in enumerate(ids):
            seq = [index.get(word, 1) for word in tokenize(texts[i])][:maxlen]
            out[row, : len(seq)] = seq
        return out

    return (encode(train_idx), labels[train_idx]), (encode(test_idx), labels[test_idx])


def load_imdb(num_words: int, maxlen: int):
    """IMDb through ``keras.datasets.imdb`` (downloads it unless cached), padded and cut at the
    end to ``maxlen`` tokens."""
    import keras

    (x_tr, y_tr), (x_te, y_te) = keras.datasets.imdb.load_data(num_words=num_words)
    pad = dict(maxlen=maxlen, padding="post", truncating="post", dtype="int32")
    return (
        (keras.utils.pad_sequences(x_tr, **pad), y_tr.astype(np.int32)),
        (keras.utils.pad_sequences(x_te, **pad), y_te.astype(np.int32)),
    )


def load_imdb_or_fortunes(num_words: int, maxlen: int, fortunes_dir: Optional[str] = None):
    """IMDb via ``keras.datasets`` if it can be fetched (or is cached); else the fortunes.

    Args:
      num_words: vocabulary size, padding and unknown-word indices included.
      maxlen: tokens per text (longer texts are cut, shorter ones padded with 0).
      fortunes_dir: a directory of fortune files. When given, it is used *instead of* trying
        IMDb; otherwise the fallback reads ``/usr/share/games/fortunes``.

    Returns:
      ``((x_train, y_train), (x_test, y_test), name, class_names)``: ``name`` is ``"imdb"`` or
      ``"fortunes (FALLBACK, not IMDb)"``.

    Raises:
      DataNotFoundError: neither could be loaded (never falls back to synthetic data).
    """
    if fortunes_dir is None:
        try:
            return load_imdb(num_words, maxlen) + ("imdb", ("negative", "positive"))
        except Exception as error:  # no network: fall back to the machine's real corpus
            _logger.warning("tf_dp: IMDb could not be loaded (%s: %s); trying the fortunes in %s",
                            type(error).__name__, str(error)[:200], DEBIAN_FORTUNES_DIR)
            fortunes_dir = DEBIAN_FORTUNES_DIR
    if not os.path.isfile(os.path.join(fortunes_dir, FORTUNE_TOPICS[0])):
        raise DataNotFoundError(
            "no text data: IMDb could not be downloaded and there are no fortune files in "
            f"{fortunes_dir} (on Debian/Ubuntu: apt-get install fortunes)"
        )
    return encode_fortunes(fortunes_dir, num_words, maxlen) + (
        "fortunes (FALLBACK, not IMDb)", FORTUNE_TOPICS
    )
