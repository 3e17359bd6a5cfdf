"""`python bench/demo_model.py --run DIR [--gpu NAME] [--commit SHA] [--train-split N]`: the record of a demo-model
training run (issue 31; DIR as `python -m engine.tools.train_demo --out DIR` leaves it, with its checkpoint): the
recipe, the data mix (each task's share of the samples and of the tokens), the loss curve, the training throughput,
the held-out accuracy per task and, beside it, the accuracy on N fresh samples a task of the training distribution
(default 30; 0: none), which tells a task not yet learned from one learned but not carried to held-out prompts,
retrieval's verdicts split at the sliding window (the needle within it, or beyond, where only c4/c128 rows reach), and
whether each c4 layer's indexer and attention find a needle beyond the window at all (`needle_lookup`). The
accuracies are DIR/eval.json's, or, where it has none (the checkpoint was brought back from the GPU machine without
an evaluation), train_demo.evaluate's on this machine, written there. Results go to bench/results/demo-model.json, .md
and .svg (the loss curve), with the run's GPU, commit and date.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.plots import draw  # noqa: E402
from engine.model.attention import Attention  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from engine.tools import demo_data  # noqa: E402
from engine.tools.train_demo import (  # noqa: E402
    TRAIN_SPLIT_SEED,
    Example,
    Recipe,
    c4_attention,
    dense_warmup,
    evaluate,
    forward_batch,
    initial_model,
)

RESULTS = Path(__file__).resolve().parent / "results"
# The samples drawn (with the run's seed and mix) to measure each task's share of the tokens.
MIX_SAMPLES = 6_000
# Issue 31's bar, on the tasks it names.
TARGET, SCORED = 0.90, ("arithmetic", "json", "tool_call", "retrieval")
# Held-out retrieval prompts (the needle beyond the window) whose lookup through the c4 rows is measured.
LOOKUP_PROMPTS = 24


def mix_shares(recipe: Recipe) -> dict[str, dict[str, float]]:
    counts = demo_data.mix_counts(MIX_SAMPLES)
    config = demo_data.Config(seed=recipe.seed, max_tokens=recipe.max_tokens)
    samples = demo_data.generate("train", counts, config, demo_data.default_tokenizer())
    tokens = {task: 0 for task in counts}
    for s in samples:
        tokens[s.task] += s.prompt_tokens + s.completion_tokens
    total = sum(tokens.values())
    return {
        task: {"samples": round(counts[task] / MIX_SAMPLES, 3), "tokens": round(tokens[task] / total, 3),
               "mean_tokens": round(tokens[task] / counts[task])}
        for task in counts
    }  # fmt: skip


def retrieval_by_window(run: Path, window: int) -> dict[str, dict[str, list[int]]] | None:
    """Retrieval's verdicts in each answers file of `run` split by where the needle lies: within the sliding window
    of the prompt's end (every layer reads it) or beyond it (only the c4 and c128 rows do): [correct, prompts]."""
    split: dict[str, dict[str, list[int]]] = {}
    for name, path in (("held_out", run / "eval_answers.jsonl"), ("train_split", run / "train_answers.jsonl")):
        answers = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        placed = [a for a in answers if "needle_distance" in a]
        if placed:
            split[name] = {side: [sum(a["ok"] for a in group), len(group)] for side, group in (
                ("inside", [a for a in placed if a["needle_distance"] <= window]),
                ("beyond", [a for a in placed if a["needle_distance"] > window]))}  # fmt: skip
    return split or None


def needle_lookup(run: Path, recipe: Recipe, prompts: int = LOOKUP_PROMPTS) -> dict[str, dict[str, float]]:
    """Whether the long-context path finds the needle, apart from whether the answer comes out right: `prompts`
    held-out retrieval prompts whose needle lies beyond the window, each run through the training forward with its
    own completion (the served top-k, not the dense warm-up), at every query that predicts a token of the code. Per
    c4 layer: how often the indexer's top-k holds a row of the needle sentence (`indexer_recall`), the share of the
    main attention's weight over its c4 rows that those rows get, the mean over heads (`attention_mass`) and the
    best head (`best_head_mass`), and what a uniform choice would give them (`uniform`: their count over the rows
    the query sees)."""
    tokenizer = Tokenizer.from_model_dir(run)
    window = recipe.config["sliding_window"]
    drawn = demo_data.generate("eval", {"retrieval": 4 * prompts}, demo_data.Config(seed=recipe.seed,
                               max_tokens=recipe.max_tokens), tokenizer)  # fmt: skip
    placed = [(s, demo_data.needle_distance(s, tokenizer)) for s in drawn]
    far = [(s, distance) for s, distance in placed if distance > window][:prompts]
    model = initial_model(dataclasses.replace(recipe, init=str(run)), torch.device("cpu")).eval()
    dense_warmup(model, False)
    sums: dict[int, dict[str, float]] = {}
    original = Attention._prefill_reference

    def prefill(self, q, proj, positions, p0, span, comp_slots, index_slots):
        if self.indexer is not None:  # one request in one chunk: a query's position is its row
            iq, iw = proj["query"][0][queries], proj["query"][1][queries]
            seen = (queries + 1) // self.ratio
            keys = self.kv.index.read(index_slots).to(iq.dtype)[: int(seen.max())]
            picked = self.indexer.select(iq, iw, queries, keys)
            rows = self.kv.comp.read(comp_slots).to(q.dtype)[: len(keys)]
            visible = torch.arange(len(keys))[None, :] < seen[:, None]
            weights = c4_attention(self, q[queries], rows, visible)
            mine = (needle[None, : len(keys)] & visible).float()
            mass = (weights * mine[:, None, :]).sum(dim=-1)
            totals = sums.setdefault(self.layer_id, dict.fromkeys(
                ("indexer_recall", "attention_mass", "best_head_mass", "uniform", "queries"), 0.0))  # fmt: skip
            hit = needle[picked.clamp(min=0)] & (picked >= 0)
            totals["indexer_recall"] += hit.any(dim=-1).sum().item()
            totals["attention_mass"] += mass.mean(dim=-1).sum().item()
            totals["best_head_mass"] += mass.max(dim=-1).values.sum().item()
            totals["uniform"] += (mine.sum(dim=-1) / seen).sum().item()
            totals["queries"] += len(queries)
        return original(self, q, proj, positions, p0, span, comp_slots, index_slots)

    Attention._prefill_reference = prefill
    try:
        for sample, distance in far:
            start = sample.prompt_tokens - distance
            end = start + len(tokenizer.encode(" " + sample.check["needle"]))
            code = sample.completion.index(sample.check["expected"])
            # The completion is tokenized on its own (Sample.token_ids); before the code it ends at </think>.
            first = sample.prompt_tokens + (len(tokenizer.encode(sample.completion[:code])) if code else 0)
            queries = torch.arange(first - 1, len(sample.token_ids) - 2)  # each predicts a code token
            # A c4 row j pools tokens 4j-4 .. 4j+3 (the overlapping windows): the rows holding a needle token.
            needle = torch.zeros(len(sample.token_ids) // 4 + 1, dtype=torch.bool)
            needle[start // 4 : (end - 1) // 4 + 2] = True
            row = (Example(torch.tensor(sample.token_ids), sample.prompt_tokens),)
            with torch.no_grad():
                model.run_layers(forward_batch(model, [row], torch.device("cpu")))
    finally:
        Attention._prefill_reference = original
    return {str(layer): {k: round(v / t["queries"], 4) for k, v in t.items() if k != "queries"} | {"prompts": len(far)}
            for layer, t in sorted(sums.items())}  # fmt: skip


def record(run: Path, gpu: str | None, commit: str | None, train_split: int = 0) -> dict:
    log = json.loads((run / "train_log.json").read_text())
    recipe = Recipe(**log["recipe"])
    evaluated = run / "eval.json"
    if not evaluated.exists():
        evaluated.write_text(json.dumps({"recipe": log["recipe"], "accuracy": evaluate(run, recipe, "cpu")}) + "\n")
    scores = json.loads(evaluated.read_text())
    if train_split and scores.get("train_split", {}).get("per_task") != train_split:
        scores["train_split"] = {"per_task": train_split, "seed": TRAIN_SPLIT_SEED,
                                 "accuracy": evaluate(run, recipe, "cpu", "train", train_split)}  # fmt: skip
        evaluated.write_text(json.dumps(scores) + "\n")
    accuracy = scores["accuracy"]
    curve = log["curve"]
    return {
        "gpu": gpu or log.get("device", "unknown"),
        "commit": commit or log.get("commit", "unknown"),
        "date": log.get("date", datetime.date.today().isoformat()),
        "recipe": dataclasses.asdict(recipe),
        "mix": mix_shares(recipe),
        "steps": curve[-1]["step"] + 1,
        "calls": log.get("calls", []),
        "tokens": curve[-1]["tokens"],
        "train_tok_s": curve[-1]["tok_s"],
        "final_losses": {k: curve[-1][k] for k in ("lm", "prompt", "mtp", "indexer") if k in curve[-1]},
        "accuracy": accuracy,
        "eval_per_task": recipe.eval_per_task,
        "train_split": scores.get("train_split") if train_split else None,
        "meets_target": {task: accuracy[task] >= TARGET for task in SCORED},
        "window": recipe.config["sliding_window"],
        "retrieval_by_window": retrieval_by_window(run, recipe.config["sliding_window"]),
        "needle_lookup": needle_lookup(run, recipe),
        "curve": curve[::5] + ([curve[-1]] if (len(curve) - 1) % 5 else []),
    }


def markdown(result: dict) -> str:
    r = result["recipe"]
    lines = [
        "# The demo model (issue 31)",
        "",
        f"{result['gpu']}, commit {result['commit']}, {result['date']}.",
        "Trained by `python -m engine.tools.train_demo`; recorded by `python bench/demo_model.py --run DIR`.",
        "",
        "![training losses](demo-model.svg)",
        "",
        f"**Training:** {result['steps']} steps of up to {r['tokens_per_step']:,} tokens (rows of "
        f"{r['row_tokens']:,}), {result['tokens'] / 1e6:.1f}M tokens, the last call at {result['train_tok_s']:,} "
        f"tok/s; seed {r['seed']}, AdamW lr {r['lr']} (warm-up {r['warmup_steps']}, cosine to {r['min_lr_ratio']}x), "
        f"weights: prompt {r['prompt_weight']}, MTP {r['mtp_weight']}, indexer {r['indexer_weight']}"
        + "".join(f", {task}'s completions {w}" for task, w in r.get("task_weights", {}).items())
        + ".",
        "",
    ]
    if result["calls"]:
        lines += [
            "| call | steps | schedule's steps | samples drawn | data seed | replicas |",
            "|---|---|---|---|---|---|",
        ]
        lines += [f"| {i} | {c['first_step']}–{c['last_step']} | {c['recipe']['steps']:,} | "
                  f"{c['recipe']['train_samples']:,} | {c['recipe']['seed'] + c['recipe']['first_step']} | "
                  f"{c['replicas']} |" for i, c in enumerate(result["calls"], 1)]  # fmt: skip
        lines.append("")
    lines += [
        "**Final losses:** " + ", ".join(f"{k} {v}" for k, v in result["final_losses"].items()) + ".",
        "",
        f"## Held-out accuracy ({result['eval_per_task']} prompts a task, greedy, served by the engine on the CPU)",
        "",
    ]
    split = result.get("train_split")
    if split:
        lines += [f"Beside it, the accuracy on {split['per_task']} fresh samples a task of the training distribution "
                  f"(data seed {split['seed']}, which no call drew with): where that is high and the held-out low, "
                  "the task is learned but not carried to unseen phrasings and names.", ""]  # fmt: skip
    train_column = " training split |" if split else ""
    lines += [
        f"| task | accuracy |{train_column} issue 31's bar | share of samples | share of tokens | mean tokens |",
        "|---|---|" + ("---|" if split else "") + "---|---|---|---|",
    ]
    for task, accuracy in result["accuracy"].items():
        mix = result["mix"][task]
        bar = ("met" if result["meets_target"][task] else "**not met**") if task in SCORED else "—"
        trained = f" {split['accuracy'][task]:.2f} |" if split else ""
        lines.append(f"| {task} | {accuracy:.2f} |{trained} {bar} | {mix['samples']:.3f} | {mix['tokens']:.3f} | "
                     f"{mix['mean_tokens']} |")  # fmt: skip
    placed = result.get("retrieval_by_window")
    if placed:
        sides = "; ".join(f"{name.replace('_', ' ')}: " + ", ".join(
            f"{side} {ok}/{n}" + (f" ({ok / n:.2f})" if n else "") for side, (ok, n) in by.items())
            for name, by in placed.items())  # fmt: skip
        lines += ["", f"Retrieval by where the needle lies, within the {result['window']}-token sliding window of the "
                  f"prompt's end or beyond it (read only through the c4 and c128 rows): {sides}."]  # fmt: skip
    lookup = result.get("needle_lookup")
    if lookup:
        layers = "; ".join(f"layer {layer}: the indexer's top-k holds it at {v['indexer_recall']:.2f} of the queries, "
                           f"the main attention gives it {v['attention_mass']:.3f} of its c4 weight (best head "
                           f"{v['best_head_mass']:.3f}; a uniform choice {v['uniform']:.3f})"
                           for layer, v in lookup.items())  # fmt: skip
        prompts = next(iter(lookup.values()))["prompts"]
        lines += ["", f"**The long-context path** ({prompts} held-out retrieval prompts, the needle beyond the window, "
                  f"fed their own completion; at the queries that predict the code): {layers}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a train_demo output directory")
    parser.add_argument("--gpu", help="the GPU it trained on, where its train_log.json does not say")
    parser.add_argument("--commit", help="the commit it trained at, where its train_log.json does not say")
    parser.add_argument(
        "--train-split",
        type=int,
        default=30,
        help="fresh training-distribution samples a task to score beside the held-out ones (0: none)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = record(args.run, args.gpu, args.commit, args.train_split)
    (args.out / "demo-model.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "demo-model.md").write_text(markdown(result))
    draw(args.out, only="demo-model.json")
    print(json.dumps(result["accuracy"]))


if __name__ == "__main__":
    main()
