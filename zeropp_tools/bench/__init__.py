"""Benchmarks and reports run from the command line (``zeropp bench ...``)."""
