# The vendored files are libraries of test mixins, not test modules of their own: never collect them.
collect_ignore_glob = ["*.py", "*/*.py"]
