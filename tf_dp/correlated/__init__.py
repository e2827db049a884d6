"""Correlated noise across steps (DP matrix factorization): banded (BandMF), buffered linear
Toeplitz (BLT) and the tree as one family.

``strategies`` (numpy) holds the strategy matrices ``C`` and their noise recurrences;
``noise_tf`` runs a recurrence in TensorFlow (:class:`CorrelatedNoiseSumQuery`).
"""

from tf_dp import _compat as _ag_compat  # noqa: E402

_ag_compat.exclude_from_autograph()  # tf_dp's code is traced as written, not by AutoGraph
