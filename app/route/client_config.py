"""Client configuration for the route, generated from the production profile and what its engine reported in
/server_info: a Pi `models.json` (qualification.md §3.2, docs/agent-api.md "Capabilities") and a snippet for any
OpenAI client. The key itself is never in it: clients read it from FLASHGATE_API_KEY."""

from __future__ import annotations

import json
from typing import Any

from sqlmodel import Session, col, select

from app.engine_control.models import EngineRun
from app.errors import Conflict
from app.profiles.models import Profile
from app.profiles.roles import route_row
from app.route.schemas import ClientConfigRead

CLIENTS = ("pi", "openai")
PROVIDER = "flashgate"
KEY_VARIABLE = "FLASHGATE_API_KEY"
# Pi's thinking levels; each maps to the engine's nearest level (its aliases say which).
PI_LEVELS = ("minimal", "low", "medium", "high", "xhigh")


def _effort_map(capabilities: dict[str, Any]) -> dict[str, str]:
    aliases, levels = capabilities.get("reasoning_effort_aliases", {}), capabilities.get("reasoning_efforts", [])
    return {level: aliases.get(level, level) for level in PI_LEVELS if aliases.get(level, level) in levels}


def _pi(alias: str, base_url: str, context: int, max_tokens: int, capabilities: dict[str, Any]) -> dict[str, Any]:
    thinking = bool(capabilities.get("thinking"))
    compat: dict[str, Any] = {
        "supportsStore": True,  # the engine accepts `store` and ignores it
        "supportsDeveloperRole": bool(capabilities.get("developer_role")),
        "supportsUsageInStreaming": bool(capabilities.get("usage_in_streaming")),
        "supportsStrictMode": bool(capabilities.get("strict_tools")),
        "maxTokensField": next(iter(capabilities.get("max_tokens_fields") or []), "max_tokens"),
    }
    if thinking and "reasoning_effort" in capabilities.get("thinking_controls", []):
        compat |= {"thinkingFormat": "reasoning_effort", "reasoningEffortMap": _effort_map(capabilities)}
    model = {
        "id": alias,
        "name": f"DeepSeek-V4-Flash on Flashgate ({alias})",
        "reasoning": thinking,
        "input": [m for m in capabilities.get("modalities", ["text"]) if m in ("text", "image")],
        "contextWindow": context,
        "maxTokens": max_tokens,
        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
        "compat": compat,
    }
    provider = {"baseUrl": base_url, "api": "openai-completions", "apiKey": f"${KEY_VARIABLE}", "models": [model]}
    return {"providers": {PROVIDER: provider}}


def _openai_snippet(alias: str, base_url: str, max_tokens: int) -> str:
    return f"""# export {KEY_VARIABLE}=fg-…   (a key from the console's Agents page, or POST /api/keys)
import os

from openai import OpenAI

client = OpenAI(base_url="{base_url}", api_key=os.environ["{KEY_VARIABLE}"])
stream = client.chat.completions.create(
    model="{alias}",
    messages=[{{"role": "user", "content": "Hello"}}],
    max_completion_tokens={max_tokens},
    stream=True,
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="")
"""


def client_config(session: Session, client: str, alias: str, base_url: str) -> ClientConfigRead:
    route = route_row(session)
    if route is None or route.production_id is None:
        raise Conflict("no profile holds the production role yet: promote one, then export its client configuration")
    profile = session.get(Profile, route.production_id)
    info = session.exec(
        select(EngineRun.server_info)
        .where(EngineRun.profile_id == profile.id, col(EngineRun.server_info).is_not(None))
        .order_by(col(EngineRun.id).desc())
    ).first()
    capabilities = info.get("capabilities", {})
    context = capabilities.get("context_length") or profile.context_length
    max_tokens = min(profile.max_output_tokens, capabilities.get("max_output_tokens") or profile.max_output_tokens)
    common = {"base_url": base_url, "model": alias, "profile": profile.name}
    common |= {"context_window": context, "max_tokens": max_tokens}
    if client == "pi":
        config = _pi(alias, base_url, context, max_tokens, capabilities)
        content = json.dumps(config, indent=2) + "\n"
        return ClientConfigRead(client="pi", target="~/.pi/agent/models.json", content=content, config=config, **common)
    content = _openai_snippet(alias, base_url, max_tokens)
    return ClientConfigRead(client="openai", target="a Python script", content=content, config=None, **common)
