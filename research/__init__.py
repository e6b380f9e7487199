"""The experiments behind docs/results.md (see research/README.md); not part of the installed package."""
