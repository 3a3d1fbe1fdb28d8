"""Stand-in for the `verl` package (python/tests/standins/README.md)."""
