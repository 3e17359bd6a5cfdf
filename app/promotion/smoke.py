"""The smoke a switch runs before it commits. Until the agent route exists it goes to the engine directly; the route
issue swaps this one function for a request through the console's `/v1` (the path agents take)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from app.qualification.gates import SMOKE_PROMPT

SMOKE_MAX_TOKENS = 16
SMOKE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class SmokeResult:
    ok: bool
    detail: str
    build: str | None


def engine_smoke(base_url: str, model: str) -> SmokeResult:
    """A chat completion answered with HTTP 200, a choice and usage (the engine serves), and the build the engine
    reports, which must be the build the profile was qualified on."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": SMOKE_PROMPT}],
        "max_tokens": SMOKE_MAX_TOKENS,
        "temperature": 0,
    }
    try:
        with httpx.Client(base_url=base_url, timeout=SMOKE_TIMEOUT_S) as http:
            answer = http.post("/v1/chat/completions", json=body)
            info = http.get("/server_info")
    except httpx.HTTPError as exc:
        return SmokeResult(False, f"no answer: {type(exc).__name__}: {exc}", None)
    build = info.json().get("build") if info.status_code == 200 else None
    if answer.status_code != 200:
        return SmokeResult(False, f"HTTP {answer.status_code}: {answer.text[:300]}", build)
    payload = answer.json()
    choices = payload.get("choices") or []
    finish = choices[0].get("finish_reason") if choices else None
    if finish not in ("stop", "length", "tool_calls") or not payload.get("usage"):
        return SmokeResult(
            False, f"an incomplete answer: finish_reason {finish!r}, usage {payload.get('usage')}", build
        )
    tokens = payload["usage"].get("completion_tokens")
    return SmokeResult(True, f"{model!r} answered ({tokens} tokens, finish_reason {finish})", build)
