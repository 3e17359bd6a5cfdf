"""The demo model's data (engine/tools/demo_data.py): reproducible samples of every task, rendered as the server
renders them, tool calls that the DSML parser reads back into schema-valid arguments, checkers that accept the
reference answers and refuse wrong ones, train and eval drawn from disjoint banks, the held-out guard against the
qualification gates' texts, and retrieval prompts of the requested length with the code at the stated depth."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from app.qualification.gates import answers, base, context, responses, tools
from engine.server.chat_encoding import ASSISTANT, BOS, EOS, THINK_END, THINK_START, declare, encode_messages
from engine.server.dsml import parse_output
from engine.server.protocol import Limits, parse_chat
from engine.tools import demo_data
from engine.tools.demo_data import (
    EVAL,
    MIN_MAX_TOKENS,
    TASKS,
    TRAIN,
    Config,
    HeldOutLeak,
    Sample,
    check_held_out,
    generate,
    held_out_texts,
    mix_counts,
    render,
    schema_errors,
    score,
    without_held_out,
)

QUALIFICATION_MD = demo_data.QUALIFICATION_MD
QUALIFICATION_MISSING = f"qualification.md not found at {QUALIFICATION_MD} (the shared/ folder beside the repository)"

# The gates' own texts as the console defines them. The tool is held out by its name and description: its JSON
# schema's boilerplate (`"parameters": {"type": "object", "properties": {`) is the format every tool is written in.
GATE_TEXTS = [
    answers.SMOKE_PROMPT,
    answers.JSON_PROMPT,
    tools.TOOLS_SYSTEM_LINE,
    tools.TOOLS_USER,
    tools.TOOL_RESULT,
    tools.TOOL_RESULT_USER,
    responses.RESPONSES_INPUT,
    base.HAYSTACK_SENTENCE,
    base.NEEDLE_SENTENCE,
    base.NEEDLE_QUESTION,
    base.PERF_FILLER.strip(),
    context.SHAPE_QUESTION,
    tools.GET_WEATHER["function"]["name"],
    tools.GET_WEATHER["function"]["description"],
]


@pytest.fixture(scope="module")
def tokenizer():
    return demo_data.default_tokenizer()


@pytest.fixture(scope="module")
def train(tokenizer) -> list[Sample]:
    return generate("train", mix_counts(350), Config(seed=3), tokenizer)


@pytest.fixture(scope="module")
def evaluation(tokenizer) -> list[Sample]:
    return generate("eval", dict.fromkeys(TASKS, 12), Config(seed=3), tokenizer)


@pytest.fixture(scope="module")
def samples(train, evaluation) -> list[Sample]:
    return train + evaluation


def of_task(samples: list[Sample], task: str) -> list[Sample]:
    return [s for s in samples if s.task == task]


def test_generation_is_deterministic_for_a_seed(tokenizer):
    counts = dict.fromkeys(TASKS, 4)
    first = [dataclasses.asdict(s) for s in generate("train", counts, Config(seed=11), tokenizer)]
    again = [dataclasses.asdict(s) for s in generate("train", counts, Config(seed=11), tokenizer)]
    other = [dataclasses.asdict(s) for s in generate("train", counts, Config(seed=12), tokenizer)]
    assert first == again
    assert [s["prompt"] for s in first] != [s["prompt"] for s in other]


def test_a_sample_does_not_depend_on_the_other_counts(tokenizer):
    few = generate("eval", {"arithmetic": 3, "json": 2}, Config(seed=5), tokenizer)
    more = generate("eval", {"arithmetic": 6}, Config(seed=5), tokenizer)
    assert [s.prompt for s in few[:3]] == [s.prompt for s in more[:3]]


def test_the_mix_covers_every_task():
    assert mix_counts(len(TASKS)) == dict.fromkeys(TASKS, 1)
    counts = mix_counts(1000)
    assert sum(counts.values()) == 1000 and set(counts) == set(TASKS)
    assert counts == {task: round(1000 * fraction) for task, fraction in demo_data.DEFAULT_MIX.items()}
    assert sum(mix_counts(101, {"arithmetic": 1, "retrieval": 2}).values()) == 101
    with pytest.raises(ValueError, match="unknown tasks"):
        mix_counts(10, {"poetry": 1.0})


def test_every_task_appears_in_both_splits(train, evaluation):
    assert {s.task for s in train} == set(TASKS)
    assert {s.task for s in evaluation} == set(TASKS)
    assert {s.thinking for s in train} == {True, False}


def test_prompts_are_what_the_server_renders_for_the_request(samples, tokenizer):
    limits = Limits(served_model_name="tiny", context_length=8192, kv_capacity_tokens=8192, vocab_size=1024)
    for sample in samples:
        mode = "thinking" if sample.thinking else "chat"
        effort = "low" if sample.thinking else None
        assert sample.prompt == encode_messages(
            declare(sample.messages, sample.tools or []), mode, reasoning_effort=effort
        )
        assert sample.prompt.startswith(BOS)
        assert sample.prompt.endswith(ASSISTANT + (THINK_START if sample.thinking else THINK_END))
        assert sample.prompt + sample.completion == render(
            [*sample.messages, sample.answer], sample.tools, sample.thinking
        )
        assert sample.completion.endswith(EOS)
        request = parse_chat(json.loads(json.dumps(sample.request())), tokenizer, limits, None)
        assert request.prompt_ids == tokenizer.encode(sample.prompt), sample.id
        assert request.thinking == sample.thinking and request.tools_offered == bool(sample.tools)


def test_prompt_and_completion_tokenize_apart_as_together(samples, tokenizer):
    for sample in samples:
        ids = tokenizer.encode(sample.prompt + sample.completion)
        assert ids == tokenizer.encode(sample.prompt) + tokenizer.encode(sample.completion) == sample.token_ids
        assert (sample.prompt_tokens, sample.completion_tokens) == (
            len(tokenizer.encode(sample.prompt)),
            len(tokenizer.encode(sample.completion)),
        )
        assert len(ids) <= demo_data.DEFAULT_MAX_TOKENS


def test_tool_calls_parse_back_into_the_intended_schema_valid_call(samples):
    calls = of_task(samples, "tool_call")
    assert calls
    for sample in calls:
        parsed = parse_output(sample.completion, tools_offered=True, thinking=sample.thinking)
        assert not parsed.malformed and parsed.content == ""
        assert [c.name for c in parsed.tool_calls] == [sample.check["name"]]
        arguments = json.loads(parsed.tool_calls[0].arguments)
        assert arguments == sample.check["arguments"]
        offered = {t["function"]["name"]: t["function"]["parameters"] for t in sample.tools}
        assert offered[sample.check["name"]] == sample.check["parameters"]
        jsonschema.validate(arguments, sample.check["parameters"])
        assert schema_errors(arguments, sample.check["parameters"]) == []


def test_the_schema_validator_agrees_with_jsonschema(samples):
    checked = 0
    for sample in of_task(samples, "tool_call"):
        schema, arguments = sample.check["parameters"], sample.check["arguments"]
        name, spec = next(iter(schema["properties"].items()))
        wrong = {"string": 7, "integer": "7", "number": True, "boolean": "yes", "array": "a"}[spec["type"]]
        variants = [
            arguments,
            {k: v for k, v in arguments.items() if k not in schema["required"][:1]},
            {**arguments, name: wrong},
            {**arguments, "unlisted": 1},
            {**arguments, name: "not-an-option"} if "enum" in spec else arguments,
            {**arguments, name: spec["maximum"] + 1} if "maximum" in spec else arguments,
            {**arguments, name: [1]} if spec["type"] == "array" else arguments,
            {**arguments, name: 3.0} if spec["type"] == "integer" else arguments,
        ]
        for value in variants:
            valid = jsonschema.Draft202012Validator(schema).is_valid(value)
            assert (schema_errors(value, schema) == []) == valid, (schema, value)
            checked += 1
    assert checked > 50


def _completion(sample: Sample, answer: dict) -> str:
    """The completion the model would write for a different answer message."""
    full = render([*sample.messages, answer], sample.tools, sample.thinking)
    assert full.startswith(sample.prompt)
    return full[len(sample.prompt) :]


def _with_content(sample: Sample, content: str) -> str:
    return _completion(sample, {**sample.answer, "content": content})


def _wrong_completions(sample: Sample) -> list[str]:
    """Answers each checker must refuse."""
    expected = sample.check.get("expected")
    if sample.task == "arithmetic":
        return [_with_content(sample, str(int(expected) + 1)), _with_content(sample, f"The answer is {expected}.")]
    if sample.task == "python":
        code = sample.check["code"]
        return [
            _with_content(
                sample, f"```python\n{code.replace('return ', 'return 1 + ').replace(': ', ': 1 + ', 1)}\n```"
            ),
            _with_content(sample, f"```python\n{code[:-2]}\n```"),
        ]
    if sample.task == "json":
        obj = sample.check["expected"]
        first = next(iter(obj))
        other = "a string" if sample.check["types"][first] != "string" else 5
        return [
            _with_content(sample, json.dumps({k: v for k, v in obj.items() if k != first})),
            _with_content(sample, json.dumps({**obj, first: other})),
            _with_content(sample, json.dumps({**obj, "extra": 1})),
            _with_content(sample, "Here it is: " + json.dumps(obj)),
        ]
    if sample.task == "tool_call":
        call = sample.answer["tool_calls"][0]
        schema = sample.check["parameters"]
        required = schema["required"][0]
        wrong_type = {"string": 7, "integer": "7", "number": "x", "boolean": "no", "array": 3}
        bad_arguments = {**sample.check["arguments"], required: wrong_type[schema["properties"][required]["type"]]}
        rename = {**call, "function": {**call["function"], "name": "no_such_tool"}}
        retype = {**call, "function": {**call["function"], "arguments": json.dumps(bad_arguments)}}
        return [
            _completion(sample, {**sample.answer, "tool_calls": [rename]}),
            _completion(sample, {**sample.answer, "tool_calls": [retype]}),
            _completion(sample, {**sample.answer, "tool_calls": []}),
        ]
    if sample.task == "tool_result":
        return [_with_content(sample, "I could not read the result."), _with_content(sample, expected[0][:-1] + "#")]
    if sample.task == "exact_reply":
        return [_with_content(sample, f"Sure: {expected}"), _with_content(sample, expected + "!")]
    assert sample.task == "retrieval"
    return [_with_content(sample, expected[:-1] + ("0" if expected[-1] != "0" else "1")), _with_content(sample, "")]


def test_checkers_accept_the_reference_and_refuse_wrong_answers(samples):
    for sample in samples:
        assert score(sample.task, sample, sample.completion), sample.id
        assert score(sample.task, sample, sample.completion.removesuffix(EOS)), "EOS is optional"
        for wrong in _wrong_completions(sample):
            assert not score(sample.task, sample, wrong), (sample.id, wrong)


def test_checkers_read_the_jsonl_record(evaluation):
    for sample in evaluation:
        record = json.loads(json.dumps(dataclasses.asdict(sample)))
        assert score(sample.task, record, sample.completion)


def test_python_checker_ignores_layout(evaluation):
    sample = of_task(evaluation, "python")[0]
    code = sample.check["code"]
    spaced = code.replace("(", "( ").replace(")", " )")
    assert score("python", sample, _with_content(sample, f"{code}  # done"))
    assert score("python", sample, _with_content(sample, f"```python\n{spaced}\n```"))


def test_train_and_eval_banks_are_disjoint(train, evaluation):
    train_templates, eval_templates = TRAIN.templates(), EVAL.templates()
    assert not set(train_templates.values()) & set(eval_templates.values())
    assert all(tid.startswith("train.") for tid in train_templates)
    assert all(tid.startswith("eval.") for tid in eval_templates)
    for split, samples, templates in (("train", train, train_templates), ("eval", evaluation, eval_templates)):
        used = {tid for s in samples for tid in s.template.split("+")}
        assert used <= set(templates) | {f"{split}.python_desc.{i}" for i in range(len(demo_data.PYTHON_OPS))}

    def pools(bank):
        return {
            "tool verbs": set(bank.tool_verbs),
            "tool nouns": set(bank.tool_nouns),
            "parameters": {p.name for p in bank.params},
            "parameter values": {v for p in bank.params for v in p.values},
            "json keys": set(bank.json_keys),
            "json words": set(bank.json_words),
            "python names": {n for names in bank.python_names.values() for n in names},
            "python parameters": {n for names in bank.python_params.values() for n in names},
            "result fields": set(bank.result_fields),
            "exact words": set(bank.exact_words),
            "filler words": {w for words in bank.filler.words.values() for w in words},
            "code kinds": set(bank.code_kinds),
            "code words": set(bank.code_words),
            "system lines": set(bank.system_lines),
        }

    for (name, ours), theirs in zip(pools(TRAIN).items(), pools(EVAL).values(), strict=True):
        assert not ours & theirs, f"{name} shared by train and eval: {ours & theirs}"
    tool_names = {split: {t["function"]["name"] for s in group for t in s.tools or []} for split, group in
                  (("train", train), ("eval", evaluation))}  # fmt: skip
    assert tool_names["train"] and tool_names["eval"] and not tool_names["train"] & tool_names["eval"]
    assert tools.GET_WEATHER["function"]["name"] not in tool_names["train"]


def test_the_held_out_guard_passes_for_the_default_generator_against_the_gates(train, tokenizer):
    assert check_held_out(train, GATE_TEXTS, tokenizer) > 100


@pytest.mark.skipif(not QUALIFICATION_MD.exists(), reason=QUALIFICATION_MISSING)
def test_the_held_out_guard_passes_against_qualification_md(train, tokenizer):
    texts = held_out_texts(QUALIFICATION_MD)
    for gate_text in (answers.SMOKE_PROMPT, answers.JSON_PROMPT, tools.TOOLS_USER, tools.TOOL_RESULT,
                      tools.TOOL_RESULT_USER, responses.RESPONSES_INPUT, base.NEEDLE_SENTENCE):  # fmt: skip
        assert gate_text in texts
    assert check_held_out(train, texts, tokenizer) > 100


@pytest.mark.parametrize("gate_text", [answers.SMOKE_PROMPT, tools.TOOL_RESULT_USER, base.NEEDLE_SENTENCE])
def test_the_held_out_guard_refuses_a_sample_that_copies_a_gate_prompt(train, tokenizer, gate_text):
    sample = train[len(train) // 2]
    planted = _with_prompt(sample, sample.prompt.replace("<｜User｜>", f"<｜User｜>Hi. {gate_text} ", 1), tokenizer)
    with pytest.raises(HeldOutLeak, match=f"^{planted.id} .* with the held-out text") as error:
        check_held_out([*train[:5], planted], GATE_TEXTS, tokenizer)
    assert error.value.sample_id == planted.id and error.value.text == gate_text
    assert error.value.run.strip() in gate_text and len(tokenizer.encode(error.value.run)) >= demo_data.HELD_OUT_RUN


def _with_prompt(sample: Sample, prompt: str, tokenizer) -> Sample:
    """The sample with another prompt, tokenized as generate tokenizes one."""
    prompt_ids = tokenizer.encode(prompt)
    return dataclasses.replace(sample, prompt=prompt, prompt_tokens=len(prompt_ids),
                               token_ids=prompt_ids + tokenizer.encode(sample.completion))  # fmt: skip


def test_training_leaves_out_the_samples_that_share_a_run_with_the_gates(train, tokenizer):
    """A made-up word can spell the start of a gate's text: training drops such a sample instead of stopping."""
    sample = train[len(train) // 2]
    planted = _with_prompt(
        sample, sample.prompt.replace("<｜User｜>", f"<｜User｜>{base.NEEDLE_SENTENCE} ", 1), tokenizer
    )
    kept = without_held_out([*train[:5], planted], GATE_TEXTS, tokenizer)
    assert kept == train[:5]
    assert check_held_out(kept, GATE_TEXTS, tokenizer) > 100


def test_held_out_texts_reads_the_gate_section(tmp_path):
    md = tmp_path / "qualification.md"
    md.write_text(
        '# Q\n## 1. Before\n| x | "Not a gate prompt at all, just prose." |\n'
        "## 2. Qualification gates\n"
        '| smoke | user: "Write a Python one-liner that returns the sum of a list `xs`." | `sum(` |\n'
        '| json | user: `Return ONLY a JSON object: {"language":"python","ok":true}. No prose.` |\n'
        '| responses | `{model, input:"Reply with exactly READY", max_output_tokens}` |\n'
        "## 3. After\n"
    )
    texts = held_out_texts(md)
    assert "Write a Python one-liner that returns the sum of a list `xs`." in texts
    assert 'Return ONLY a JSON object: {"language":"python","ok":true}. No prose.' in texts
    assert "Reply with exactly READY" in texts
    assert "Not a gate prompt at all, just prose." not in texts


def test_retrieval_prompts_reach_the_length_with_the_code_at_its_depth(tokenizer):
    config = Config(seed=9, max_tokens=4160, retrieval_min_tokens=4000)  # at least 4K-token prompts
    long = generate("train", {"retrieval": 4}, config, tokenizer)
    short = generate("eval", {"retrieval": 8}, Config(seed=9), tokenizer)
    assert min(s.prompt_tokens for s in long) >= 4000
    for sample in long + short:
        target = sample.check["target_tokens"]
        assert 0.9 * target <= sample.prompt_tokens <= 1.1 * target, sample.id
        content = sample.messages[-1]["content"]
        filler = content.rsplit("\n\n", 1)[0]
        before, after = filler.split(sample.check["needle"])
        haystack = [len(tokenizer.encode(" " + s)) for s in (before + after).replace(". ", ".\n").split("\n") if s]
        position = len(tokenizer.encode(before)) / (len(tokenizer.encode(before)) + len(tokenizer.encode(after)))
        tolerance = (max(haystack) + 2) / sum(haystack)
        assert abs(position - sample.check["depth"]) <= tolerance, (sample.id, position, sample.check["depth"])
        assert sample.answer["content"] == sample.check["expected"] in sample.check["needle"]


def test_the_needle_distance_counts_the_prompt_ids_from_the_needle_sentence_to_the_end(tokenizer):
    """The tokens the sample itself holds: the ids before the distance are the head's own tokenization, the ones after
    begin with the needle sentence (the space before it included), at every depth of both splits."""
    samples = [*generate("train", {"retrieval": 12}, Config(seed=5), tokenizer),
               *generate("eval", {"retrieval": 12}, Config(seed=5), tokenizer)]  # fmt: skip
    distances = []
    for sample in samples:
        distance = demo_data.needle_distance(sample, tokenizer)
        cut = sample.prompt_tokens - distance
        head, tail = sample.token_ids[:cut], sample.token_ids[cut : sample.prompt_tokens]
        assert tokenizer.decode(tail, skip_special_tokens=False).lstrip().startswith(sample.check["needle"])
        assert sample.prompt.startswith(tokenizer.decode(head, skip_special_tokens=False))
        distances.append(distance)
    assert min(distances) <= 128 < max(distances)  # both sides of the demo model's window


def test_config_refuses_a_context_a_tool_sample_cannot_fit():
    with pytest.raises(ValueError, match="max_tokens"):
        Config(max_tokens=512)


def test_a_tool_sample_over_the_context_is_drawn_again_to_fit(tokenizer):
    """Three tools of made-up names reach ~3,900 tokens; at the smallest context they are drawn again, not refused."""
    config = Config(seed=11, max_tokens=MIN_MAX_TOKENS)
    samples = demo_data.generate("train", {"tool_call": 60, "tool_result": 60}, config, tokenizer)
    assert len(samples) == 120 and max(s.prompt_tokens + s.completion_tokens for s in samples) <= MIN_MAX_TOKENS


def test_the_cli_writes_train_and_eval_jsonl(tmp_path):
    md = tmp_path / "qualification.md"
    quoted = (f"`{text}`" if '"' in text else f'"{text}"' for text in GATE_TEXTS)
    md.write_text("## 2. Gates\n" + "".join(f"| {text} |\n" for text in quoted) + "## 3. End\n")
    out = tmp_path / "data"
    command = ["--out", str(out), "--seed", "1", "--train", "30", "--eval", "2", "--held-out", str(md)]
    # Its own process: the CLI configures logging for the whole interpreter.
    done = subprocess.run([sys.executable, "-m", "engine.tools.demo_data", *command], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    rows = {split: [json.loads(line) for line in (out / f"{split}.jsonl").open()] for split in ("train", "eval")}
    assert len(rows["train"]) == 30 and len(rows["eval"]) == 2 * len(TASKS)
    assert all(score(r["task"], r, r["completion"]) for r in rows["eval"])
    assert "train: 30 samples" in done.stdout and "retrieval" in done.stdout
    assert '"event": "held_out_guard"' in done.stderr


def test_the_cli_needs_the_held_out_texts(tmp_path, capsys):
    with pytest.raises(SystemExit):
        demo_data.main(["--out", str(tmp_path), "--held-out", str(tmp_path / "missing.md")])
    assert "--held-out PATH" in capsys.readouterr().err


def test_the_module_has_no_console_import():
    source = Path(demo_data.__file__).read_text()
    assert "from app" not in source and "import app" not in source


def test_phrasings_combine_every_alternative_of_each_slot_into_a_sentence():
    made = demo_data.phrasings(("", "please "), ("say {x}", "write {x}"), (".", " now."))
    assert len(made) == 8 and made[0] == "Say {x}." and "Please write {x} now." in made


def test_training_haystacks_start_shorter_than_the_held_out_ones(tokenizer):
    train = generate("train", {"retrieval": 60}, Config(seed=4), tokenizer)
    held_out = generate("eval", {"retrieval": 20}, Config(seed=4), tokenizer)
    assert min(s.check["target_tokens"] for s in train) < demo_data.RETRIEVAL_MIN_TOKENS
    assert min(s.check["target_tokens"] for s in train) >= demo_data.RETRIEVAL_TRAIN_MIN_TOKENS
    assert min(s.check["target_tokens"] for s in held_out) >= demo_data.RETRIEVAL_MIN_TOKENS


def test_both_splits_name_the_operators_in_the_same_words(train, evaluation):
    for samples in (train, evaluation):
        words = [w for s in of_task(samples, "arithmetic") for ws in demo_data.OP_WORDS.values() for w in ws
                 if f" {w} " in s.messages[-1]["content"]]  # fmt: skip
        assert words, "no arithmetic prompt names its operator in words"


def test_the_arithmetic_working_holds_at_every_step_and_ends_at_the_result():
    """Every equation of the reasoning's working is true (each side evaluated as Python) for every operand pair of
    the trained ranges, and its last number is the answer."""
    import re

    for op, (low, high) in demo_data.OPERAND_RANGES.items():
        for a in range(low, high + 1):
            for b in range(low, high + 1):
                work = demo_data.arithmetic_work(a, op, b)
                result = eval(f"{a} {op} {b}")
                assert re.findall(r"-?\d+", work)[-1] == str(result), work
                for sentence in re.split(r"\.(?: |$)", work):
                    sides = [s.removeprefix("So ") for s in sentence.split(" = ") if s]
                    assert len({eval(side) for side in sides}) <= 1, work
