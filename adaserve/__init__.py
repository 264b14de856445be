"""adaserve: multi-SLO LLM serving with SLO-customized speculative decoding."""

# The one version: pyproject.toml reads it (dynamic), `adaserve --version` prints it,
# and CHANGELOG.md's newest release heading names it (tests/test_version.py).
__version__ = "0.8.0"
