"""Training, data and evaluation pipelines for Block-State Transformer language models (PG19 / arXiv / GitHub) and
the LRA ListOps classifier.

Entry points: ``python -m training.train`` (Trainer; recipes configs/train/*.yaml, ``task: lm`` or ``listops``),
``python -m training.evaluate`` (perplexity and bits per byte vs evaluation length), ``python -m training.corpora``
(offline corpora), ``python -m training.tasks.listops`` (ListOps splits). Library code: ``training.data``,
``training.optim``, ``training.tasks.listops``.
"""

from pathlib import Path


HOME = Path(__file__).resolve().parent  # in the clone or installed: presets/, tokenizers/, data/ (package data)


def preset(name: str) -> str:
    """The config.json path of the model preset ``name`` (``"bst-tiny-sh-s4"``, a file of ``training/presets/``,
    shipped with the package), for ``AutoConfig.from_pretrained``."""
    path = HOME / "presets" / f"{name.removesuffix('.json')}.json"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in (HOME / "presets").glob("*.json")))
        raise FileNotFoundError(f"no model preset {name!r}; the presets are: {names}")
    return str(path)
