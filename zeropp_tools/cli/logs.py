"""Logging for the command line: reports on stdout as plain text, problems on stderr."""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Loggers whose level --log-level sets; third-party libraries (matplotlib at DEBUG is
# thousands of lines) stay at WARNING unless asked for something quieter.
OUR_LOGGERS = ("zeropp", "zeropp_tools")


class ConsoleFormatter(logging.Formatter):
    """INFO records are reports and read as plain text, exactly as printed output did;
    other levels carry a ``zeropp: <level>:`` prefix so they stand out from a report."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.levelno == logging.INFO:
            return message
        return f"zeropp: {record.levelname.lower()}: {message}"


class ConsoleHandler(logging.Handler):
    """Below WARNING to stdout (reports can be piped to a file), WARNING and above to
    stderr. The streams are looked up at each record, not at construction, so a caller
    that swaps ``sys.stdout`` (pytest's capture, a redirect) still receives the output."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def configure_logging(level_name: str) -> None:
    """Install the console handler once per process; calling again (main() run twice in
    one process, as tests do) replaces it instead of printing every record twice."""
    if level_name not in LOG_LEVELS:
        raise ValueError(f"--log-level={level_name!r} is not supported; allowed values: {list(LOG_LEVELS)}")
    level = getattr(logging, level_name)
    root = logging.getLogger()
    for handler in [handler for handler in root.handlers if isinstance(handler, ConsoleHandler)]:
        root.removeHandler(handler)
    handler = ConsoleHandler()
    handler.setFormatter(ConsoleFormatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(max(level, logging.WARNING))
    for name in OUR_LOGGERS:
        logging.getLogger(name).setLevel(level)
