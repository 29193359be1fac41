"""Structured JSON logs: a fixed message plus lowerCamelCase keys, one object per line.

Never log payloads, results or tokens: they may hold personal data or secrets.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
# kopf attaches its settings and object references to every record; they are noise here.
_DROPPED = {"settings", "k8s_skip", "k8s_ref"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in _DROPPED and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Request lines from httpx would drown the signal.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # kopf reports every handler call at INFO; Tether logs what matters itself.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
