"""akv's loggers: structlog event dicts carried by the stdlib logger named ``akv.*``.

The library never configures logging (it only moves NIXL's own stdout handler to stderr:
see `akv.backends.nixl`). Until the application does, only warnings reach
stderr (stdlib's last-resort handler). To render akv's events, attach a handler with
``structlog.stdlib.ProcessorFormatter`` to the ``akv`` logger, as `akv.cli` does.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

__all__ = ["configure_cli_logging", "get_logger"]


def get_logger(name: str) -> Any:
    """A structlog logger bound to the stdlib logger ``name`` (filtered by its level first)."""
    return structlog.wrap_logger(
        logging.getLogger(name),
        wrapper_class=structlog.stdlib.BoundLogger,
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.stdlib.add_logger_name,
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        cache_logger_on_first_use=True,
    )


def configure_cli_logging(level: int, *, json: bool | None = None) -> None:
    """For the CLI only: render akv events on stderr (console on a TTY, JSON otherwise)."""
    import sys

    if json is None:
        json = not sys.stderr.isatty()
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.processors.TimeStamper(fmt="iso")],
        )
    )
    logger = logging.getLogger("akv")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
    nixl = logging.getLogger("nixl")
    nixl.setLevel(max(level, logging.WARNING))
