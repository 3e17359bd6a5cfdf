"""The completion a switch sends before it commits, and the production watch sends as its canary: through the
agent route (the path agents take, with the console's own credential), under the route's alias, to the profile
that must answer."""

from __future__ import annotations

import json
from typing import Any

from app.promotion.switch import SmokeResult
from app.qualification.gates.answers import SMOKE_PROMPT
from app.route.proxy import SWITCH_SMOKE, AgentRoute, RouteError

SMOKE_MAX_TOKENS = 16
SMOKE_TIMEOUT_S = 120.0
ENDPOINT = "/v1/chat/completions"


def route_smoke(
    route: AgentRoute, profile: str, caller: str = SWITCH_SMOKE, timeout_s: float = SMOKE_TIMEOUT_S
) -> SmokeResult:
    """A chat completion through the route answered by `profile` with HTTP 200, a choice and usage."""
    body: dict[str, Any] = {
        "model": route.alias,
        "messages": [{"role": "user", "content": SMOKE_PROMPT}],
        "max_tokens": SMOKE_MAX_TOKENS,
        "temperature": 0,
    }
    try:
        answer = route.call(caller, profile, ENDPOINT, body, timeout_s)
    except RouteError as exc:
        return SmokeResult(False, f"the route answered HTTP {exc.status_code}: {exc.message}", None, exc.status_code)
    except TimeoutError:
        return SmokeResult(False, f"no answer through the route within {timeout_s:g} s", None)
    build = answer.serving.build if answer.serving else None
    if answer.status != 200:
        text = answer.body[:300].decode(errors="replace")
        return SmokeResult(False, f"HTTP {answer.status}: {text}", build, answer.status)
    payload = json.loads(answer.body)
    choices = payload.get("choices") or []
    finish, model, usage = (
        choices[0].get("finish_reason") if choices else None,
        payload.get("model"),
        payload.get("usage"),
    )
    if finish not in ("stop", "length", "tool_calls") or not usage or model != route.alias:
        detail = f"an incomplete answer: model {model!r}, finish_reason {finish!r}, usage {usage}"
        return SmokeResult(False, detail, build, 200)
    detail = (
        f"{model!r} answered through the route ({ENDPOINT}) from {profile}: {usage.get('completion_tokens')} tokens"
    )
    return SmokeResult(True, f"{detail}, finish_reason {finish}", build, 200)
