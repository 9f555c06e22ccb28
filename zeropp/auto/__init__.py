"""Auto mode: measure the network, try the schemes that could win, re-plan when the
network changes, predicting measured schemes by replaying their recorded steps
(docs/design.md section 11)."""

from .probe import LinkProbe
from .step_model import Accumulation, LinkSpeeds, LinkTime, link_time, step_seconds
from .candidates import candidate_schemes, candidates
from .tuner import AutoState, AutoTuner, Decision

__all__ = ["Accumulation", "AutoState", "AutoTuner", "Decision", "LinkProbe", "LinkSpeeds", "LinkTime",
           "candidate_schemes", "candidates", "link_time", "step_seconds"]
