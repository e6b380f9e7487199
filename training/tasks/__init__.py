"""Evaluation tasks of ``python -m training.evaluate --task NAME``: ``lm`` (the default: perplexity and bits per byte
over whole documents, in ``training.evaluate``) and ``mqar`` (multi-query associative recall, :mod:`training.tasks.mqar`).
"""

TASKS = ("lm", "mqar")
