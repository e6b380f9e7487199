from ..upstream import alias_tests_package, extend_path


# transformers' tests/generation/ from $TRANSFORMERS_TESTS_DIR or the fetched tag archive (upstream.tests_dir), when
# there is one, shadows our stand-in module here.
UPSTREAM = extend_path(__path__, "generation")
if UPSTREAM:
    # The repository's generation/test_utils.py imports ``tests.exporters.test_export`` by absolute name.
    alias_tests_package()
