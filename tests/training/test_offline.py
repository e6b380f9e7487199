"""Paper recipes without network (issue #14 item 4): one fast failure that names the dataset and the offline
alternatives, instead of five retries and a long ``datasets`` traceback."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    with socket.socket() as sock:  # bound then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("network", ["offline-flag", "closed-endpoint"])
def test_paper_recipe_without_network_fails_once_naming_the_alternatives(tmp_path, network):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT")}
    if network == "offline-flag":
        env["HF_DATASETS_OFFLINE"] = "1"
    else:  # no offline flag: the Hub endpoint refuses connections
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{_closed_port()}"
    (
        env.pop("HTTPS_PROXY", None),
        env.pop("https_proxy", None),
        env.pop("HTTP_PROXY", None),
        env.pop("http_proxy", None),
    )
    argv = ["--config", "configs/train/bst-sh-s4-pg19.yaml", "--output_dir", str(tmp_path / "run")]
    proc = subprocess.run(
        [sys.executable, "-m", "training.train", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 1
    err = proc.stderr
    assert "Traceback" not in err and "Retrying" not in err, err[-3000:]
    message = err.strip().splitlines()[-1]
    assert message.startswith("training.train: dataset 'pg19' is on the Hugging Face Hub (emozilla/pg19)")
    reason = "offline mode is on" if network == "offline-flag" else "Connection refused"
    assert reason in message
    for alternative in (
        "--dataset_path DIR",
        "python -m training.corpora --out corpora/ --books",
        "--dataset embedded",
    ):
        assert alternative in message


def test_missing_local_path_is_named(monkeypatch):
    import datasets.config
    from huggingface_hub import constants

    from training import data as D

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(D.DatasetUnavailableError) as err:
        D.load_documents("arxiv", "validation", path="no/such/folder")
    text = str(err.value)
    assert "dataset 'arxiv'" in text and "--dataset_path 'no/such/folder' is not a local file or folder" in text
    assert "python -m training.corpora --out corpora/ --latex" in text and "corpora/arxiv" in text
