"""The tasks beside language modelling. Evaluation tasks of ``python -m training.evaluate --task NAME``: ``lm`` (the
default: perplexity and bits per byte over whole documents, in ``training.evaluate``) and ``mqar`` (multi-query
associative recall, :mod:`training.tasks.mqar`). ListOps (Long Range Arena) is a training task of ``training.train``
(``task: listops`` in a recipe) with its data generator, :mod:`training.tasks.listops`.
"""

TASKS = ("lm", "mqar")
