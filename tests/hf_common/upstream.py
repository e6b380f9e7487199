"""Where the repository-only transformers test modules come from (see ``__init__.py``)."""

import os
from pathlib import Path


ENV_VAR = "TRANSFORMERS_TESTS_DIR"


def tests_dir() -> Path | None:
    """The ``tests/`` folder of a transformers checkout named by ``$TRANSFORMERS_TESTS_DIR``, or None."""
    value = os.environ.get(ENV_VAR)
    if not value:
        return None
    path = Path(value).expanduser().resolve()
    if not (path / "generation" / "test_utils.py").is_file():
        raise FileNotFoundError(
            f"${ENV_VAR}={value} is not the tests/ folder of a transformers checkout (no generation/test_utils.py)."
        )
    return path


def extend_path(package_path: list, subfolder: str) -> bool:
    """Put the checkout's ``tests/<subfolder>`` first on a sub-package's ``__path__``; True when it was found."""
    root = tests_dir()
    if root is None:
        return False
    package_path.insert(0, str(root / subfolder))
    return True


def upstream_module(module) -> bool:
    """Whether ``module`` was loaded from the transformers checkout (and not from our stand-in)."""
    root = tests_dir()
    return root is not None and Path(module.__file__).resolve().is_relative_to(root)


def alias_tests_package():
    """Make ``tests.exporters.test_export`` name our ``hf_common.exporters.test_export`` (the checkout's file)."""
    import importlib
    import sys

    package = importlib.import_module(__package__)
    exporters = importlib.import_module(f"{__package__}.exporters")
    test_export = importlib.import_module(f"{__package__}.exporters.test_export")
    sys.modules.setdefault("tests", package)
    sys.modules.setdefault("tests.exporters", exporters)
    sys.modules.setdefault("tests.exporters.test_export", test_export)
