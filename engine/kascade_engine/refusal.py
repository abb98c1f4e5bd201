"""InstanceError: a control call the engine instance refuses (HTTP status, message, and the field it is
about). Its own module so the collaborators that refuse calls for the instance (the loader) raise it without
importing the instance; the HTTP layer turns it into the answer.
"""

from __future__ import annotations


class InstanceError(Exception):
    """A control call this instance refuses: HTTP status, message, and the field it is about."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field
