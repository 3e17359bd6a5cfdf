"""The one shape of a rejected write: 422 with every offending field named, so a form can show each beside its input."""

from __future__ import annotations

from dataclasses import dataclass

from litestar.exceptions import ClientException, HTTPException
from litestar.status_codes import HTTP_409_CONFLICT, HTTP_422_UNPROCESSABLE_ENTITY


@dataclass(frozen=True)
class FieldError:
    field: str
    message: str


class InvalidFields(HTTPException):
    status_code = HTTP_422_UNPROCESSABLE_ENTITY

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__(
            detail="; ".join(e.message for e in errors),
            extra=[{"field": e.field, "message": e.message} for e in errors],
        )


class Conflict(ClientException):
    """The request is well formed but the current state forbids it (a name taken, a profile with evidence)."""

    status_code = HTTP_409_CONFLICT
