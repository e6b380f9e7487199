"""Stand-in for transformers' tests/generation/test_utils.py, used when ``$TRANSFORMERS_TESTS_DIR`` is not set.

``GenerationTesterMixin`` (about 5,600 lines) exists only in the transformers repository, whose files are not
vendored here (see NOTICE). This empty mixin lets ``ModelTesterMixin`` import and lets a tester declare that it runs
the generation tests; ``tests/test_hf_common.py`` reports (as a skip) that they did not run.
"""


class GenerationTesterMixin:
    """Empty: the generation tests run only with ``$TRANSFORMERS_TESTS_DIR`` set."""

    all_generative_model_classes = ()
