"""Bazel entry point for the test targets in BUILD: runs pytest on the files given as arguments.

A test file run directly as a script would define its tests and exit without running them; this
runner makes every ``py_test`` target actually run (and fail) its tests.
"""

import sys

import pytest

if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
