"""A call's refusal: its HTTP status and the error envelope's code, message and field."""

from __future__ import annotations


class Failure(Exception):
    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field
        self.headers = headers or {}
