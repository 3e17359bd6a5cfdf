"""Structured logs for the engine: a readable renderer on a terminal, JSON lines otherwise.

The console has its own twin (app/logging.py) because the two planes share no code.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(json: bool | None = None, level: int = logging.INFO) -> None:
    """Set up structlog once; `json=None` picks JSON unless stderr is a TTY."""
    use_json = (not sys.stderr.isatty()) if json is None else json
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # One write per line (message and newline together): the ranks of one engine share its stderr.
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
