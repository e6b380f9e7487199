"""The research tests use tests/conftest.py's helpers and its autouse fixtures (default dtype restored, seed 0)."""

from conftest import _restore_default_dtype, _seed  # noqa: F401  (tests/ is on pytest's pythonpath, setup.cfg)
