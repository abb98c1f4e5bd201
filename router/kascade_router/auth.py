"""Client authentication: API keys from a file (a mounted Secret), each allowed every model or a list of them.

The file: one key per line, `KEY` (every model) or `KEY MODEL[,MODEL...]`; `#` starts a comment; blank lines
are skipped. Clients send `Authorization: Bearer KEY` (what the openai SDK sends for `api_key`). Keys are held
as SHA-256 digests (a key is never logged; logs name a key by its digest's first 8 hex digits). The file is
re-read when it changes (checked at most once a second: a rotated Secret lands without a restart); a file that
no longer parses keeps the keys already loaded and logs the error.

Data flow: file -> `parse` (pure) -> `ApiKeys` -> `Proxy.handle`: no or unknown key 401, a model the key may
not use 403 (naming the model), `/v1/models` lists only the key's models.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)
ANY = "*"


@dataclass(frozen=True)
class Key:
    name: str  # the digest's first 8 hex digits: how logs name it
    models: frozenset[str]  # {ANY}: every model

    def allows(self, model: str) -> bool:
        return ANY in self.models or model in self.models


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse(text: str, source: str) -> dict[str, Key]:
    """digest -> Key; a bad line raises ValueError naming `source` and the line number."""
    keys: dict[str, Key] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 2:
            raise ValueError(f"{source}:{n}: expected 'KEY [MODEL,...]', got {len(parts)} fields")
        key = parts[0]
        if len(key) < 8:
            raise ValueError(f"{source}:{n}: an API key must be at least 8 characters")
        models = frozenset(m for m in (parts[1].split(",") if len(parts) == 2 else [ANY]) if m)
        if not models:
            raise ValueError(f"{source}:{n}: an empty model list (omit it to allow every model)")
        d = digest(key)
        if d in keys:
            raise ValueError(f"{source}:{n}: a key listed twice")
        keys[d] = Key(d[:8], models)
    if not keys:
        raise ValueError(f"{source}: no API keys (a file with none would refuse every request)")
    return keys


class ApiKeys:
    def __init__(self, path: str, check_every_s: float = 1.0) -> None:
        self.path, self.check_every_s = path, check_every_s
        self._mtime = os.stat(path).st_mtime_ns
        with open(path, encoding="utf-8") as f:
            self.keys = parse(f.read(), path)  # a bad file at start is an error: the router does not start
        self._checked = time.monotonic()

    def lookup(self, authorization: str | None) -> Key | None:
        """The key an `Authorization: Bearer KEY` header carries, or None."""
        self._maybe_reload()
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return self.keys.get(digest(token.strip()))

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.check_every_s:
            return
        self._checked = now
        try:
            mtime = os.stat(self.path).st_mtime_ns
            if mtime == self._mtime:
                return
            self._mtime = mtime  # a bad version is reported once, not every second
            with open(self.path, encoding="utf-8") as f:
                keys = parse(f.read(), self.path)
        except (OSError, ValueError) as e:
            log.error("API keys not reloaded, the %d loaded stay: %s", len(self.keys), e)
            return
        self.keys = keys
        log.warning("API keys reloaded from %s: %d keys", self.path, len(keys))
