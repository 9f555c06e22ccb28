"""Trainers users already run, on zeropp-sharded models. Each module imports its framework
(an optional extra), so import the one you use: ``zeropp.integrations.transformers``."""
