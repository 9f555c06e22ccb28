"""Research tools around the zeropp library: the command line, benchmarks, studies, the
step planner and the emulated multi-node cluster. They import ``zeropp``; the library never
imports them."""
