"""The prefix cache's benchmark (issue 26), meant for the H200: `python -m engine serve` on the V4-Flash-width model
of bench/shapes.py (seeded random weights made on the GPU, in the formats V4-Flash ships: FP8 dense, MXFP4 experts;
`--weights bf16` for the bf16 stand-in, `--layers N` for V4-Flash's own first N layers), once with the prefix cache
and once without (`--no-prefix-cache`), each driven through /v1/chat/completions as a coding agent drives it:

- an agent-shaped session of 8 turns with tools: a system prompt, the tools, a file the agent read (about 16K
  tokens in all), then each turn re-sends the assistant's earlier answer and a tool result, about 1K new tokens
  together (to about 23K): TTFT per turn, and the share of prompt tokens the engine reports as cached over turns 2-8.
  Random weights answer in ids that stream as `<id>` text, several tokens each when re-sent (a trained model's
  answer re-encodes to about its own length), so the tool result is sized by what the answer leaves of the turn's
  tokens, counted with the served tokenizer;
- the same session in thinking mode without tools, where the chat template drops earlier turns' reasoning (see
  ../shared/reference/dsv4-chat-format.md), reported as it is;
- the shared-prefix tool burst of ../shared/reference/qualification.md: 3 requests at once with the same system
  prompt and tools and their own question; the cached share of the later two's prompts;
- decode tok/s of one 512-token answer, with the cache against without.

Writes prefix.json and prefix.md with turn_ttft_ratio (mean TTFT of turns 2-8 with the cache / without),
session_hit_rate, burst_cached_fraction, decode_ratio_cache_on, gpu, commit, date.

    python bench/prefix.py --out bench/results       # on the GPU machine
    python bench/prefix.py --out DIR --layers 36     # the deepest V4-Flash one H200 holds
    python bench/prefix.py --smoke                   # the tiny checkpoint on the CPU, small sizes: its machinery
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import provenance  # noqa: E402
from bench.serve import Engine  # noqa: E402
from bench.shapes import write_model_dir  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

TURNS = 8
FULL = {"first_tokens": 16384, "turn_tokens": 1024, "answer_tokens": 64, "decode_tokens": 512}
SMOKE = {"first_tokens": 600, "turn_tokens": 80, "answer_tokens": 8, "decode_tokens": 32}
ENGINE_FLAGS = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-num-seqs", "4", "--context-length", "65536",
                "--max-num-batched-tokens", "8192"]  # fmt: skip
SMOKE_FLAGS = ["--dtype", "float32", "--max-num-seqs", "4", "--context-length", "4096"]
TOOLS = [
    {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "description": "a file in the repository"}},
        "required": ["path"]}}}
    for name, description in (("read_file", "Read a file of the repository"), ("run_tests", "Run a test file"),
                              ("list_dir", "List a directory"))
]  # fmt: skip
WORDS = ["def", "class", "return", "import", "self", "value", "engine", "page", "cache", "token", "prompt", "layer",
         "window", "state"]  # fmt: skip


def text(tokens: int, seed: int, tokens_per_word: float) -> str:
    """Words to about `tokens` tokens (at the measured tokens a word)."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(WORDS), (max(1, int(tokens / tokens_per_word)),), generator=gen).tolist()
    return " ".join(WORDS[i] for i in picks)


class Chat:
    def __init__(self, url: str, model: str):
        self.client, self.model = httpx.Client(base_url=url, timeout=httpx.Timeout(None)), model

    def __call__(self, messages: list[dict], max_tokens: int, **extra) -> dict:
        """One streamed chat completion: TTFT (to the first chunk after the role), the answer as a message to send
        back, the usage."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": True} | extra  # fmt: skip
        started, first, content, calls, usage, request_id = time.monotonic(), None, [], {}, None, None
        with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage, request_id = chunk.get("usage") or usage, chunk.get("id", request_id)
                for choice in chunk.get("choices", []):
                    delta = choice["delta"]
                    if first is None and (delta.get("content") or delta.get("tool_calls")
                                          or delta.get("reasoning_content")):  # fmt: skip
                        first = time.monotonic()
                    content.append(delta.get("content") or "")
                    for call in delta.get("tool_calls") or []:
                        empty = {"id": call.get("id"), "type": "function", "function": {"name": "", "arguments": ""}}
                        entry = calls.setdefault(call["index"], empty)
                        entry["function"]["name"] += call.get("function", {}).get("name") or ""
                        entry["function"]["arguments"] += call.get("function", {}).get("arguments") or ""
        message = {"role": "assistant", "content": "".join(content)}
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        return {"ttft_s": (first or time.monotonic()) - started, "message": message, "usage": usage,
                "wall_s": time.monotonic() - started, "request_id": request_id}  # fmt: skip


def session(chat: Chat, sizes: dict, tokenizer: Tokenizer, tokens_per_word: float, tools: bool,
            thinking: bool) -> list[dict]:  # fmt: skip
    """8 turns; each re-sends the conversation so far and adds about turn_tokens new tokens: the answer and a tool
    result (or, without tools, a user message) of what the answer leaves."""
    system = "You are a coding agent working in a repository. " + text(512, 1, tokens_per_word)
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Here is engine/scheduler.py:\n" + text(sizes["first_tokens"] - 512, 2,
                                                                                   tokens_per_word)}]  # fmt: skip
    extra = {"tools": TOOLS} if tools else {}
    if thinking:
        extra["chat_template_kwargs"] = {"thinking": True}
    turns = []
    for turn in range(TURNS):
        result = chat(messages, sizes["answer_tokens"], **extra)
        usage = result["usage"]
        turns.append({"turn": turn + 1, "ttft_s": round(result["ttft_s"], 4), "prompt_tokens": usage["prompt_tokens"],
                      "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                      "request_id": result["request_id"]})  # fmt: skip
        answer = result["message"]
        messages.append(answer)
        answered = len(tokenizer.encode(answer["content"])) + sum(
            len(tokenizer.encode(call["function"]["name"] + call["function"]["arguments"]))
            for call in answer.get("tool_calls", [])
        )
        new = text(max(sizes["turn_tokens"] - answered, sizes["turn_tokens"] // 4), 10 + turn, tokens_per_word)
        if tools and answer.get("tool_calls"):
            messages += [{"role": "tool", "tool_call_id": call["id"], "content": new} for call in answer["tool_calls"]]
        else:
            messages.append({"role": "user", "content": "And this one:\n" + new})
    return turns


def burst(chat: Chat, sizes: dict, tokens_per_word: float) -> list[dict]:
    """3 requests at once: one system prompt and the tools, each its own question."""
    system = "You are a coding agent. " + text(sizes["first_tokens"] // 2, 3, tokens_per_word)
    results: list[dict | None] = [None] * 3

    def one(i: int) -> None:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: " +
                    text(64, 20 + i, tokens_per_word)}]  # fmt: skip
        results[i] = chat(messages, sizes["answer_tokens"], tools=TOOLS)["usage"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # in this order, as a client sends them
    for thread in threads:
        thread.join()
    return [{"prompt_tokens": u["prompt_tokens"], "cached_tokens": u["prompt_tokens_details"]["cached_tokens"]}
            for u in results]  # fmt: skip


def decode_tok_s(chat: Chat, sizes: dict) -> float:
    result = chat([{"role": "user", "content": "Write."}], sizes["decode_tokens"])
    return round(sizes["decode_tokens"] / (result["wall_s"] - result["ttft_s"]), 2)


def measure(model: str, flags: list[str], sizes: dict, log: Path) -> dict:
    engine = Engine(model, flags, log)
    try:
        info = httpx.get(f"{engine.url}/server_info").json()
        chat = Chat(engine.url, info["served_model_name"])
        tokenizer = Tokenizer.from_model_dir(model)
        tokens_per_word = len(tokenizer.encode(text(400, 0, 1.0))) / 400
        run = {
            "prefix_cache": info["prefix_cache"],
            "tool_session": session(chat, sizes, tokenizer, tokens_per_word, tools=True, thinking=False),
            "thinking_session": session(chat, sizes, tokenizer, tokens_per_word, tools=False, thinking=True),
            "burst": burst(chat, sizes, tokens_per_word),
            "decode_tok_s": decode_tok_s(chat, sizes),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        }
    finally:
        engine.stop()
    engine_ttft = logged_ttft(log)
    for turn in run["tool_session"] + run["thinking_session"]:
        turn["engine_ttft_s"] = engine_ttft.get(turn["request_id"])
    return run


def logged_ttft(log: Path) -> dict[str, float]:
    """Each finished request's TTFT as the engine logged it (`request_finished`: arrival to its first token); the rest
    of the client's TTFT is the HTTP front end, the stream and the text the tool-call parser holds back."""
    ttft = {}
    for line in log.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "request_finished":
            ttft[event["request_id"]] = event["ttft_s"]
    return ttft


def hit_rate(turns: list[dict]) -> float:
    later = turns[1:]
    return round(sum(t["cached_tokens"] for t in later) / sum(t["prompt_tokens"] for t in later), 4)


def summary(on: dict, off: dict) -> dict:
    mean_ttft = [statistics.mean(t["ttft_s"] for t in run["tool_session"][1:]) for run in (on, off)]
    engine_ttft = [statistics.mean(t["engine_ttft_s"] for t in run["tool_session"][1:]) for run in (on, off)]
    later = on["burst"][1:]
    return {
        "turn_ttft_ratio": round(mean_ttft[0] / mean_ttft[1], 4),
        "engine_turn_ttft_ratio": round(engine_ttft[0] / engine_ttft[1], 4),
        "front_end_ttft_s": round(mean_ttft[0] - engine_ttft[0], 4),
        "session_hit_rate": hit_rate(on["tool_session"]),
        "thinking_session_hit_rate": hit_rate(on["thinking_session"]),
        "burst_cached_fraction": round(
            sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later), 4
        ),  # fmt: skip
        "decode_ratio_cache_on": round(on["decode_tok_s"] / off["decode_tok_s"], 4),
    }


def markdown(report: dict) -> str:
    s, on, off = report["summary"], report["cache_on"], report["cache_off"]
    weights = "FP8 dense, MXFP4 experts" if report["weights"] == "official" else "bf16"
    lines = [f"# Prefix cache — {report['gpu']}, {report['date']}, commit {report['commit']}", "",
             f"`python bench/prefix.py --out bench/results{report['options']}`", "",
             f"{report['layers']} layers" + (" of the tiny checkpoint" if report["smoke"] else " at V4-Flash's width")
             + f", weights {weights}.", "",
             "| metric | value | target |", "|---|---|---|",
             f"| turn_ttft_ratio (turns 2-8, cache / none) | {s['turn_ttft_ratio']} | <= 0.10 |",
             f"| session_hit_rate (turns 2-8) | {s['session_hit_rate']} | >= 0.90 |",
             f"| thinking session hit rate (reported as it is) | {s['thinking_session_hit_rate']} | |",
             f"| burst_cached_fraction (later two) | {s['burst_cached_fraction']} | >= 0.90 |",
             f"| decode_ratio_cache_on | {s['decode_ratio_cache_on']} | >= 0.98 |",
             f"| engine_turn_ttft_ratio (engine's, arrival to first token) | {s['engine_turn_ttft_ratio']} | |",
             f"| front_end_ttft_s (client TTFT - engine TTFT, turns 2-8 with cache) | {s['front_end_ttft_s']} | |", "",
             "TTFT: the client's, to the first chunk with content (the engine's, arrival to first token, in brackets).",
             "", "| turn | prompt tokens | cached | TTFT with cache (s) | TTFT without (s) |",
             "|---|---|---|---|---|"]  # fmt: skip
    for a, b in zip(on["tool_session"], off["tool_session"], strict=True):
        lines.append(f"| {a['turn']} | {a['prompt_tokens']} | {a['cached_tokens']} | {a['ttft_s']} "
                     f"({a['engine_ttft_s']}) | {b['ttft_s']} ({b['engine_ttft_s']}) |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="directory for prefix.json and prefix.md")
    parser.add_argument("--smoke", action="store_true", help="the tiny checkpoint on the CPU, small sizes")
    parser.add_argument("--weights", choices=("official", "bf16"), default="official",
                        help="FP8 dense and MXFP4 experts as V4-Flash ships them, or bf16 throughout")  # fmt: skip
    parser.add_argument("--layers", type=int, help="V4-Flash's own first N layers instead of bench/shapes.py's four")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            from engine.tools.make_tiny import make_tiny

            layout = "official" if args.weights == "official" else "hf"
            model, flags = str(make_tiny(Path(tmp) / "tiny", layout=layout)), SMOKE_FLAGS
        else:
            official = args.weights == "official"
            model_dir = write_model_dir(Path(tmp) / "v4-flash-width", official_formats=official, layers=args.layers)
            model, flags = str(model_dir), ENGINE_FLAGS
        logs = args.out or Path(tmp)  # beside the results, kept also when a run fails
        logs.mkdir(parents=True, exist_ok=True)
        on = measure(model, flags, sizes, logs / "prefix-engine-on.log")
        off = measure(model, [*flags, "--no-prefix-cache"], sizes, logs / "prefix-engine-off.log")
        layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    options = ((" --smoke" if args.smoke else "") + (f" --weights {args.weights}" if args.weights != "official" else "")
               + (f" --layers {args.layers}" if args.layers else ""))  # fmt: skip
    report = {**provenance(), "gpu": on["gpu"], "smoke": args.smoke, "weights": args.weights, "layers": layers,
              "options": options,
              "sizes": sizes, "summary": summary(on, off), "cache_on": on, "cache_off": off}  # fmt: skip
    print(json.dumps(report["summary"], indent=2))
    if args.out:
        (args.out / "prefix.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "prefix.md").write_text(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
