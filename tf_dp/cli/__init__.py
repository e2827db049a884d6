"""Command-line tools (absl flags): ``compute_dp_sgd_privacy`` and ``compute_noise_from_budget``.

Both import only the accounting package (no TensorFlow), so they start fast.
"""
