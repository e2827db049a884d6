"""Noise source: a counter-based Philox generator, seeded from OS entropy by default.

McMahan et al. 2018 (section 8) ask for noise from a cryptographically seeded generator: a
predictable seed lets an adversary subtract the noise. :func:`make_generator` keys a
``tf.random.Generator`` (Philox, counter-based, so streams are reproducible only from the key and
counter) with a 64-bit key and a 128-bit starting counter from ``os.urandom``. Passing ``seed`` is
for tests and debugging only: with a known seed the noise is known and the privacy guarantee is
void.

Caveat (same section): Gaussian samples in floating point are not exactly Gaussian; the accountants
treat them as exact, as every DP-SGD implementation does.

Sampler. :func:`gaussian_noise` turns the generator's Philox words into normals by the Box-Muller
transform in vectorised TF ops (``r = sqrt(-2 ln u1)``, ``z = (r cos 2 pi u2, r sin 2 pi u2)``),
one draw per large tensor (:func:`add_gaussian_noise_structure`). It costs less CPU time than
``tf.random.Generator.normal`` (whose kernel calls scalar ``log``/``sin``/``cos``) and has better
tails:

- ``u1`` has 64 random bits: ``u1 = (hi + (lo + 1/2) 2^-32) 2^-32`` (two 32-bit words), so its
  smallest value is ``2^-65`` and the largest normal the sampler can return is
  ``sqrt(2 * 65 * ln 2) = 9.49`` standard deviations (:data:`TAIL_BOUND`). TF's own float32
  normal clamps ``u1`` at ``1e-7`` (a 23-bit uniform), which truncates at ``5.68`` standard
  deviations. Truncation matters for privacy: an output beyond ``TAIL_BOUND - shift`` has an
  unbounded privacy-loss ratio, so the mass of an exact Gaussian in
  ``[TAIL_BOUND - C/sigma, TAIL_BOUND]`` is added to delta per step, unaccounted. At 9.49 standard
  deviations this is below ``1e-13`` per step for noise multipliers >= 0.5 (at 5.68 it is
  ``1e-4``).
- ``u2`` (the angle) has 23 bits in float32 (32 in float64), and the angle is the centre of its
  cell: ``theta = (2k + 1) pi 2^-23`` (float64: ``(k + 1/2) 2 pi 2^-32``).
- Exact zeros. A pair must never be ``(0, 0)`` nor have one exact zero: that coordinate would be
  released without noise. Two constructions gave them. (1) ``u1`` rounding to 1.0: in float32,
  ``hi + (lo + 1/2) 2^-32`` rounds to ``2^32`` when ``hi >= 2^32 - 128`` (probability ``2^-25``
  per pair; in float64 about ``2^-53``), so ``r = 0``. ``u1`` is capped at the largest float
  below 1 (``1 - 2^-24``; float64 ``1 - 2^-53``): those words give ``r = sqrt(-2 ln(1 - 2^-24))
  = 3.5e-4`` instead of 0, i.e. the top cell of ``u1`` is one and a half float32 cells wide, a
  discretisation error of the same size as float32 rounding everywhere else. (2) An angle word
  with ``k = 0`` gave ``theta = 0`` and ``sin theta = 0`` exactly (probability ``2^-24``); the
  centred angle is never 0, and no other float is a multiple of ``pi/2`` (``pi`` is
  irrational), so neither ``cos`` nor ``sin`` is 0. A test feeds the extreme words to the
  transform.
- float32 draws the low word lazily: in float32, ``hi + (lo + 1/2) 2^-32`` rounds to ``hi``
  whenever ``hi >= 2^24``, so ``lo`` only matters for the pairs with ``hi < 2^24`` (one in 256).
  The sampler draws ``(hi, angle)`` for every pair and a low word for those pairs only (a
  dynamically sized second draw), and returns exactly the values the dense formula gives on the
  same words (a test checks this bit for bit): 2 Philox words per pair instead of 3, 23% less CPU
  time on the MLP's 670k parameters (``research/ghost/noise_bench.py``). In float64 (where
  every bit of ``lo`` counts), and under XLA (which needs static shapes) where the native
  kernel's XLA custom call is not available (below), all three words are drawn.
- Counters: a float32 call reserves its words with one ``generator.skip`` and reads each draw
  (high words, angles, low words of each chunk) from its own counter plane (see
  :class:`_ReservedWords`): 2 ops per draw instead of the 6 of a ``Generator`` draw, and a
  traced graph a quarter smaller on the MLP. No Philox block is used twice (a test recomputes a
  call from the documented counters).
- Computed in float32 (float64 for float64 values, with a 32-bit angle); the vectorised
  transcendentals are cheaper than ``Generator.normal``'s scalar ones.
- Native op. Where a C++ compiler is installed and TensorFlow sees no GPU or TPU, the float32
  lazy transform (outside ``tf.distribute``) runs as one fused TensorFlow kernel,
  ``TfDpGaussianNoise`` (:mod:`tf_dp.dp_query.native`, compiled on first use; under XLA, for a
  draw of a size known while tracing, the same kernel as an XLA custom call,
  :func:`tf_dp.dp_query.native.chunked_gaussian_noise_xla`, the same values bit for bit): the same Philox
  words from the same counter planes (a test checks them against TensorFlow's bit for bit), the
  same ``u1`` and angle cells, one vectorised pass instead of about fifteen kernels (0.7 ms instead of 4.1 ms
  for the MLP's 670k normals on 2 cores). Its log, sin and cos are its own, with the angle
  reduced exactly from the angle word's bits, so its values are within 6 float32 units of a
  float64 computation (TensorFlow's ops: about 24, from rounding the angle to float32 before
  ``cos``); the tail bound and the absence of exact zeros are the same (every angle cell is
  tested). A large float32 leaf's noise is drawn and added to it by one op,
  ``TfDpAddGaussianNoise`` (every chunk's planes, no concatenation, no separate addition; bit for
  bit the values of the draw plus the addition), and a draw of several chunks is one op
  (``TfDpChunkedGaussianNoise``, no concatenation). Otherwise (no compiler, a GPU or TPU, or
  ``TF_DP_NATIVE=0``) the TensorFlow ops are used.

The noise does not depend on the clipped sum, so the TF executor may run it at any time in the
step (it has no data dependency until the final addition): on a free core, alongside the forward
and backward pass, at the price of holding the noise through them. A gradient clipper for which
memory matters more asks the DP optimizer to draw it after the clipped sum
(``ClippedGradients.noise_after_sum``; JL's double-vjp route does). Large leaves get a draw each
(:func:`add_gaussian_noise_structure`), and draws of more than :data:`CHUNK` normals are made in
chunks (float32: on the call's reserved counter planes; float64/XLA: consecutive draws), so the
sampler's temporaries (about 3x its output) exist for a few chunks at a time: on the reference
BiLSTM one draw of its 0.6 M normals peaks at about 5 MB, not 9 MB.

Noise modes (:data:`NOISE_MODES`). ``"continuous"`` (the default) adds the float noise above to
the float sum. Its low bits depend on the sum (Mironov 2012; Jin et al. 2022): with ``C = 1``,
stddev 1 and a canary contributing ``-1``, ``y = -1 + eta`` with ``|y| < 1/2`` is always a multiple
of ``2^-24`` (exact subtraction), while ``eta`` alone usually is not, so the event "``|y| < 1/2``
and ``y 2^24`` not an integer" tells the canary apart (0 vs about 26% of draws), whatever the
noise multiplier. The guarantee covers the ideal real-valued mechanism only.

``"grid"`` (:func:`add_grid_noise_structure`) releases ``g round(s / g) + g round(eta / g)`` in
float64, ``g`` a power of two: every value is a multiple of ``g``, a function of the Gaussian
mechanism's output on the rounded sum ``s_g = g round(s / g)`` (snapping, Mironov 2012, with the
rounding on the input side so that the sum of two grid values is exact). The ledger charges the
rounded sum's sensitivity ``Delta + g sqrt(d)`` (``d`` coordinates of the query's sum); ``g`` is
the largest power of two with ``g sqrt(d) <= C 2^-10`` (:func:`grid_spacing`), so the charge
grows by at most 0.1%. A discrete Gaussian on the grid (Canonne, Kamath and Steinke 2020) would
need an exact integer sampler per coordinate; the rounded float64 Gaussian costs one float64
draw and keeps the accountants unchanged. Residual assumptions, stated in the docs: (1) ``eta``
comes from the float64 Box-Muller sampler (64-bit ``u1``, 32-bit angle), not an exact Gaussian:
its values are discretised at about ``|eta| 2^-31`` (the angle cell), which moves each grid
cell's probability by a data-independent relative amount of order ``sigma 2^-31 / g`` (``1.4e-3``
for the reference MLP's ``d = 670k``, ``z = 1.1``), unaccounted, like the continuous mode's float
discretisation; (2) the clipped sum ``s`` itself is a float32 sum whose rounding the snapping
does not undo (``s_g`` moves by a grid step where ``s`` is within float error of a cell edge;
the charged ``g sqrt(d)`` covers a rounding of ``g/2`` per coordinate of each of two sums, not
this); (3) values above ``2^24 g`` lose low bits in the final float32 cast, a function of the
exact grid value (post-processing). Cost: one float64 draw instead of a float32 one, measured
with ``bench/step_time.py`` (``docs/queries.md``): too slow to be the default.
Under ``tf.distribute`` the DP optimizers reduce the clipped sums first and noise the global sum
in grid mode (the continuous mode adds replica 0's noised sum to the others' clipped sums, which
would put unrounded sums back into the low bits).

"""

from __future__ import annotations

import atexit
import math
import os
import threading
import weakref
from typing import Any, Optional

import tensorflow as tf

from tf_dp import _compat
from tf_dp.dp_query import native


def make_generator(seed: Optional[int] = None) -> tf.random.Generator:
    """Returns a Philox generator keyed from OS entropy, or from ``seed`` (tests only)."""
    with tf.init_scope():
        if seed is None:
            # 64-bit key and 128-bit starting counter, all from OS entropy: 192 unpredictable
            # bits of generator state (section 8 asks for a seed of at least 128 bits; the Philox
            # key alone has only 64).
            words = [int.from_bytes(os.urandom(8), "little", signed=True) for _ in range(3)]
            return tf.random.Generator.from_key_counter(
                key=words[0], counter=words[1:], alg="philox"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        return tf.random.Generator.from_seed(seed, alg="philox")


#: Largest absolute value (in standard deviations) :func:`gaussian_noise` can return:
#: ``sqrt(-2 ln u1_min)`` with ``u1_min = 2^-65``.
TAIL_BOUND = math.sqrt(2.0 * 65.0 * math.log(2.0))


def gaussian_noise(
    generator: tf.random.Generator, n: Any, dtype: tf.DType = tf.float32, stddev: Any = None
) -> tf.Tensor:
    """``n`` i.i.d. ``N(0, stddev^2)`` draws (a flat ``[n]`` tensor) from ``generator`` by
    Box-Muller (``stddev=None``: standard normals).

    ``dtype`` is float32 or float64. Counts above :data:`CHUNK` (known while tracing) are drawn in
    chunks of ``CHUNK``. Draws ``2 * ceil(n / 2)`` Philox words plus one per pair whose
    high word is below ``2^24`` in float32 (``3 * ceil(n / 2)`` in float64, and without the
    native ops for ``n <`` :data:`LAZY_MIN_SIZE` and under XLA);
    see the module docstring for the bits used and the tail
    bound :data:`TAIL_BOUND`.

    Example::

        gen = make_generator()
        z = gaussian_noise(gen, 1000)   # shape [1000], float32
    """
    dtype = tf.as_dtype(dtype)
    if dtype not in (tf.float32, tf.float64):
        raise TypeError(f"dtype must be float32 or float64, got {dtype.name}")
    n_static = tf.get_static_value(n)
    n_static = int(n_static) if n_static is not None else None
    # small draws: the dense three-word transform (the TF-ops lazy one's extra ops outweigh its
    # saved words), unless the native op draws them (one op whatever the size: on the reference
    # CNN's 26k normals 0.8 ms of op time in TF ops, 0.26 ms natively)
    small = (n_static is not None and n_static < LAZY_MIN_SIZE
             and not (dtype == tf.float32 and n_static > 0 and native.available()
                      and not _ReservedWords.is_direct(generator)))
    if (dtype == tf.float32 and n_static is not None and n_static > 0 and _in_xla_context()
            and not _ReservedWords.is_direct(generator) and native.xla_available()):
        # under XLA: the native lazy draw as an XLA custom call (the same words and values as
        # the native op outside XLA), inside the compiled step
        words = _ReservedWords(generator, 2 * ((n_static + 1) // 2), len(_chunk_sizes(n_static)))
        return native.chunked_gaussian_noise_xla(
            n_static, words._key, words._counter, CHUNK, _radius_scale(tf.float32, stddev))
    if dtype != tf.float32 or small or _in_xla_context():
        n = tf.cast(n, tf.int64)
        half = (n + 1) // 2
        if n_static is not None and n_static > CHUNK:
            # Consecutive independent draws of CHUNK normals: the same law, and the transform's
            # temporaries (about 3x its output) exist for the chunks in flight.
            sizes = _chunk_sizes(n_static)
            return tf.concat([gaussian_noise(generator, m, dtype, stddev) for m in sizes], axis=0)
        bits = generator.uniform_full_int(tf.stack([tf.constant(3, tf.int64), half]), tf.uint32)
        return _first(box_muller(bits, dtype, stddev), n)
    # float32: the lazy transform, on words from counter ranges reserved with one skip
    if n_static is not None:
        sizes = _chunk_sizes(n_static)
        words = _ReservedWords(generator, 2 * ((n_static + 1) // 2), len(sizes))
        if len(sizes) > 1 and not words._direct and native.available():
            # every chunk from one op, written in place (no concatenation)
            return native.chunked_gaussian_noise_op(
                tf.constant(n_static, tf.int64), words._key, words._counter,
                tf.constant(CHUNK, tf.int64), _radius_scale(tf.float32, stddev))
        parts = [_lazy_chunk(words, j, m, stddev) for j, m in enumerate(sizes)]
        return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)
    n = tf.cast(n, tf.int64)
    return _lazy_chunk(_ReservedWords(generator, 2 * ((n + 1) // 2), 1), 0, n, stddev)


def stateless_gaussian_noise(seed: Any, n: int, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """``n`` i.i.d. standard normals (a flat ``[n]`` tensor) that are a function of ``seed`` alone.

    The sampler of :func:`gaussian_noise` (Box-Muller on Philox words, the same tails and
    chunks) on words read from a key and counter derived from ``seed`` (an integer tensor of
    shape ``[2]``, e.g. from ``tf.random.experimental.stateless_fold_in``), so no generator state
    is read or advanced: the same seed gives the same values in any process, eagerly, in a
    ``tf.function`` and under XLA (which reads the same words as the lazy float32 transform,
    its values differing only by XLA's rounding of ``log`` and ``cos``). For public randomness
    that must be reproducible (JL directions), never for DP noise, which comes from a generator
    keyed from OS entropy.

    Example::

        z = stateless_gaussian_noise(tf.constant([7, 0], tf.int64), 1000)   # [1000], float32
    """
    dtype = tf.as_dtype(dtype)
    if dtype not in (tf.float32, tf.float64):
        raise TypeError(f"dtype must be float32 or float64, got {dtype.name}")
    n = int(n)
    sizes = _chunk_sizes(n)
    words = _ReservedWords.from_seed(seed, len(sizes))
    parts = []
    for j, m in enumerate(sizes):
        half = (m + 1) // 2
        if dtype != tf.float32 or n < LAZY_MIN_SIZE:
            bits = tf.stack([words.draw(j, slot, half) for slot in (0, 2, 1)])  # hi, lo, angle
            parts.append(_first(box_muller(bits, dtype), m))
        elif _in_xla_context():
            # static shapes: every low word drawn, and the k-th pair with hi < 2^24 reads the
            # k-th one, as the lazy transform does (the others' low words do not matter)
            hi, angle, low = (words.draw(j, slot, half) for slot in (0, 1, 2))
            rank = tf.cumsum(tf.cast(hi < tf.constant(1 << 24, tf.uint32), tf.int32),
                             exclusive=True)
            parts.append(_first(box_muller(tf.stack([hi, tf.gather(low, rank), angle])), m))
        else:
            parts.append(_lazy_chunk(words, j, m, None))
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


class _ReservedWords:
    """Philox words for one :func:`gaussian_noise` call, from counter ranges reserved at once.

    ``generator.skip(words)`` returns the generator's state and advances its 128-bit counter
    ``c`` by ``256 * words`` blocks (a Philox block is 4 words), far past the ``words / 4``
    blocks the call's main draws use. Draw ``p`` of the call reads consecutive blocks from
    ``c + p * 2^64`` (``p`` added to the counter's high 64 bits): plane 0 lies in the reserved
    range, and planes ``p >= 1`` are ``2^64`` blocks away from every range the generator will
    hand out before its counter has moved that far, so no word is used twice. One skip per call
    instead of one per draw: three draws per chunk of the float32 sampler cost 2 ops each
    instead of 6 (and the traced graph shrinks accordingly). Under a distribution strategy the
    generator's own draws are used (they also fold in the replica).
    """

    def __init__(self, generator: tf.random.Generator, words: Any, chunks: int):
        self._generator = generator
        self._chunks = chunks
        self._direct = self.is_direct(generator)
        if not self._direct:
            state = generator.skip(words)
            self._counter = tf.bitcast(state[:2], tf.uint64)
            self._key = tf.bitcast(state[2:3], tf.uint64)

    @staticmethod
    def is_direct(generator: tf.random.Generator) -> bool:
        """Whether draws come from ``generator``'s own calls (under a distribution strategy, or
        a generator that is not Philox) instead of reserved counter planes."""
        alg = generator.algorithm  # 1: Philox (a Python int for generators made here)
        return tf.distribute.has_strategy() or not (isinstance(alg, int) and alg == 1)

    @classmethod
    def from_seed(cls, seed: Any, chunks: int) -> "_ReservedWords":
        """Words at a Philox key and counter drawn from the stateless ``seed`` (shape ``[2]``):
        plane ``p`` reads from counter ``(0, h + p)``, ``h`` random (no generator involved)."""
        words = cls.__new__(cls)
        words._generator, words._chunks, words._direct = None, chunks, False
        key_high = tf.random.stateless_uniform(
            [2], seed=seed, minval=None, maxval=None, dtype=tf.uint64, alg="philox"
        )
        words._key = key_high[:1]
        words._counter = tf.stack([tf.constant(0, tf.uint64), key_high[1]])
        return words

    def draw(self, chunk: int, slot: int, count: Any) -> tf.Tensor:
        """``count`` words for ``slot`` (0: high words, 1: angles, 2: low words) of ``chunk``."""
        shape = tf.reshape(tf.cast(count, tf.int64), [1])
        if self._direct:
            return self._generator.uniform_full_int(shape, tf.uint32)
        plane = slot * self._chunks + chunk
        counter = self._counter
        if plane:
            counter = counter + tf.constant([0, plane], tf.uint64)
        return tf.raw_ops.StatelessRandomUniformFullIntV2(
            shape=shape, key=self._key, counter=counter, alg=1, dtype=tf.uint32
        )


def _lazy_chunk(words: _ReservedWords, chunk: int, n: Any, stddev: Any) -> tf.Tensor:
    """``n`` float32 normals (chunk ``chunk`` of a call) by :func:`box_muller_lazy`: the native
    op on the same words where it is available (:mod:`tf_dp.dp_query.native`)."""
    half = (tf.cast(n, tf.int64) + 1) // 2
    if not words._direct and native.available():
        planes = tf.constant([slot * words._chunks + chunk for slot in (0, 1, 2)], tf.uint64)
        scale = _radius_scale(tf.float32, stddev)
        z = native.gaussian_noise_op(words._key, words._counter, planes, half, scale)
        return _first(z, n)
    hi = words.draw(chunk, 0, half)
    angle = words.draw(chunk, 1, half)
    z = box_muller_lazy(hi, angle, lambda idx: words.draw(chunk, 2, tf.shape(idx)[0]), stddev)
    return _first(z, n)


def _add_noise_natively(generator: tf.random.Generator, v: tf.Tensor, stddev: Any) -> Any:
    """``v + gaussian_noise(generator, v's size, float32, stddev)`` (reshaped) in one native op,
    the same words and values (the same reservation, chunks and planes; the addition rounded as
    TensorFlow's), where :func:`gaussian_noise` would use the native op on every chunk: a float32
    ``v`` of a size known while tracing, at least :data:`LAZY_MIN_SIZE`, outside XLA and
    ``tf.distribute``. Else None."""
    n = v.shape.num_elements()
    if (v.dtype != tf.float32 or n is None or n < LAZY_MIN_SIZE or _in_xla_context()
            or not native.available()):
        return None
    words = _ReservedWords(generator, 2 * ((n + 1) // 2), len(_chunk_sizes(n)))
    if words._direct:
        return None
    return native.add_gaussian_noise_op(v, words._key, words._counter,
                                        tf.constant(CHUNK, tf.int64),
                                        _radius_scale(tf.float32, stddev))


def _chunk_sizes(n: int) -> list[int]:
    return [min(CHUNK, n - k) for k in range(0, n, CHUNK)]


def _first(z: tf.Tensor, n: Any) -> tf.Tensor:
    """The first ``n`` of the ``2 ceil(n / 2)`` normals ``z`` (no slice, a copy, for even ``n``
    known while tracing)."""
    n_static = tf.get_static_value(n)
    if n_static is not None and int(n_static) % 2 == 0:
        return z
    return z[:n]


def _in_xla_context() -> bool:
    """True while tracing a ``jit_compile=True`` function (XLA needs static shapes)."""
    return _compat.graph_in_xla_context()


_TWO32 = 2.0**-32

#: Draws of more than this many normals (a count known while tracing) are made in chunks of it.
CHUNK = 1 << 17

#: Draws of fewer normals than this use the dense three-word transform where tf_dp's native op
#: is not used: the lazy one saves Philox words but has more ops, and per-op overhead dominates
#: small draws (the native op is one op whatever the size).
LAZY_MIN_SIZE = 1 << 15


def box_muller(bits: tf.Tensor, dtype: tf.DType = tf.float32, stddev: Any = None) -> tf.Tensor:
    """The transform of :func:`gaussian_noise`: ``uint32 [3, h]`` words -> ``2 h`` normals.

    Rows: ``hi`` and ``lo`` (the 64 bits of ``u1``) and the angle word. Exposed for tests: the
    all-zero words give the largest value, ``TAIL_BOUND``.
    """
    hi, lo = tf.cast(bits[0], dtype), tf.cast(bits[1], dtype)
    # u1 in (0, 1]: the midpoint of one of 2^64 equal cells (float rounding aside). In float32
    # the low word only matters when hi is small, i.e. exactly in the tail where it is needed.
    u1 = (hi + (lo + 0.5) * _TWO32) * _TWO32
    return _polar(u1, bits[2], dtype, stddev)


def box_muller_lazy(hi: tf.Tensor, angle: tf.Tensor, draw_low, stddev: Any = None) -> tf.Tensor:
    """float32 :func:`box_muller` with the low words drawn only where they change the result.

    Args:
      hi, angle: ``uint32 [h]``: the high words of ``u1`` and the angle words.
      draw_low: ``draw_low(idx) -> uint32 [k]``, the low words of the pairs at ``idx``
        (``int64 [k, 1]``, the pairs with ``hi < 2^24``).
      stddev: as in :func:`box_muller`.

    Returns the values :func:`box_muller` gives on ``[hi, lo, angle]`` (bit for bit): for
    ``hi >= 2^24`` the float32 sum ``hi + (lo + 1/2) 2^-32`` rounds to ``hi``.
    """
    u1 = tf.cast(hi, tf.float32) * _TWO32  # exact for hi < 2^24; hi rounded as in the sum
    idx = tf.where(u1 < 2.0**-8)  # hi < 2^24 (float32 represents these hi exactly)
    lo = tf.cast(draw_low(idx), tf.float32)
    hi_t = tf.gather_nd(u1, idx) * 2.0**32
    u1 = tf.tensor_scatter_nd_update(u1, idx, (hi_t + (lo + 0.5) * _TWO32) * _TWO32)
    return _polar(u1, angle, tf.float32, stddev)


def _polar(u1: tf.Tensor, angle: tf.Tensor, dtype: tf.DType, stddev: Any) -> tf.Tensor:
    """``r (cos theta, sin theta)`` with ``r = stddev sqrt(-2 ln u1)`` and the angle word.

    ``u1`` is capped at the largest float below 1 (the high words that round to 1.0 would give
    ``r = 0``, a pair of exact zeros), and the angle is the centre of its cell (never 0, where
    ``sin`` is exactly 0); see "Exact zeros" in the module docstring.
    """
    u1 = tf.minimum(u1, _BELOW_ONE[dtype])
    scale = _radius_scale(dtype, stddev)
    r = tf.sqrt(tf.math.log(u1) * scale)  # stddev folded into the radius: one pass fewer
    if dtype == tf.float32:
        # 23 angle bits: the cell centres (2k + 1) pi 2^-23, with 2k + 1 < 2^24 exact in float32
        k = tf.bitwise.right_shift(angle, 9)
        odd = tf.bitwise.bitwise_or(tf.bitwise.left_shift(k, 1), 1)
        theta = tf.cast(odd, dtype) * (math.pi * 2.0**-23)
    else:
        theta = (tf.cast(angle, dtype) + 0.5) * (2.0 * math.pi * _TWO32)
    return tf.concat([r * tf.cos(theta), r * tf.sin(theta)], axis=0)


def _radius_scale(dtype: tf.DType, stddev: Any) -> Any:
    """``-2 stddev^2`` in ``dtype`` (``r = sqrt(scale ln u1)``: stddev folded into the radius)."""
    if stddev is None:
        return tf.constant(-2.0, dtype)
    return -2.0 * tf.square(tf.cast(stddev, dtype))


#: The largest value below 1 of each dtype: the cap on ``u1`` in :func:`_polar`.
_BELOW_ONE = {tf.float32: 1.0 - 2.0**-24, tf.float64: 1.0 - 2.0**-53}


def add_gaussian_noise_structure(
    generator: tf.random.Generator, values: Any, stddevs: Any
) -> Any:
    """``values + N(0, stddev^2)`` leaf by leaf.

    Args:
      generator: the noise generator (see :func:`make_generator`).
      values: a structure of float tensors.
      stddevs: one scalar stddev for every leaf, or a structure of scalars matching ``values``.

    Float16/bfloat16 values get float32 noise (cast after scaling); float64 values float64
    noise. Large leaves (at least :data:`OWN_DRAW_SIZE` elements) get a draw each: drawing one
    flat vector and splitting it would copy all the noise. Small leaves of one dtype and stddev
    share a draw: a draw is a dozen ops, and per-op overhead dominates for small tensors.
    """
    leaves = [tf.convert_to_tensor(v) for v in tf.nest.flatten(values)]
    if tf.nest.is_nested(stddevs):
        tf.nest.assert_same_structure(values, stddevs)
        sds = tf.nest.flatten(stddevs)
    else:
        sds = [stddevs] * len(leaves)
    out: list[Any] = [None] * len(leaves)
    shared: dict[tuple, list[int]] = {}  # (dtype, stddev) -> small leaves
    for i, (v, sd) in enumerate(zip(leaves, sds)):
        nd = tf.float64 if v.dtype == tf.float64 else tf.float32
        n = v.shape.num_elements()
        if n is not None and n < OWN_DRAW_SIZE:
            shared.setdefault((nd, id(sd)), []).append(i)
            continue
        fused = _add_noise_natively(generator, v, sd)
        if fused is not None:
            out[i] = fused
            continue
        noise = tf.reshape(gaussian_noise(generator, _size(v), nd, sd), tf.shape(v))
        out[i] = v + tf.cast(noise, v.dtype)
    for (nd, _), idx in shared.items():
        sizes = [leaves[i].shape.num_elements() for i in idx]
        z = gaussian_noise(generator, sum(sizes), nd, sds[idx[0]])
        parts = [z] if len(idx) == 1 else tf.split(z, sizes)
        for i, part in zip(idx, parts):
            v = leaves[i]
            out[i] = v + tf.cast(tf.reshape(part, v.shape), v.dtype)
    return tf.nest.pack_sequence_as(values, out)


#: Leaves with at least this many elements get their own noise draw (see
#: :func:`add_gaussian_noise_structure`).
OWN_DRAW_SIZE = 1 << 16


def _size(t: tf.Tensor) -> Any:
    n = t.shape.num_elements()
    return n if n is not None else tf.size(t, out_type=tf.int64)


def add_gaussian_noise(generator: tf.random.Generator, value, stddev):
    """Returns ``value + N(0, stddev^2)`` elementwise (noise drawn in float32 or wider)."""
    return add_gaussian_noise_structure(generator, [value], stddev)[0]


# -- grid (snapped) noise ------------------------------------------------------------------------

#: Noise modes of the Gaussian sum queries (see :func:`add_grid_noise_structure`).
NOISE_MODES = ("grid", "continuous")

#: The noise mode of ``GaussianSumQuery`` and the DP optimizers unless one is given.
DEFAULT_NOISE_MODE = "continuous"

#: In grid mode the rounding adds at most ``2^-GRID_BITS`` of the clip to the sensitivity.
GRID_BITS = 10


def check_noise_mode(noise_mode: Any) -> str:
    """Returns ``noise_mode`` if it is one of :data:`NOISE_MODES`, else raises ``ValueError``."""
    if not isinstance(noise_mode, str) or noise_mode not in NOISE_MODES:
        raise ValueError(f"noise_mode must be one of {NOISE_MODES}, got {noise_mode!r}")
    return noise_mode


def num_coordinates(values: Any) -> Any:
    """The number ``d`` of coordinates of a structure of tensors (an int when shapes are known)."""
    sizes = [_size(tf.convert_to_tensor(v)) for v in tf.nest.flatten(values)]
    if all(isinstance(s, int) for s in sizes):
        return sum(sizes)
    return tf.add_n([tf.cast(s, tf.int64) for s in sizes])


def grid_spacing(l2_norm_clip: Any, dimension: Any) -> tf.Tensor:
    """The grid of grid-mode noise: the largest power of two ``g`` with
    ``g sqrt(d) <= C 2^-GRID_BITS`` (float64 scalar; exponent kept in ``[-126, 127]``).

    Example::

        grid_spacing(1.0, 4)   # 2^-11: 2^-11 * sqrt(4) <= 2^-10
    """
    bound = tf.cast(l2_norm_clip, tf.float64) * 2.0**-GRID_BITS / tf.sqrt(
        tf.cast(dimension, tf.float64))
    e = tf.clip_by_value(tf.floor(tf.math.log(tf.maximum(bound, 2.0**-126)) / math.log(2.0)),
                         -126.0, 127.0)
    g = tf.pow(tf.constant(2.0, tf.float64), e)
    # log2 rounding near a power of two: step to the exact largest power of two <= bound
    g = tf.where((g > bound) & (e > -126.0), g * 0.5, g)
    return tf.where((2.0 * g <= bound) & (e < 127.0), g * 2.0, g)


def grid_sensitivity(l2_sensitivity: Any, grid: Any, dimension: Any) -> tf.Tensor:
    """``Delta + g sqrt(d)`` (float64, rounded up): the L2 sensitivity of the rounded sum
    ``g round(s / g)`` when ``s`` has sensitivity ``Delta`` (each of the two rounded sums moves
    each of its ``d`` coordinates by at most ``g / 2``)."""
    extra = tf.cast(grid, tf.float64) * tf.sqrt(tf.cast(dimension, tf.float64))
    total = tf.cast(l2_sensitivity, tf.float64) + extra
    return tf.math.nextafter(total, tf.constant(math.inf, tf.float64))


def add_grid_noise_structure(
    generator: tf.random.Generator, values: Any, stddev: Any, grid: Any
) -> Any:
    """Grid-mode noise: ``s_g + g round(eta / g)`` leaf by leaf, with ``s_g = g round(s / g)``.

    Args:
      generator: the noise generator (see :func:`make_generator`).
      values: a structure of float tensors (the clipped sum ``s``).
      stddev: the noise stddev (a scalar).
      grid: the grid spacing ``g``, a power of two (see :func:`grid_spacing`).

    Everything is computed in float64 (``eta`` from the float64 sampler) and cast to each leaf's
    dtype at the end. Since ``s_g`` is on the grid, the output equals ``g round((s_g + eta) / g)``
    (ties aside, probability 0 for a continuous ``eta``): a function of the Gaussian mechanism's
    output ``s_g + eta`` alone, i.e. post-processing. Both terms are integer multiples of ``g``
    below ``2^53 g`` in magnitude, so their float64 sum is exact and its bits depend on ``s`` only
    through ``s_g``; the final cast is a function of that exact value. So the low bits of a
    released value carry nothing about ``s`` beyond ``s_g``, whose sensitivity is
    :func:`grid_sensitivity` (what the ledger records).

    Example::

        gen = make_generator()
        g = grid_spacing(1.0, 3)
        y = add_grid_noise_structure(gen, [tf.constant([0.6, 0.8, 0.0])], 1.1, g)
    """
    leaves = tf.nest.flatten(values)
    zeros = [tf.zeros(tf.shape(v), tf.float64) for v in leaves]
    etas = tf.nest.flatten(add_gaussian_noise_structure(generator, zeros, stddev))
    g = tf.cast(grid, tf.float64)
    out = []
    for v, eta in zip(leaves, etas):
        v = tf.convert_to_tensor(v)
        s_g = tf.round(tf.cast(v, tf.float64) / g) * g
        out.append(tf.cast(s_g + tf.round(eta / g) * g, v.dtype))
    return tf.nest.pack_sequence_as(values, out)


# -- noise drawn ahead for XLA-compiled steps ------------------------------------------------------


class PrefetchedNoise:
    """Standard normals drawn by TensorFlow's kernels, outside XLA, for the next XLA-compiled step.

    XLA's CPU backend runs this sampler 3-4x more slowly than TensorFlow's own kernels (the
    Philox words and the log/cos/sin alike; ``bench/README.md``, "Noise under XLA"), and a
    ``jit_compile=True`` step cannot call those kernels. Where tf_dp's native ops are built, the
    step calls the native sampler as an XLA custom call instead and this buffer is not used
    (:attr:`over_native`). Otherwise a continuous-mode Gaussian sum query
    traced under XLA reads ``stddev * z`` from a buffer ``current`` of standard normals, which
    :meth:`refill` fills between compiled calls (the Keras ``fit`` loop and
    :meth:`tf_dp.keras.DPTrainStep.flush` call it before each call).

    Draws. The normals come from :func:`gaussian_noise` (the same sampler, tails and counter
    discipline) on a generator of their own, ``generator.split(1)[0]`` (a Philox key derived
    from the query's generator, so seeded runs stay reproducible): the step's inline draws use
    the query's generator, and the two never share a state variable. By default
    (:attr:`background` False) :meth:`refill` draws straight into ``current`` when the last
    step consumed it. With :attr:`background` True it draws the *following* step's normals into
    a second buffer ``next`` in a background thread while the next compiled step runs (an XLA
    step reads and writes back the variables it uses as a whole, so the thread touches none of
    them), and :meth:`refill` first waits for that thread, then, if the step consumed
    ``current``, copies ``next`` into it and starts the next draw. That only pays where cores
    are idle during the step: on 2 CPU cores the thread competes with the step, and the MLP's
    XLA step took 10.96 ms with it against 9.64 ms drawing into ``current`` between the steps
    and 8.99 ms with no noise drawn at all (``python -m bench.step_time --model mlp
    --jit_compile --compare``, loaded machine, 2026-11-27), so it is off by default. Either way the draws serve the steps
    in the same order: the values do not depend on the choice.

    Each draw serves at most one step: ``ready`` is set when ``current`` is filled and cleared
    by the step that reads it; a step that finds it clear draws inline with XLA's sampler (the
    first call, ``steps_per_execution > 1``, a loop that does not refill). That costs speed,
    never privacy. The buffers hold future noise: like the generator's state they are secret;
    they are not model or optimizer variables and are never saved. Not used under
    ``tf.distribute`` (the noise is drawn in the replica step there).

    Example::

        gen = make_generator(seed=1)
        pre = PrefetchedNoise(gen)

        @tf.function(jit_compile=True)
        def noised(v):
            return pre.add_to([v], 1.1)[0]

        noised(tf.zeros([4]))   # traced: creates the buffers; this step draws inline
        pre.refill()            # outside XLA, between compiled calls
        noised(tf.zeros([4]))   # reads the buffer (times 1.1) and clears its flag
    """

    #: Default of :meth:`refill`'s ``background`` (see the class docstring).
    background = False

    #: Serve from the buffer also where tf_dp's native sampler runs inside XLA
    #: (:func:`tf_dp.dp_query.native.xla_available`). Default False: there the step draws its
    #: own noise with the native kernel as an XLA custom call, which depends on no other value
    #: of the step, so XLA runs it beside the forward and backward pass; the MLP's XLA step took
    #: 3.91-3.94 ms so against 4.17-4.22 ms with the buffer drawn between steps (``python -m
    #: bench.step_time --model mlp --jit_compile --compare``, alternating processes, 2-core AMD
    #: EPYC, 2026-11-29).
    over_native = False

    def __init__(self, generator: tf.random.Generator):
        self._generator = generator
        self._ahead: Optional[tf.random.Generator] = None  # the buffers' own generator
        self._size: Optional[int] = None  # the one flat size served (others draw inline)
        self._vars: Optional[tuple] = None  # (current, ready, served, next or None)
        self._next_valid = False
        self._thread: Any = None
        self._error: Optional[BaseException] = None
        self._fill = self._promote = self._fill_current = None

    @staticmethod
    def applies_to(values: Any) -> bool:
        """Whether :meth:`add_to` serves ``values``: traced under XLA, no distribution strategy,
        every leaf of a static shape and not float64, and tf_dp's native sampler not available
        inside XLA (unless :attr:`over_native`)."""
        if not _in_xla_context() or tf.distribute.has_strategy():
            return False
        if not PrefetchedNoise.over_native and native.xla_available():
            return False
        leaves = [tf.convert_to_tensor(v) for v in tf.nest.flatten(values)]
        return bool(leaves) and all(
            v.shape.num_elements() is not None and v.dtype != tf.float64 and v.dtype.is_floating
            for v in leaves
        )

    def add_to(self, values: Any, stddev: Any) -> Any:
        """``values + stddev * z`` leaf by leaf (``z`` from ``current``, or drawn inline with
        ``stddev`` folded in as :func:`add_gaussian_noise_structure` does when ``current`` is not
        ready). Call while tracing under XLA (:meth:`applies_to`)."""
        leaves = [tf.convert_to_tensor(v) for v in tf.nest.flatten(values)]
        sizes = [v.shape.num_elements() for v in leaves]
        n = sum(sizes)
        sd = tf.cast(stddev, tf.float32)
        if self._size is None:
            with tf.init_scope():
                self._ahead = self._generator.split(1)[0]
                zeros = tf.zeros([n], tf.float32)
                self._vars = (
                    tf.Variable(zeros, trainable=False, name="noise_ahead"),
                    tf.Variable(0, dtype=tf.int32, trainable=False, name="noise_ahead_ready"),
                    tf.Variable(0, dtype=tf.int64, trainable=False, name="noise_ahead_served"),
                    None,  # next: made by the first background refill
                )
                self._size = n
        if n != self._size:  # another shape than the one served: inline
            flat = gaussian_noise(self._generator, n, tf.float32, sd)
        else:
            current, ready, served, _ = self._vars
            use = ready.read_value() > 0
            # the prefetched normals are scaled after the conditional (an inline draw, which
            # folds ``sd`` in, is multiplied by exactly 1): XLA fuses the scaling into the
            # additions below instead of writing a scaled copy of the buffer in the branch
            flat = tf.cond(
                use,
                lambda: current.read_value(),
                lambda: gaussian_noise(self._generator, n, tf.float32, sd),
            ) * tf.where(use, sd, tf.constant(1.0, tf.float32))
            with tf.control_dependencies([flat]):
                ops = [ready.assign(0), served.assign_add(tf.cast(use, tf.int64))]
            with tf.control_dependencies(ops):
                flat = tf.identity(flat)
        parts = tf.split(flat, sizes) if len(sizes) > 1 else [flat]
        out = [v + tf.cast(tf.reshape(z, v.shape), v.dtype) for v, z in zip(leaves, parts)]
        return tf.nest.pack_sequence_as(values, out)

    def _fill_if_consumed(self) -> tf.Tensor:
        """Graph ops: draws into ``current`` unless it is still ready; whether it drew."""
        current, ready, _, _ = self._vars
        ahead, n = self._ahead, self._size

        def draw():
            with tf.control_dependencies([current.assign(gaussian_noise(ahead, n))]):
                with tf.control_dependencies([ready.assign(1)]):
                    return tf.constant(True)

        return tf.cond(ready.read_value() > 0, lambda: tf.constant(False), draw)

    def _functions(self) -> None:
        self._fill_current = tf.function(self._fill_if_consumed, jit_compile=False,
                                         autograph=False)

    def refill_in_graph(self) -> Optional[tf.Tensor]:
        """:meth:`refill` (``background=False``) as graph ops, for a function that calls the
        compiled step and is not compiled itself: placed after the step (automatic control
        dependencies order it after the step's read of ``current``), it draws the next step's
        noise without an eager call of its own. ``None`` (nothing) until a step was traced
        under XLA; a draw still waiting in ``next`` (an earlier background refill) is left
        there, to be promoted by a later :meth:`refill` once ``current`` is consumed."""
        if self._size is None or tf.executing_eagerly():
            return None
        return self._fill_if_consumed()

    def _background_functions(self) -> None:
        """The second buffer ``next`` and the functions that fill it and promote it."""
        current, ready, served, _ = self._vars
        ahead, n = self._ahead, self._size
        nxt = tf.Variable(tf.zeros([n], tf.float32), trainable=False, name="noise_ahead_next")
        self._vars = (current, ready, served, nxt)

        @tf.function(jit_compile=False, autograph=False)
        def fill():
            nxt.assign(gaussian_noise(ahead, n))

        @tf.function(jit_compile=False, autograph=False)
        def promote():
            def copy():
                with tf.control_dependencies([current.assign(nxt.read_value())]):
                    with tf.control_dependencies([ready.assign(1)]):
                        return tf.constant(True)

            return tf.cond(ready.read_value() > 0, lambda: tf.constant(False), copy)

        self._fill, self._promote = fill, promote

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            self._next_valid = True

    def _draw_next_in_background(self) -> None:
        def run():
            try:
                self._fill()
            except BaseException as e:  # re-raised by the next refill
                self._error = e

        self._thread = threading.Thread(target=run, name="tf_dp_noise_ahead", daemon=True)
        _BACKGROUND_DRAWS.add(self._thread)
        self._thread.start()

    def refill(self, background: Optional[bool] = None) -> None:
        """Makes ``current`` ready for the next compiled step (eager, between compiled calls).

        ``background`` False (the default, :attr:`background`): draws into ``current`` if the
        last step consumed it (a draw already waiting in ``next`` is used first). True: waits for
        the background draw of ``next`` (or draws it), copies it into ``current`` if the last
        step consumed ``current``, and then draws a new ``next`` in a background thread. A
        ``current`` still ready is kept: nothing is drawn twice for one step. A no-op until a
        step was traced under XLA."""
        if self._size is None:
            return
        if self._fill_current is None:
            self._functions()
        if background is None:
            background = self.background
        self._wait()
        if background and self._fill is None:
            self._background_functions()
        if not background:
            if self._next_valid:  # drawn ahead by an earlier background refill: its turn first
                if bool(self._promote()):
                    self._next_valid = False
            else:
                self._fill_current()
            return
        if not self._next_valid:
            self._fill()
            self._next_valid = True
        if bool(self._promote()):
            self._next_valid = False
            self._draw_next_in_background()

    def wait(self) -> None:
        """Waits for a background draw (e.g. before reading the generators' states)."""
        self._wait()

    @property
    def served(self) -> int:
        """How many steps have read a prefetched buffer (eager)."""
        return 0 if self._vars is None else int(self._vars[2].numpy())


#: Background draws still running; joined at interpreter exit (a TensorFlow kernel must not be
#: left running in a thread while the interpreter shuts down).
_BACKGROUND_DRAWS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


@atexit.register
def _join_background_draws() -> None:
    for thread in list(_BACKGROUND_DRAWS):
        thread.join(timeout=60.0)
