"""The step simulator's tools: the emulated cluster's calibration, the comparison with
measured runs, and the ZeRO++ paper's rows (``zeropp plan``)."""
