"""The research tests use tests/conftest.py's helpers, its autouse fixtures (default dtype restored, seed 0) and its
``pytest_configure`` (torch and the package imported, one intra-op thread), also when research/tests/ runs alone."""

from conftest import _restore_default_dtype, _seed, pytest_configure  # noqa: F401  (tests/ is on pytest's pythonpath)
