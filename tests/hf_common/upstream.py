"""Where the repository-only transformers test modules come from (see ``__init__.py`` and ``fetch.py``)."""

import functools
import os
from pathlib import Path


ENV_VAR = "TRANSFORMERS_TESTS_DIR"


@functools.cache
def _source() -> tuple[Path | None, str]:
    """The repository's ``tests/`` folder and where it came from, or None and why there is none."""
    value = os.environ.get(ENV_VAR)
    if value:
        path = Path(value).expanduser().resolve()
        if not (path / "generation" / "test_utils.py").is_file():
            raise FileNotFoundError(
                f"${ENV_VAR}={value} is not the tests/ folder of a transformers checkout (no generation/test_utils.py)."
            )
        return path, f"${ENV_VAR}"
    from . import fetch

    try:
        return fetch.repository_tests().resolve(), "the fetched tag archive"
    except fetch.Unavailable as error:
        return None, str(error)


def tests_dir() -> Path | None:
    """The repository's ``tests/`` folder: ``$TRANSFORMERS_TESTS_DIR`` when set, else the tag archive of the installed
    version fetched into the test cache (``fetch.repository_tests``); None when neither can be had."""
    return _source()[0]


def unavailable_reason() -> str:
    """Why ``tests_dir()`` is None (empty when it is not)."""
    path, why = _source()
    return "" if path is not None else why


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
