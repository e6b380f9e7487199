from ..upstream import extend_path


# transformers' tests/exporters/ from $TRANSFORMERS_TESTS_DIR, when set, shadows our stand-in module here.
UPSTREAM = extend_path(__path__, "exporters")
