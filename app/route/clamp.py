"""The route's output clamp: no request gets more output tokens than the production profile's `max_output_tokens`.
A budget that is missing or larger is set to the limit, and the answer's `Warning` header says so; a budget that is
not a whole number from 1 up is refused, naming the field and the limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The budget fields per endpoint, in the engine's order of precedence (the first one given wins).
BUDGET_FIELDS = {
    "/v1/chat/completions": ("max_completion_tokens", "max_tokens"),
    "/v1/completions": ("max_tokens",),
    "/v1/responses": ("max_output_tokens",),
}


class BudgetError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Clamped:
    body: dict[str, Any]
    # A `Warning` header value when the budget was set by the route, else None.
    warning: str | None


def clamp(endpoint: str, body: dict[str, Any], limit: int) -> Clamped:
    fields = BUDGET_FIELDS[endpoint]
    field = next((f for f in fields if body.get(f) is not None), None)
    if field is None:
        # Missing: the engine would give all the context leaves; the route gives its limit, in the plain field.
        return Clamped({**body, fields[-1]: limit}, f'299 - "{fields[-1]} not given: set to {limit} by the route"')
    requested = body[field]
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise BudgetError(
            field,
            f"{field} must be a whole number from 1 to {limit} (the route's limit: max_output_tokens of the "
            f"production profile); got {requested!r}",
        )
    if requested <= limit:
        return Clamped(body, None)
    return Clamped({**body, field: limit}, f'299 - "{field} clamped from {requested} to {limit} by the route"')
