"""The fetcher of transformers' test files (tests/hf_common/fetch.py): cache use, offline skip reasons, extraction.

No network: the package index is replaced by a fake ``pip download`` that writes a small tarball, and the repository
archive by a file:// address.
"""

import io
import subprocess
import tarfile
import urllib.request
from pathlib import Path

import pytest
from hf_common import fetch


VERSION = "9.9.9"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(fetch.CACHE_ENV, str(root))
    monkeypatch.delenv(fetch.NO_FETCH_ENV, raising=False)
    monkeypatch.delenv(fetch.ARCHIVE_URL_ENV, raising=False)
    return root


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[:1]}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)


def make_tarball(path, top, files):
    """A .tar.gz with ``files`` ({name below top: text}) under the folder ``top``."""
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}" if top else name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def populate(root, version=VERSION, names=fetch.SDIST_FILES + (fetch.INIT_FILE,)):
    folder = root / f"transformers-{version}" / "tests"
    folder.mkdir(parents=True)
    for name in names:
        (folder / name).write_text(f"# {name}\n")
    return folder


def fake_pip(monkeypatch, files, calls, returncode=0):
    """Replace ``subprocess.run`` by a ``pip download`` that writes an sdist of ``files`` into its -d folder."""

    def run(command, **kwargs):
        calls.append(command)
        if returncode == 0:
            dest = Path(command[command.index("-d") + 1])
            dest.mkdir(parents=True, exist_ok=True)
            make_tarball(dest / f"transformers-{VERSION}.tar.gz", f"transformers-{VERSION}", files)
        return subprocess.CompletedProcess(command, returncode, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(subprocess, "run", run)


def test_cached_copy_used_without_network(cache, no_network, monkeypatch):
    folder = populate(cache)
    monkeypatch.setenv(fetch.NO_FETCH_ENV, "1")
    assert fetch.sdist_tests(VERSION) == folder
    monkeypatch.delenv(fetch.NO_FETCH_ENV)
    assert fetch.sdist_tests(VERSION) == folder  # a cached copy is used even where fetching is allowed


def test_missing_cache_with_no_fetch_names_version_and_command(cache, no_network, monkeypatch):
    monkeypatch.setenv(fetch.NO_FETCH_ENV, "1")
    with pytest.raises(fetch.Unavailable) as error:
        fetch.sdist_tests(VERSION)
    message = str(error.value)
    assert f"transformers {VERSION}" in message
    assert f"python tests/hf_common/fetch.py {VERSION}" in message
    assert fetch.NO_FETCH_ENV in message
    assert not (cache / f"transformers-{VERSION}" / "tests").exists()


def test_incomplete_cache_is_not_used(cache, no_network, monkeypatch):
    populate(cache, names=fetch.SDIST_FILES[:1])
    monkeypatch.setenv(fetch.NO_FETCH_ENV, "1")
    with pytest.raises(fetch.Unavailable):
        fetch.sdist_tests(VERSION)


def test_no_fetch_values(monkeypatch):
    for value, disabled in [("1", True), ("yes", True), ("0", False), ("", False)]:
        monkeypatch.setenv(fetch.NO_FETCH_ENV, value)
        assert fetch.fetch_disabled() is disabled, value


def test_pip_command_gets_the_source_release_only():
    command = fetch.pip_command("5.23.0", "/somewhere")
    assert command[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in command
    assert command[command.index("--no-binary") + 1] == "transformers"
    assert command[-3:] == ["transformers==5.23.0", "-d", "/somewhere"]


def test_fetch_extracts_the_files_once(cache, monkeypatch):
    files = {f"tests/{name}": f"# {name} of the release\n" for name in fetch.SDIST_FILES}
    files.update({"tests/test_pipeline_mixin.py": "# not wanted\n", "LICENSE": "Apache\n", "setup.py": "#\n"})
    calls = []
    fake_pip(monkeypatch, files, calls)
    folder = fetch.sdist_tests(VERSION)
    assert folder == cache / f"transformers-{VERSION}" / "tests"
    assert sorted(p.name for p in folder.iterdir()) == sorted(["LICENSE", "SOURCE", "__init__.py", *fetch.SDIST_FILES])
    assert (folder / "test_modeling_common.py").read_text() == "# test_modeling_common.py of the release\n"
    assert (folder / "__init__.py").read_text() == ""
    assert f"transformers=={VERSION}" in (folder / "SOURCE").read_text()
    assert [p.name for p in folder.parent.iterdir() if p.name.startswith(".partial")] == []
    assert len(calls) == 1
    assert fetch.sdist_tests(VERSION) == folder
    assert len(calls) == 1  # the second call reads the cache


def test_failed_pip_gives_reason_and_leaves_no_cache(cache, monkeypatch):
    calls = []
    fake_pip(monkeypatch, {}, calls, returncode=1)
    with pytest.raises(fetch.Unavailable) as error:
        fetch.sdist_tests(VERSION)
    assert f"transformers {VERSION}" in str(error.value)
    assert "No matching distribution" in str(error.value)
    assert list((cache / f"transformers-{VERSION}").iterdir()) == []


def test_release_without_the_files_is_refused(cache, monkeypatch):
    fake_pip(monkeypatch, {"tests/test_modeling_common.py": "#\n"}, [])
    with pytest.raises(fetch.Unavailable, match="test_configuration_common.py"):
        fetch.sdist_tests(VERSION)
    assert not (cache / f"transformers-{VERSION}" / "tests").exists()


def test_attach_puts_the_cache_after_the_package(cache, no_network):
    folder = populate(cache)
    package_path = ["/our/hf_common"]
    assert fetch.attach_sdist_tests(package_path, VERSION) == folder
    fetch.attach_sdist_tests(package_path, VERSION)
    assert package_path == ["/our/hf_common", str(folder)]


def test_repository_archive_extracts_generation_and_exporters(cache, tmp_path, monkeypatch):
    archive = make_tarball(
        tmp_path / "v.tar.gz",
        f"transformers-{VERSION}",
        {
            "tests/generation/test_utils.py": "class GenerationTesterMixin: ...\n",
            "tests/generation/test_framework_agnostic.py": "#\n",
            "tests/exporters/test_export.py": "class ExportTesterMixin: ...\n",
            "tests/models/bert/test_modeling_bert.py": "# not wanted\n",
            "tests/generation/../../../escape.py": "# must not be written\n",
            "src/transformers/__init__.py": "#\n",
        },
    )
    monkeypatch.setenv(fetch.ARCHIVE_URL_ENV, archive.as_uri().replace(VERSION, "{version}"))
    folder = fetch.repository_tests(VERSION)
    assert folder == cache / f"transformers-{VERSION}" / "repository-tests"
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert names == [
        "SOURCE",
        "exporters/test_export.py",
        "generation/test_framework_agnostic.py",
        "generation/test_utils.py",
    ]
    assert not list(cache.rglob("escape.py")) and not (tmp_path / "escape.py").exists()
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("cached copy not used"))
    assert fetch.repository_tests(VERSION) == folder


def test_repository_failure_is_remembered(cache, tmp_path, monkeypatch):
    monkeypatch.setenv(fetch.ARCHIVE_URL_ENV, (tmp_path / "absent-{version}.tar.gz").as_uri())
    with pytest.raises(fetch.Unavailable, match=f"v{VERSION}"):
        fetch.repository_tests(VERSION)
    marker = cache / f"transformers-{VERSION}" / "repository-tests.failed"
    assert marker.is_file()
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("retried within a day"))
    with pytest.raises(fetch.Unavailable, match="cached failure"):
        fetch.repository_tests(VERSION)


def test_repository_with_no_fetch(cache, no_network, monkeypatch):
    monkeypatch.setenv(fetch.NO_FETCH_ENV, "1")
    with pytest.raises(fetch.Unavailable, match=fetch.NO_FETCH_ENV):
        fetch.repository_tests(VERSION)
