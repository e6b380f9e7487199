"""Training, data and evaluation pipelines for Block-State Transformer language models (PG19 / arXiv / GitHub) and
the LRA ListOps classifier.

Entry points: ``python -m training.train`` (Trainer; recipes configs/train/*.yaml, ``task: lm`` or ``listops``),
``python -m training.evaluate`` (perplexity and bits per byte vs evaluation length), ``python -m training.corpora``
(offline corpora), ``python -m training.listops`` (ListOps splits). Library code: ``training.data``,
``training.optim``, ``training.listops``.
"""
