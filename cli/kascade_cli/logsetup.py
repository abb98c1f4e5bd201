"""Logging for every `kascade` entry point (operator, engine, router, CLI tools): configured once, by the
root command, as human-readable text or one JSON object per line (for log pipelines such as Loki,
Elasticsearch or Cloud Logging).

Data flow: `kascade --log-format json -v ...` (or $KASCADE_LOG_FORMAT) -> `configure()` -> one stderr
handler on the root logger; library loggers (kopf, uvicorn when started with log_config=None, httpx)
propagate to it. A JSON line carries `ts` (UTC, ISO 8601), `level`, `logger`, `msg`, the exception
text under `exc`, and any `extra=` fields of the call.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["text", "json"]
FORMATS: tuple[LogFormat, ...] = ("text", "json")
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
    return handler
