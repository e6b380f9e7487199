"""transformers' own test files for the installed transformers version, fetched at test time and cached.

This repository carries no copy of them (issue #33). Two sources, both for ``transformers.__version__``:

* the source release on the package index: ``tests/test_modeling_common.py`` and ``tests/test_configuration_common.py``
  (``ModelTesterMixin``, ``ConfigTester``), taken from ``transformers-<version>.tar.gz`` as ``pip download`` gets it
  (so pip's own index, proxy and certificate settings apply);
* the repository at tag ``v<version>``: ``tests/generation/`` (``GenerationTesterMixin``) and ``tests/exporters/``
  (``ExportTesterMixin``), which the source release does not contain, from GitHub's tag archive.

Both land in ``$BST_TEST_CACHE`` (default ``~/.cache/bst-tests``), under ``transformers-<version>/``: ``tests/`` and
``repository-tests/``. A cached copy is used without any network access; each is extracted into a temporary folder
and renamed into place, so a folder that exists is complete. ``BST_NO_FETCH=1`` uses the cache only. A failed
repository download is remembered for a day (``repository-tests.failed``; delete it to retry sooner).

Populate the cache by hand (e.g. before going offline): ``python tests/hf_common/fetch.py [version]``.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path, PurePosixPath


CACHE_ENV = "BST_TEST_CACHE"
NO_FETCH_ENV = "BST_NO_FETCH"
# The repository archive's address; ``{version}`` is filled in (a file:// address works too, e.g. in tests).
ARCHIVE_URL_ENV = "BST_TRANSFORMERS_ARCHIVE_URL"
ARCHIVE_URL = "https://github.com/huggingface/transformers/archive/refs/tags/v{version}.tar.gz"

# Files of the source release's tests/ folder that tests/models/bst/test_hf_common.py imports (LICENSE: the release's licence).
SDIST_FILES = ("test_modeling_common.py", "test_configuration_common.py")
# test_configuration_common.py runs ``direct_transformers_import(Path(__file__).parent)``, which executes the folder's
# __init__.py (the repository's tests/__init__.py is empty; the release has none): an empty one is written next to it.
INIT_FILE = "__init__.py"
# Folders of the repository's tests/ that the source release lacks and test_modeling_common.py imports from.
REPOSITORY_FOLDERS = ("generation", "exporters")

PIP_TIMEOUT_S = 600
ARCHIVE_TIMEOUT_S = 20
FAILED_RETRY_S = 24 * 3600


class Unavailable(Exception):
    """The files cannot be had (not cached, and fetching is disabled or failed); the message says why and what to do."""


def installed_version() -> str:
    import transformers

    return transformers.__version__


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/bst-tests").expanduser()


def version_dir(version: str) -> Path:
    return cache_root() / f"transformers-{version}"


def fetch_disabled() -> bool:
    return os.environ.get(NO_FETCH_ENV, "").strip().lower() not in ("", "0", "false", "no")


def pip_command(version: str, dest: str | Path) -> list[str]:
    """``pip download`` of the source release alone: no dependencies, no wheel of transformers. pip still reads the
    release's metadata (setuptools' egg_info); with setuptools installed it does so without a build environment."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "transformers"]
    command += ["--disable-pip-version-check", "--progress-bar", "off"]
    if _has_setuptools():
        command.append("--no-build-isolation")
    return command + [f"transformers=={version}", "-d", str(dest)]


def sdist_tests(version: str | None = None) -> Path:
    """The folder holding transformers ``version``'s ``SDIST_FILES`` (default: the installed version); fetched from the
    package index on first use. Raises ``Unavailable`` when it is not cached and cannot be fetched."""
    version = version or installed_version()
    target = version_dir(version) / "tests"
    if _complete(target):
        return target
    how = f"`python tests/hf_common/fetch.py {version}` with access to the package index"
    if fetch_disabled():
        raise Unavailable(
            f"transformers {version}'s test files ({', '.join(SDIST_FILES)}) are not cached in {target} and "
            f"{NO_FETCH_ENV} is set; fetch them with {how} (see docs/hf-common-tests.md)"
        )
    work = _workdir(version)
    try:
        download = work / "download"
        command = pip_command(version, download)
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise Unavailable(_sdist_failure(version, repr(error), how)) from error
        archives = sorted(download.glob("transformers-*.tar.gz"))
        if run.returncode != 0 or not archives:
            detail = (run.stderr or run.stdout).strip().splitlines()[-3:]
            raise Unavailable(_sdist_failure(version, " / ".join(detail) or f"exit {run.returncode}", how))
        extracted = work / "tests"
        found = _extract(
            archives[0], extracted, {"LICENSE": "LICENSE", **{f"tests/{name}": name for name in SDIST_FILES}}
        )
        missing = [name for name in SDIST_FILES if name not in found]
        if missing:
            raise Unavailable(f"{archives[0].name} has no tests/{', tests/'.join(missing)}: not a usable release")
        (extracted / INIT_FILE).write_text("")
        _write_source(extracted, archives[0], " ".join(command[1:-2]))
        return _publish(extracted, target, _complete)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def repository_tests(version: str | None = None) -> Path:
    """A ``tests/`` folder with the repository's ``REPOSITORY_FOLDERS`` at tag ``v<version>`` (default: the installed
    version), from GitHub's tag archive on first use. Raises ``Unavailable`` when it cannot be had."""
    version = version or installed_version()
    target = version_dir(version) / "repository-tests"
    if _repository_complete(target):
        return target
    url = os.environ.get(ARCHIVE_URL_ENV, ARCHIVE_URL).format(version=version)
    if fetch_disabled():
        raise Unavailable(
            f"transformers v{version}'s repository tests are not cached in {target} and {NO_FETCH_ENV} is set"
        )
    failed = target.with_name("repository-tests.failed")
    if failed.is_file() and time.time() - failed.stat().st_mtime < FAILED_RETRY_S:
        raise Unavailable(f"{failed.read_text().strip()} (cached failure: delete {failed} to retry now)")
    work = _workdir(version)
    try:
        archive = work / "repository.tar.gz"
        try:
            with urllib.request.urlopen(url, timeout=ARCHIVE_TIMEOUT_S) as response, open(archive, "wb") as out:
                shutil.copyfileobj(response, out)
            extracted = work / "repository-tests"
            wanted = {f"tests/{folder}/": f"{folder}/" for folder in REPOSITORY_FOLDERS}
            _extract(archive, extracted, wanted)
        except (OSError, tarfile.TarError, ValueError) as error:
            reason = f"could not fetch transformers v{version}'s repository tests from {url}: {error!r}"
            failed.write_text(reason + "\n")
            raise Unavailable(reason) from error
        if not _repository_complete(extracted):
            raise Unavailable(f"{url} has no tests/generation/test_utils.py")
        _write_source(extracted, archive, url)
        failed.unlink(missing_ok=True)
        return _publish(extracted, target, _repository_complete)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def attach_sdist_tests(package_path: list, version: str | None = None) -> Path:
    """Put the source release's test files behind a package's own folder on its ``__path__`` (so that
    ``<package>.test_modeling_common`` is the release's file and its relative imports find the package's
    sub-packages); returns the folder. Raises ``Unavailable`` like ``sdist_tests``."""
    folder = str(sdist_tests(version))
    if folder not in package_path:
        package_path.append(folder)
    return Path(folder)


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in SDIST_FILES + (INIT_FILE,))


def _repository_complete(folder: Path) -> bool:
    return (folder / "generation" / "test_utils.py").is_file() and (folder / "exporters").is_dir()


def _has_setuptools() -> bool:
    import importlib.util

    return importlib.util.find_spec("setuptools") is not None


def _sdist_failure(version, detail, how) -> str:
    return (
        f"transformers {version}'s test files ({', '.join(SDIST_FILES)}) are not cached in {version_dir(version) / 'tests'} "
        f"and could not be fetched from the package index (pip download failed: {detail}); run {how} "
        "(docs/hf-common-tests.md)"
    )


def _workdir(version: str) -> Path:
    parent = version_dir(version)
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".partial-", dir=parent))


def _extract(archive: Path, dest: Path, wanted: dict[str, str]) -> set[str]:
    """Copy the archive's members that ``wanted`` names by their path below the archive's top folder (a file,
    ``"tests/x.py": "x.py"``, or a folder, ``"tests/generation/": "generation/"``) to ``dest``; returns the names
    written. Regular files only, and no name with ``..``: nothing is written outside ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    written = set()
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            parts = PurePosixPath(member.name).parts
            if not member.isfile() or len(parts) < 2:
                continue
            inner = "/".join(parts[1:])
            for source, name in wanted.items():
                if source.endswith("/") and inner.startswith(source):
                    name = name + inner[len(source) :]
                elif inner != source:
                    continue
                if ".." in PurePosixPath(name).parts:
                    continue
                path = dest / name
                path.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as data, open(path, "wb") as out:
                    shutil.copyfileobj(data, out)
                written.add(name)
                break
    return written


def _write_source(folder: Path, archive: Path, origin: str):
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    (folder / "SOURCE").write_text(f"{origin}\n{archive.name} sha256 {digest}\n")


def _publish(extracted: Path, target: Path, complete) -> Path:
    """Rename the finished folder into place; if another process got there first, keep its (complete) copy."""
    try:
        os.rename(extracted, target)
    except OSError:
        if not complete(target):
            shutil.rmtree(target, ignore_errors=True)
            os.rename(extracted, target)
    return target


if __name__ == "__main__":
    chosen = sys.argv[1] if len(sys.argv) > 1 else None
    print("source release tests:", sdist_tests(chosen))
    try:
        print("repository tests:", repository_tests(chosen))
    except Unavailable as error:
        print("repository tests: not available:", error)
