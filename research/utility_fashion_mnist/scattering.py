"""A 2-D scattering transform (Mallat 2012; Bruna & Mallat 2013) in TensorFlow, for fixed,
data-independent image features.

For a 28x28 image, ``J = 2`` scales and ``L = 8`` orientations give 81 channels of 7x7:

* order 0: ``x * phi`` (1 channel),
* order 1: ``|x * psi_{j, theta}| * phi`` (J L = 16 channels),
* order 2: ``||x * psi_{j1, theta1}| * psi_{j2, theta2}| * phi`` for ``j1 < j2``
  (L^2 J (J - 1) / 2 = 64 channels),

each low-passed by a Gaussian ``phi`` of width ``0.8 * 2^(J - 1)`` and subsampled by ``2^J``.
The wavelets are Morlet wavelets (a Gabor filter minus a multiple of its Gaussian envelope, so
that it has zero mean) of width ``0.8 * 2^j`` along their direction ``theta`` and
``0.8 * 2^j / slant`` across it (slant ``4 / L``: elongated along the wave crests), centre
frequency ``3 pi / 4 / 2^j``, built in the spatial domain, periodised on the grid padded by
``2^J`` on each side, and applied by FFT. These are the filter choices of the Kymatio library
(Andreux et al. 2020), whose features Tramer & Boneh use; on Fashion-MNIST this implementation's
81 channels have correlation >= 0.9998 with Kymatio 0.3's (checked once, outside the tests).

Nothing here is learned or fitted to data: the features of one image depend on that image only,
so they cost no privacy (Tramer & Boneh 2021, "Differentially private learning needs better
features (or much more data)", use such features for DP-SGD).

Example::

    feats = scattering_features(images)   # [n, 28, 28] floats in [0, 1] -> [n, 81, 7, 7]
"""

from __future__ import annotations

import math

import numpy as np



def _gabor(n: int, sigma: float, theta: float, xi: float, slant: float) -> np.ndarray:
    """Periodised Gabor filter on an ``n x n`` grid (complex), and its Gaussian envelope."""
    c, s = math.cos(theta), math.sin(theta)
    rot = np.array([[c, -s], [s, c]])
    # quadratic form of the envelope: 1 / sigma^2 along theta, slant^2 / sigma^2 across it
    inv = rot @ np.diag([1.0, slant**2]) @ rot.T / (2 * sigma**2)
    gab = np.zeros((n, n), np.complex128)
    env = np.zeros((n, n), np.float64)
    coords = np.arange(n)
    for ex in (-2, -1, 0, 1, 2):  # periodisation: sum of shifted copies (offsets -2n .. 2n)
        for ey in (-2, -1, 0, 1, 2):
            xx, yy = np.meshgrid(coords + ex * n, coords + ey * n, indexing="ij")
            quad = inv[0, 0] * xx * xx + (inv[0, 1] + inv[1, 0]) * xx * yy + inv[1, 1] * yy * yy
            g = np.exp(-quad)
            env += g
            gab += g * np.exp(1j * xi * (xx * c + yy * s))
    norm = 2 * math.pi * sigma**2 / slant
    return gab / norm, env / norm


def filter_bank(n: int, J: int = 2, L: int = 8):
    """Fourier transforms of the low-pass ``phi`` ``[n, n]`` and the Morlet wavelets
    ``psi[j][l]`` ``[n, n]`` (``j < J``, ``l < L``)."""
    slant = 4.0 / L
    _, phi = _gabor(n, 0.8 * 2 ** (J - 1), 0.0, 0.0, 1.0)
    psi = []
    for j in range(J):
        row = []
        for l in range(L):
            theta = (int(L - L / 2 - 1) - l) * math.pi / L
            gab, env = _gabor(n, 0.8 * 2**j, theta, 3 * math.pi / 4 / 2**j, slant)
            morlet = gab - (gab.sum() / env.sum()) * env  # zero mean
            row.append(np.fft.fft2(morlet))
        psi.append(row)
    return np.real(np.fft.fft2(phi)), psi


def scattering_features(images: np.ndarray, J: int = 2, L: int = 8,
                        batch_size: int = 500) -> np.ndarray:
    """Scattering coefficients of ``images`` ``[n, H, W]`` (H, W multiples of ``2^J``):
    ``[n, 1 + J L + L^2 J (J - 1) / 2, H / 2^J, W / 2^J]`` float32."""
    import tensorflow as tf

    images = np.asarray(images, np.float32)
    if images.ndim != 3 or images.shape[1] % 2**J or images.shape[2] % 2**J:
        raise ValueError(f"images must be [n, H, W] with H, W multiples of 2^J, got "
                         f"{images.shape}")
    h, w = images.shape[1:]
    pad = 2**J  # reflection padding on each side (28 -> 36 for J = 2)
    n = max(h, w) + 2 * pad
    phi_hat, psi_hat = filter_bank(n, J, L)
    phi_t = tf.constant(phi_hat.astype(np.complex64))
    psi_t = tf.constant(np.array(psi_hat).astype(np.complex64))  # [J, L, n, n]
    step = 2**J

    def lowpass(u):  # u [..., n, n] real -> cropped, subsampled [..., h/2^J, w/2^J]
        out = tf.math.real(tf.signal.ifft2d(tf.signal.fft2d(tf.cast(u, tf.complex64)) * phi_t))
        return out[..., pad:pad + h:step, pad:pad + w:step]

    @tf.function
    def batch(x):
        x = tf.pad(x, [[0, 0], [pad, n - h - pad], [pad, n - w - pad]], mode="REFLECT")
        xh = tf.signal.fft2d(tf.cast(x, tf.complex64))  # [b, n, n]
        out = [lowpass(x)[:, None]]
        first = []
        for j1 in range(J):
            u1 = tf.abs(tf.signal.ifft2d(xh[:, None] * psi_t[j1][None]))  # [b, L, n, n]
            first.append(u1)
            out.append(lowpass(u1))
        for j1 in range(J):
            u1h = tf.signal.fft2d(tf.cast(first[j1], tf.complex64))  # [b, L, n, n]
            for j2 in range(j1 + 1, J):
                u2 = tf.abs(tf.signal.ifft2d(u1h[:, :, None] * psi_t[j2][None, None]))
                out.append(tf.reshape(lowpass(u2), [tf.shape(x)[0], L * L, h // step,
                                                    w // step]))
        return tf.concat(out, axis=1)

    parts = [batch(tf.constant(images[i:i + batch_size])).numpy()
             for i in range(0, len(images), batch_size)]
    return np.concatenate(parts).astype(np.float32)


def group_normalize(features: np.ndarray, groups: int = 27, eps: float = 1e-5) -> np.ndarray:
    """Per-example group normalisation of ``[n, C, H, W]`` features: each example's channels in
    ``groups`` consecutive groups, each group shifted and scaled to mean 0 and variance 1 over
    its values. One example's output depends on that example only (no privacy cost)."""
    n, c, hh, ww = features.shape
    if c % groups:
        raise ValueError(f"groups must divide the {c} channels, got {groups}")
    f = features.reshape(n, groups, -1)
    f = (f - f.mean(axis=2, keepdims=True)) / np.sqrt(f.var(axis=2, keepdims=True) + eps)
    return f.reshape(n, c, hh, ww).astype(np.float32)
