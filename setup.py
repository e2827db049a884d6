"""Installs tf_dp: differentially private training for TensorFlow / Keras 3."""

import pathlib

from setuptools import find_packages, setup

HERE = pathlib.Path(__file__).parent

setup(
    name="tf_dp",
    version="0.1.0",
    description=(
        "Differentially private training (DP-SGD, DP-Adam, JL and ghost clipping) for "
        "TensorFlow / Keras 3, with a privacy ledger and tight accountants."
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["tf_dp", "tf_dp.*"]),
    # the native noise op's source, compiled on first use (tf_dp/dp_query/native)
    package_data={"tf_dp.dp_query.native": ["*.cc"]},
    install_requires=[
        "tensorflow>=2.16,<2.22",
        "keras>=3.0,<4",
        "numpy>=1.26,<3",
        "scipy>=1.11,<2",
        "absl-py>=1.4,<3",
    ],
    extras_require={
        # tf_dp.accounting.dp_events.ledger_to_dp_event (dp_accounting interoperability)
        "accounting": ["dp-accounting>=0.4,<0.7"],
        # tf_dp.data's file sources: HDF5, ArrayRecord, TFRecord (CRC-32C checks)
        "data": ["h5py>=3.8", "array-record>=0.5", "google-crc32c>=1.5"],
        "test": [
            "pytest>=7.4",
            # README's test command runs the suite in two processes (-n 2): most of a test's
            # time is single-threaded Python (tracing, Keras), so one process leaves a core idle
            # (2-core AMD EPYC, 2026-11-28: 50 min in one process, 36 min in two)
            "pytest-xdist>=3.5",
            # tests/test_data_sources.py (the "data" extra)
            "h5py>=3.8",
            "array-record>=0.5",
            "google-crc32c>=1.5",
            "dp-accounting>=0.4,<0.7",
            "scikit-learn>=1.3",
            "ruff>=0.5",
            # tests/test_api_reference.py builds the API reference (docs/build_api.py)
            "pdoc>=14",
            # tests/test_notebooks.py executes tutorials/*.ipynb (which plot with matplotlib)
            "nbclient>=0.7",
            "nbformat>=5.7",
            "ipykernel>=6.0",
            "matplotlib>=3.7",
            # tests/test_bad_input_more.py checks that another Keras backend is refused
            "jax>=0.4",
            # tests/test_reload_ledger.py and tests/test_finetuning.py build keras-hub models
            # from tiny configs (random init, no download)
            "keras-hub>=0.32,<0.33",
            # tests/test_callbacks.py writes and reads TensorBoard event files (TF 2.21 no longer
            # depends on tensorboard; keras.callbacks.TensorBoard needs it)
            "tensorboard>=2.16",
        ],
        "tutorials": [
            "matplotlib>=3.7",
            "scikit-learn>=1.3",
            # tutorials/dp_finetuning.ipynb (keras-hub models; its tokenizers on Colab)
            "keras-hub>=0.32,<0.33",
            # keras.callbacks.TensorBoard with tf_dp.keras.PrivacyReport (docs/keras.md)
            "tensorboard>=2.16",
        ],
    },
    entry_points={
        "console_scripts": [
            "compute_dp_sgd_privacy=tf_dp.cli.compute_dp_sgd_privacy:run",
            "compute_noise_from_budget=tf_dp.cli.compute_noise_from_budget:run",
        ],
    },
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
