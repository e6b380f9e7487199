from ..upstream import extend_path


# transformers' tests/exporters/ from $TRANSFORMERS_TESTS_DIR or the fetched tag archive (upstream.tests_dir), when
# there is one, shadows our stand-in module here.
UPSTREAM = extend_path(__path__, "exporters")
