# %% [markdown]
# # Private fine-tuning of a pretrained language model with LoRA
#
# Most uses of differential privacy today fine-tune a pretrained model on private data. This
# notebook fine-tunes a keras-hub BERT text classifier with DP-Adam in three ways and compares
# them:
#
# - **DP LoRA** (Hu et al. 2021; under DP: Yu et al. 2021, Li et al. 2021): the pretrained
#   weights stay frozen; small low-rank factors added to the attention projections and the new
#   classification head train. The noise is added to few coordinates.
# - **DP head only**: the backbone stays frozen; only the classification head trains.
# - **Non-private LoRA**: the same LoRA set-up without privacy, as the reference.
#
# The privacy guarantee is computed from the optimizer's ledger of what actually ran.
#
# **Where it runs.** On Colab the notebook downloads a pretrained preset
# (`bert_tiny_en_uncased`) and the IMDb movie reviews. Without internet access (the machines this
# project is tested on) it builds a small BERT **from a config, with random weights**, and uses
# Debian's `fortunes` corpus (two topics): the output then says so, and its accuracies say
# nothing about fine-tuning a *pretrained* model; they only show that the code runs.

# %% [markdown]
# ## Parameters
#
# `SMALL` (set by the test suite with `TF_DP_TUTORIAL_SMALL=1`) runs a quick version: a tiny
# model, few examples and one epoch. Leave it off for the real run.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("TF_DP_TUTORIAL_SMALL", "0") == "1"

PRESET = "bert_tiny_en_uncased"  # pretrained keras-hub preset (Colab)
SEQ_LEN = 32 if SMALL else 128  # tokens per text
TRAIN_SIZE = 480 if SMALL else 10000
TEST_SIZE = 200 if SMALL else 2000
BATCH_SIZE = 32 if SMALL else 256  # expected batch size under Poisson sampling
EPOCHS = 1 if SMALL else 5
LORA_RANK = 4 if SMALL else 8
L2_NORM_CLIP = 1.0
NOISE_MULTIPLIER = 1.0
LEARNING_RATE = 3e-3
DELTA = 1e-5

# %% [markdown]
# ## Data
#
# **On Colab**: IMDb reviews as raw text (`aclImdb_v1.tar.gz` from Stanford, through
# `keras.utils.get_file`), positive or negative; `TRAIN_SIZE` training and `TEST_SIZE` test
# reviews drawn at random.
#
# **Offline**: Debian's `fortunes` package (`apt-get install fortunes`) files quotations by topic
# in `/usr/share/games/fortunes`; the task becomes "computers or politics?". The output says
# `FALLBACK`. `TF_DP_TUTORIAL_TEXT_DATA_DIR` skips the IMDb attempt and reads the fortunes from
# that directory.

# %%
import glob
import re

import numpy as np

FORTUNE_TOPICS = ("computers", "politics")
FORTUNES_DIR = "/usr/share/games/fortunes"
IMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"


def split(texts, labels, n_train, n_test, seed=0):
    order = np.random.default_rng(seed).permutation(len(texts))
    pick = lambda idx: ([texts[i] for i in idx], np.asarray(labels, np.int32)[idx])  # noqa: E731
    return pick(order[n_test:][:n_train]), pick(order[:n_test])


def load_fortunes(directory, n_train, n_test):
    texts, labels = [], []
    for label, topic in enumerate(FORTUNE_TOPICS):
        with open(os.path.join(directory, topic), encoding="utf-8", errors="replace") as f:
            for entry in f.read().split("\n%\n"):
                entry = entry.strip().strip("%").strip()
                if entry:
                    texts.append(entry)
                    labels.append(label)
    return split(texts, labels, n_train, n_test)


def load_imdb(n_train, n_test):
    import keras

    path = keras.utils.get_file("aclImdb_v1.tar.gz", IMDB_URL, extract=True)
    root = glob.glob(os.path.join(os.path.dirname(path), "**", "aclImdb"), recursive=True)[0]
    out = []
    for part, size in (("train", n_train), ("test", n_test)):
        files = [(f, label) for label, kind in enumerate(("neg", "pos"))
                 for f in glob.glob(os.path.join(root, part, kind, "*.txt"))]
        chosen = np.random.default_rng(0).permutation(len(files))[:size]
        texts = [open(files[i][0], encoding="utf-8").read() for i in chosen]
        out.append((texts, np.array([files[i][1] for i in chosen], np.int32)))
    return tuple(out)


def load_text_data(n_train, n_test):
    fortunes_dir = os.environ.get("TF_DP_TUTORIAL_TEXT_DATA_DIR")
    if fortunes_dir is None:
        try:
            return load_imdb(n_train, n_test) + ("imdb", ("negative", "positive"))
        except Exception as error:  # no network: the machine's own corpus
            print(f"IMDb could not be downloaded ({type(error).__name__}); using the fortunes")
            fortunes_dir = FORTUNES_DIR
    if not os.path.isfile(os.path.join(fortunes_dir, FORTUNE_TOPICS[0])):
        raise FileNotFoundError(
            f"no text data: IMDb could not be downloaded and there are no fortune files in "
            f"{fortunes_dir} (on Debian/Ubuntu: apt-get install fortunes)"
        )
    return load_fortunes(fortunes_dir, n_train, n_test) + (
        "fortunes (FALLBACK, not IMDb; model from a config with random weights)", FORTUNE_TOPICS
    )


(train_texts, y_train), (test_texts, y_test), data_name, class_names = load_text_data(
    TRAIN_SIZE, TEST_SIZE)
n = len(train_texts)
PRETRAINED = data_name == "imdb"
print(f"DATA: {data_name}: {n} training and {len(test_texts)} test texts, classes {class_names}")

# %% [markdown]
# ## Model and tokens
#
# With the preset, its own preprocessor turns texts into `token_ids`, `segment_ids` and a
# `padding_mask`. Offline, a word-level vocabulary counted on the training texts plays that role
# (keras-hub's WordPiece tokenizer needs `tensorflow-text`). Either way the texts are tokenized
# once, and the classifier is called with `preprocessor=None` on the arrays.
#
# A privacy note: a vocabulary counted on the private texts is itself a function of them that
# DP-SGD does not cover; a pretrained tokenizer (the Colab path) is public.

# %%
import keras
import keras_hub

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def word_vocabulary(texts, size=2000):
    counts = {}
    for text in texts:
        for word in re.findall(r"[a-z0-9']+", text.lower()):
            counts[word] = counts.get(word, 0) + 1
    return SPECIAL + sorted(counts, key=lambda w: (-counts[w], w))[: size - len(SPECIAL)]


def word_tokens(texts, vocabulary):
    index = {w: i for i, w in enumerate(vocabulary)}
    ids = np.zeros((len(texts), SEQ_LEN), np.int32)
    for row, text in enumerate(texts):
        words = [index.get(w, 1) for w in re.findall(r"[a-z0-9']+", text.lower())]
        seq = [2] + words[: SEQ_LEN - 2] + [3]
        ids[row, : len(seq)] = seq
    return {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": ids != 0}


if PRETRAINED:
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor.from_preset(
        PRESET, sequence_length=SEQ_LEN)
    tokens = lambda texts: {k: np.asarray(v) for k, v in preprocessor(texts).items()}  # noqa: E731
else:
    vocabulary = word_vocabulary(train_texts)
    tokens = lambda texts: word_tokens(texts, vocabulary)  # noqa: E731
x_train, x_test = tokens(train_texts), tokens(test_texts)


def build_classifier():
    """The same initial weights on every call: the preset's, or a seeded small config."""
    keras.utils.set_random_seed(1)
    if PRETRAINED:
        return keras_hub.models.BertTextClassifier.from_preset(
            PRESET, num_classes=len(class_names), preprocessor=None)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(vocabulary), num_layers=2, num_heads=2, hidden_dim=64,
        intermediate_dim=128, max_sequence_length=SEQ_LEN)
    return keras_hub.models.BertTextClassifier(
        backbone, num_classes=len(class_names), preprocessor=None)


def trainable_count(model):
    return int(sum(np.prod(v.shape) for v in model.trainable_variables))


print(f"BERT with {build_classifier().count_params():,} parameters")

# %% [markdown]
# ## Private training
#
# `train(setup, private)` builds a fresh classifier, applies `setup` (enable LoRA, or freeze the
# backbone), and trains it. Privately: `make_private`, `DPKerasAdamOptimizer` with the clip and
# the noise multiplier, Poisson-sampled batches (`tf_dp.data.poisson_batches`), whose sampling
# the ledger records. `gradient_mode="auto"` (the default) computes every example's gradient norm
# with the ghost rules of `docs/finetuning.md`: only trainable variables are clipped and noised,
# and the strategy's `description` says `ghost` when no layer falls back to per-example
# gradients.

# %%
import time

import tf_dp

q = BATCH_SIZE / n
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def lora(model):
    model.backbone.enable_lora(LORA_RANK)


def head_only(model):
    model.backbone.trainable = False


def train(setup, private=True):
    model = build_classifier()
    setup(model)
    if private:
        model = tf_dp.keras.make_private(model)
        optimizer = tf_dp.keras.DPKerasAdamOptimizer(
            l2_norm_clip=L2_NORM_CLIP, noise_multiplier=NOISE_MULTIPLIER,
            learning_rate=LEARNING_RATE)
        data = {"x": tf_dp.data.poisson_batches(x_train, y_train, sampling_probability=q)}
    else:
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        data = {"x": x_train, "y": y_train, "batch_size": BATCH_SIZE}
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
    start = time.time()
    model.fit(**data, epochs=EPOCHS, verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=100, verbose=0)
    print(f"{setup.__name__:9} {'DP' if private else 'non-private':11}: "
          f"{trainable_count(model):>9,} trainable parameters, test accuracy {accuracy:.4f}, "
          f"{time.time() - start:.0f} s")
    return model, float(accuracy)


lora_model, lora_accuracy = train(lora)
print("strategy:", lora_model.optimizer.gradient_clipper.description)

# %% [markdown]
# The same privacy, only the head trained:

# %%
head_model, head_accuracy = train(head_only)
print("strategy:", head_model.optimizer.gradient_clipper.description)

# %% [markdown]
# And LoRA without privacy (plain Keras, shuffled batches), the reference:

# %%
nonprivate_model, nonprivate_accuracy = train(lora, private=False)
majority = float(np.max(np.bincount(y_test, minlength=len(class_names))) / len(y_test))
print(f"always answering the most common class: {majority:.4f}")

# %% [markdown]
# ## The guarantee, from the ledger
#
# Each private optimizer's ledger holds one entry per step: the population `n`, the sampling
# rate `q`, `poisson`, the clip and the noise actually used. The PLD accountant turns it into
# `(epsilon, delta)`; both runs made the same number of Poisson steps with the same noise, so
# their guarantees agree.

# %%
from tf_dp.accounting import compute_epsilon

lora_ledger, head_ledger = lora_model.optimizer.ledger, head_model.optimizer.ledger
print("last step:", lora_ledger.samples()[-1])
lora_result = compute_epsilon(lora_ledger, DELTA, accountant="pld")
head_result = compute_epsilon(head_ledger, DELTA, accountant="pld")
print(f"DP LoRA:      epsilon = {lora_result.epsilon:.3f} at delta = {DELTA} "
      f"({lora_ledger.num_samples} steps, certified: {lora_result.certified})")
print(f"DP head only: epsilon = {head_result.epsilon:.3f} at delta = {DELTA}")

# %% [markdown]
# ## Summary
#
# With a pretrained backbone (Colab), DP LoRA typically beats training only the head at the same
# epsilon, and approaches non-private fine-tuning as the data set grows (Yu et al. 2021). In the
# offline fallback the backbone is random, so none of the three learns much from a few hundred
# texts: compare the numbers only on a real run.

# %%
print(f"data: {data_name}")
print(f"{'DP LoRA (rank ' + str(LORA_RANK) + ')':24}{lora_accuracy:.4f}  epsilon "
      f"{lora_result.epsilon:.2f}")
print(f"{'DP head only':24}{head_accuracy:.4f}  epsilon {head_result.epsilon:.2f}")
print(f"{'non-private LoRA':24}{nonprivate_accuracy:.4f}")
