"""The one shape of a rejected write: 422 with every offending field named, so a form can show each beside its input;
and the one rule for names (profiles, operators, tokens, agent keys)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from litestar.exceptions import ClientException, HTTPException
from litestar.status_codes import HTTP_409_CONFLICT, HTTP_422_UNPROCESSABLE_ENTITY


@dataclass(frozen=True)
class FieldError:
    field: str
    message: str


class InvalidFields(HTTPException):
    status_code = HTTP_422_UNPROCESSABLE_ENTITY
    # The answer's description in the OpenAPI schema (each raise gives its own detail).
    detail = "a field breaks a rule: `extra` lists each as {field, message}, the message naming the limit"

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__(
            detail="; ".join(e.message for e in errors),
            extra=[{"field": e.field, "message": e.message} for e in errors],
        )


class Conflict(ClientException):
    """The request is well formed but the current state forbids it (a name taken, a profile with evidence)."""

    status_code = HTTP_409_CONFLICT
    detail = "the current state forbids it: `detail` says why"


NAME_RE = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
NAME_MAX = 63


def name_errors(name: str, field: str = "name") -> list[FieldError]:
    if len(name) <= NAME_MAX and NAME_RE.fullmatch(name):
        return []
    return [
        FieldError(
            field,
            f"{field} must be a lowercase slug of 1 to {NAME_MAX} characters (a-z, 0-9, single hyphens), got {name!r}",
        )
    ]
