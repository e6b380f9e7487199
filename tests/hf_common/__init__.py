"""transformers' common model tests, run against the BST models (see docs/hf-common-tests.md).

Nothing here is copied from transformers. ``test_modeling_common.py`` and ``test_configuration_common.py`` come from
the source release of the installed transformers version on the package index: ``fetch.py`` downloads it once into a
cache, and ``fetch.attach_sdist_tests`` puts the cached files on this package's ``__path__``, after this folder, so
that ``hf_common.test_modeling_common`` is the release's file and its relative imports (``.generation.test_utils``,
``.exporters.test_export``, ``.utils.test_configuration_utils``) land in the sub-packages here. Those three modules
exist only in the transformers repository: ``generation/`` and ``exporters/`` load the repository's files from
``$TRANSFORMERS_TESTS_DIR`` (the ``tests/`` folder of a transformers checkout) when set, else from the repository's
tag archive of the installed version fetched into the same cache, else a small stand-in of ours (see
``upstream.py``); ``utils/`` is always ours.
"""
