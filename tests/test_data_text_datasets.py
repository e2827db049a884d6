"""tf_dp.data.load_imdb_or_fortunes: the fortunes fallback read from files, clear errors."""

import numpy as np
import pytest

from tf_dp.data import DataNotFoundError, encode_fortunes, load_imdb_or_fortunes, read_fortunes


def _write_fortunes(directory):
    topics = {
        "computers": ["The computer is down.", "Bugs bug me, computers too."],
        "politics": ["Vote early, vote often.", "Politics: the art of the possible."],
        "science": ["Science is organized knowledge.", "E = mc squared."],
        "men-women": ["Men and women.", "Women and men, and more men."],
    }
    for topic, entries in topics.items():
        (directory / topic).write_text("\n%\n".join(entries) + "\n%\n")
    return topics


def test_reads_the_fortune_files_as_labelled_texts(tmp_path):
    topics = _write_fortunes(tmp_path)
    texts, labels = read_fortunes(str(tmp_path))
    assert texts == [t for entries in topics.values() for t in entries]
    np.testing.assert_array_equal(labels, [0, 0, 1, 1, 2, 2, 3, 3])


def test_fallback_is_named_and_encoded_with_a_training_vocabulary(tmp_path):
    _write_fortunes(tmp_path)
    (x, y), (xt, yt), name, classes = load_imdb_or_fortunes(20, 6, fortunes_dir=str(tmp_path))
    assert "FALLBACK" in name and classes == ("computers", "politics", "science", "men-women")
    assert x.shape == (6, 6) and xt.shape == (2, 6) and x.dtype == np.int32
    assert x.max() < 20 and sorted(np.r_[y, yt].tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]
    # the same split and encoding as encode_fortunes with the defaults
    (x2, y2), _ = encode_fortunes(str(tmp_path), 20, 6)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)


def test_missing_fortunes_is_a_clear_error(tmp_path):
    with pytest.raises(DataNotFoundError, match="apt-get install fortunes"):
        load_imdb_or_fortunes(100, 10, fortunes_dir=str(tmp_path / "nothing"))
