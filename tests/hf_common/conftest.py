# This folder holds the mixins' stand-ins and the fetcher, not test modules of their own: never collect them.
collect_ignore_glob = ["*.py", "*/*.py"]
