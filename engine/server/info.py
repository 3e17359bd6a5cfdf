"""What the engine reports about itself (DESIGN.md, "Engine ↔ console contract"): the ready line, /server_info and
/v1/models, all from the same numbers. Both /server_info (under `capabilities`) and each /v1/models entry carry
what the API accepts, so that a client's configuration can be generated from them (docs/agent-api.md)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from engine.llm_engine import LLMEngine
from engine.server.chat_encoding import REASONING_EFFORT_ALIASES, REASONING_EFFORT_LEVELS

GIB = 1 << 30


def build_id() -> str:
    """FLASHGATE_BUILD, else `git describe` of the checkout the engine runs from, else "dev"."""
    if build := os.environ.get("FLASHGATE_BUILD"):
        return build
    try:
        described = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--tags"],
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "dev"
    return described.stdout.strip() or "dev"


def capabilities(engine: LLMEngine, structured_output: bool) -> dict[str, Any]:
    """What a client may send and will get back. `structured_output` is whether output grammars can be built
    (the tokenizer is byte-level): without them `tool_choice` required or named and JSON `response_format` are
    refused, and `strict` is ignored."""
    return {
        "context_length": engine.context_length,
        "max_output_tokens": engine.max_request_tokens - 1,  # a one-token prompt leaves this much room
        "modalities": ["text"],
        "endpoints": ["/v1/chat/completions", "/v1/completions", "/v1/responses"],
        "streaming": True,
        "usage_in_streaming": True,
        "max_tokens_fields": ["max_completion_tokens", "max_tokens"],
        "developer_role": True,
        "tools": True,
        "tool_choice": ["auto", "none", "required", "named"] if structured_output else ["auto", "none"],
        "parallel_tool_calls": True,
        "strict_tools": structured_output,
        "response_format": ["text", "json_object", "json_schema"] if structured_output else ["text"],
        "structured_output": structured_output,
        "thinking": True,
        "thinking_default": False,
        "thinking_controls": [
            "reasoning_effort",
            "chat_template_kwargs.thinking",
            "chat_template_kwargs.enable_thinking",
            "enable_thinking",
        ],
        "reasoning_efforts": list(REASONING_EFFORT_LEVELS),
        "reasoning_effort_aliases": dict(REASONING_EFFORT_ALIASES),
        "reasoning_field": "reasoning_content",
        "logprobs": True,
        "stateful_responses": False,
    }


def server_info(engine: LLMEngine, build: str, capabilities: dict[str, Any]) -> dict[str, Any]:
    config, capacity = engine.applied_config, dataclasses.asdict(engine.capacity())
    memory, per_rank = capacity.pop("memory"), capacity.pop("memory_per_rank")
    return {
        "model": config.model,
        "served_model_name": config.served_model_name,
        "build": build,
        "config": dataclasses.asdict(config),
        **capacity,
        "gpu_memory": memory,
        # Each rank's GPU (tensor_parallel_size of them; config.attention says how they share the work).
        "gpu_memory_per_rank": per_rank,
        "prefix_cache": {
            "enabled": config.prefix_cache,
            "snapshot_slots": len(engine.booted.snapshot_slots),
            "snapshot_bytes": engine.capacity().per_sequence_state_bytes,
        },
        "capabilities": capabilities,
    }


def ready_line(info: dict[str, Any]) -> str:
    config = info["config"]
    free = info["gpu_memory"]["free_bytes"] or 0
    return (
        f"engine ready: context_len={config['context_length']} max_total_num_tokens={info['kv_capacity_tokens']} "
        f"max_num_seqs={config['max_num_seqs']} max_num_batched_tokens={config['max_num_batched_tokens']} "
        f"available_gpu_mem={free / GIB:.2f}GiB"
    )


def models(engine: LLMEngine, capabilities: dict[str, Any]) -> dict[str, Any]:
    config = engine.applied_config
    return {
        "object": "list",
        "data": [
            {
                "id": config.served_model_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "flashgate",
                "root": config.model,
                "max_model_len": config.context_length,
                "context_length": config.context_length,
                "max_output_tokens": capabilities["max_output_tokens"],
                "capabilities": capabilities,
            }
        ],
    }
