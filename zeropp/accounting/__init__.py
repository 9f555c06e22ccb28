"""Accounting of every collective (``log``) and the analytic volume it must match (``analytic``)."""

from .analytic import FlatSummary, predicted_step_bytes
from .log import CollectiveRecord, CommLog, format_table

__all__ = ["CollectiveRecord", "CommLog", "FlatSummary", "format_table", "predicted_step_bytes"]
