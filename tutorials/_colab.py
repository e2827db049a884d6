"""Where the tutorial notebooks live on GitHub: the one place to change the repository's URL.

``tutorials/_build_notebooks.py`` writes every notebook's "Open in Colab" badge and its set-up
cell (``pip install`` of the repository) from these constants, and ``tests/test_notebooks.py``
checks that every stored notebook matches them. After changing a constant, run
``python tutorials/_build_notebooks.py`` to rewrite the notebooks.
"""

#: ``owner/name`` of the project's GitHub repository.
GITHUB_REPOSITORY = "tf-dp/tf_dp"

#: Branch the badges open and the set-up cell installs from.
BRANCH = "main"

REPOSITORY_URL = f"https://github.com/{GITHUB_REPOSITORY}"
COLAB_BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"


def colab_url(notebook_filename: str) -> str:
    """The Colab link of ``tutorials/<notebook_filename>`` on :data:`BRANCH`."""
    return (
        f"https://colab.research.google.com/github/{GITHUB_REPOSITORY}/blob/{BRANCH}/"
        f"tutorials/{notebook_filename}"
    )


def badge_markdown(notebook_filename: str) -> str:
    """The markdown of the "Open in Colab" badge for one notebook."""
    return f"[![Open In Colab]({COLAB_BADGE_IMAGE})]({colab_url(notebook_filename)})"


def pip_requirement() -> str:
    """What the set-up cell installs on Colab: the repository's :data:`BRANCH`, with the
    ``tutorials`` extra (matplotlib)."""
    return f"tf_dp[tutorials] @ git+{REPOSITORY_URL}.git@{BRANCH}"
