"""Studies that take longer than a benchmark: ``zeropp study convergence``."""
