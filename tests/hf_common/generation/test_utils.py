"""Stand-in for transformers' tests/generation/test_utils.py, used when the repository's file cannot be had.

``GenerationTesterMixin`` (about 5,600 lines) exists only in the transformers repository, not in its source release:
it loads from ``$TRANSFORMERS_TESTS_DIR`` or from the repository's tag archive fetched into the test cache (see
``../upstream.py`` and ``../fetch.py``). Without either, this empty mixin lets ``ModelTesterMixin`` import and lets a
tester declare that it runs the generation tests; ``tests/models/bst/test_hf_common.py`` reports (as a skip) that they did not run.
"""


class GenerationTesterMixin:
    """Empty: the generation tests run only with the repository's file (``$TRANSFORMERS_TESTS_DIR`` or fetched)."""

    all_generative_model_classes = ()
