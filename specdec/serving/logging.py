"""structlog configuration: one JSON (or console) line per event on stderr, for the service's
own events and for whatever its libraries log or warn (grpc, transformers, Python warnings)."""

from __future__ import annotations

import logging
import sys

import structlog
from transformers.utils import logging as transformers_logging


def configure_logging(level: str = "info", fmt: str = "json") -> None:
    """Configures structlog and the stdlib root logger for a service process: library log records
    and Python warnings are rendered like the service's own events, exceptions included, and
    transformers' progress bars (model loading) are off (a service's stderr is a log, not a
    terminal)."""
    numeric = logging.getLevelName(level.upper())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    stamped: list[structlog.typing.Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *stamped,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *stamped],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    logging.captureWarnings(True)
    # transformers logs through a handler of its own that does not propagate: route it to the root
    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    transformers_logging.disable_progress_bar()
