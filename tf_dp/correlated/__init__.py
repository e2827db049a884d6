"""Correlated noise across steps (DP matrix factorization): banded (BandMF), buffered linear
Toeplitz (BLT) and the tree as one family.

``strategies`` (numpy) holds the strategy matrices ``C`` and their noise recurrences;
``noise_tf`` runs a recurrence in TensorFlow (:class:`CorrelatedNoiseSumQuery`).
"""
