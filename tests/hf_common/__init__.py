"""transformers' common model tests, vendored to run against the BST models (see NOTICE and docs/hf-common-tests.md).

``test_modeling_common.py`` and ``test_configuration_common.py`` come unchanged from the transformers 5.24.0 source
release on PyPI. The three modules they import that only exist in the transformers repository
(``generation/test_utils.py``, ``exporters/test_export.py``, ``utils/test_configuration_utils.py``) are not vendored:
each sub-package here loads the repository's file from ``$TRANSFORMERS_TESTS_DIR`` (the ``tests/`` folder of a
transformers checkout) when that variable is set, and otherwise a small stand-in of ours (see ``upstream.py``).
"""
