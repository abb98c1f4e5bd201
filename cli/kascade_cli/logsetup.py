"""Logging for every `kascade` entry point (operator, engine, router, CLI tools): configured once, by the
root command, as human-readable text or one JSON object per line (for log pipelines such as Loki,
Elasticsearch or Cloud Logging).

Data flow: `kascade --log-format json -v ...` (or $KASCADE_LOG_FORMAT) -> `configure()` -> one stderr
handler on the root logger; library loggers (kopf, uvicorn when started with log_config=None, httpx)
propagate to it. A JSON line carries `ts` (UTC, ISO 8601), `level`, `logger`, `msg`, the exception
text under `exc`, and any `extra=` fields of the call. $KASCADE_DEBUG_LOGGERS (comma-separated logger
names) puts those loggers at DEBUG whatever the level, e.g. `kascade_operator.trace` (a reaction's timestamps).
httpx's line per request shows only at -vv (DEBUG): at -v it was one line per engine scrape.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["text", "json"]
FORMATS: tuple[LogFormat, ...] = ("text", "json")
DEBUG_LOGGERS_ENV = "KASCADE_DEBUG_LOGGERS"  # comma-separated loggers to log at DEBUG whatever -v says
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# attributes every LogRecord has; anything else on a record came from `extra=`
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in messages are escaped, never split)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        for k, v in vars(record).items():
            if k not in _STANDARD and k not in doc:
                doc[k] = v
        return json.dumps(doc, default=str, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is at emit time (test runners swap it), unless given a stream."""

    def __init__(self, stream: Any = None) -> None:
        super().__init__()
        self._fixed = stream

    @property
    def stream(self) -> Any:
        return self._fixed if self._fixed is not None else sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns it
        pass


def configure(level: int, fmt: LogFormat = "text", stream: Any = None) -> logging.Handler:
    """Install Kascade's one root handler in `fmt` (replacing the one a previous call installed; other
    handlers, e.g. a test runner's capture, stay); returns it."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    handler = _StderrHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, _StderrHandler):
            root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    # httpx logs every request at INFO: one line per engine scrape (hundreds a second at fleet scale) under -v
    logging.getLogger("httpx").setLevel(logging.NOTSET if level <= logging.DEBUG else max(level, logging.WARNING))
    for name in filter(None, (n.strip() for n in os.environ.get(DEBUG_LOGGERS_ENV, "").split(","))):
        logging.getLogger(name).setLevel(logging.DEBUG)  # e.g. kascade_operator.trace (a reaction's timestamps)
    return handler
