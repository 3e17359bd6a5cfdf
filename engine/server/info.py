"""What the engine reports about itself (DESIGN.md, "Engine ↔ console contract"): the ready line, /server_info and
/v1/models, all from the same numbers."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from engine.llm_engine import LLMEngine
from engine.server.chat_encoding import REASONING_EFFORT_LEVELS

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


def server_info(engine: LLMEngine, build: str) -> dict[str, Any]:
    config = engine.applied_config
    runner = engine.runner
    context_length = config.context_length
    return {
        "model": config.model,
        "served_model_name": config.served_model_name,
        "build": build,
        "config": dataclasses.asdict(config),
        "kv_capacity_tokens": engine.kv_capacity_tokens,
        "kv_pages": runner.pool.num_pages,
        "kv_bytes_per_token": runner.layout.bytes_per_token,
        "per_sequence_state_bytes": runner.layout.per_sequence_state_bytes,
        "gpu_memory": dataclasses.asdict(runner.memory),
        # Requests at full context the pool holds at once (a request holds whole pages).
        "max_concurrency_at_full_context": round(runner.pool.num_pages / runner.layout.pages_for(context_length), 2),
    }


def ready_line(info: dict[str, Any]) -> str:
    config = info["config"]
    free = info["gpu_memory"]["free_bytes"] or 0
    return (
        f"engine ready: context_len={config['context_length']} max_total_num_tokens={info['kv_capacity_tokens']} "
        f"max_num_seqs={config['max_num_seqs']} max_num_batched_tokens={config['max_num_batched_tokens']} "
        f"available_gpu_mem={free / GIB:.2f}GiB"
    )


def models(engine: LLMEngine) -> dict[str, Any]:
    config = engine.applied_config
    max_output = engine.max_request_tokens - 1  # a one-token prompt leaves this much room
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
                "max_output_tokens": max_output,
                "capabilities": {
                    "streaming": True,
                    "usage_in_streaming": True,
                    "tools": True,
                    "developer_role": True,
                    "thinking": True,
                    "reasoning_efforts": list(REASONING_EFFORT_LEVELS),
                    "logprobs": True,
                    "structured_output": False,
                    "responses_api": False,
                    "modalities": ["text"],
                },
            }
        ],
    }
