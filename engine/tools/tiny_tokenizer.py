"""A deterministic byte-level BPE tokenizer with the DeepSeek-V4 special tokens, for the tiny test checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.tokenizer import BOS_TOKEN, EOS_TOKEN, byte_level_chars

# The DeepSeek-V4 tokens in the order of the chat-format reference (§2), BOS and EOS first so that their ids are 0
# and 1 as in the real checkpoint. `special` tokens are control tokens that decode(skip_special_tokens=True) drops;
# the others are markup that must stay visible to the reasoning and DSML tool-call parsers.
DSV4_TOKENS: tuple[tuple[str, bool], ...] = (
    (BOS_TOKEN, True),
    (EOS_TOKEN, True),
    ("<｜User｜>", True),
    ("<｜Assistant｜>", True),
    ("<｜latest_reminder｜>", True),
    ("<think>", False),
    ("</think>", False),
    ("｜DSML｜", False),
    ("<tool_result>", False),
    ("</tool_result>", False),
    ("<｜action｜>", True),
    ("<｜query｜>", True),
    ("<｜authority｜>", True),
    ("<｜domain｜>", True),
    ("<｜title｜>", True),
    ("<｜read_url｜>", True),
    ("<｜deepseek_image｜>", True),
)

# Matches max_position_embeddings of the tiny model config.
MODEL_MAX_LENGTH = 4096

# The fixed training text: the merges, and so every id after the byte tokens, depend only on these characters.
CORPUS = """\
The engine reads a prompt, splits it into tokens, and runs the model one step at a time. Each step produces the
logits for the next token; the sampler picks one, and the detokenizer turns it back into text for the client.
A request waits in the queue until the scheduler can admit it: there must be room in the cache, a free sequence
slot, and enough of the batch budget left for its prompt. Long prompts are split into chunks so that decoding for
other requests keeps going while a big prefill runs. When memory runs out, the newest request is preempted and
its pages are returned to the pool; it starts again later from the tokens it has already produced.

The operator opens the console, picks a profile, and starts a qualification run. Every gate stores what it saw,
whether it passed or failed, and the console proposes a decision. Only a person may promote a profile to
production, and every change of state is written to the audit log with the time, the operator and the reason.

It was a quiet morning. The rain had stopped before dawn, and the streets were still wet when the first trains
left the station. People walked with their coats open, talking about the weather, the news, and the price of
bread. A small dog followed a child across the square, and an old man on a bench fed the pigeons from a paper bag.
By noon the sun was warm, the cafes were full, and nobody remembered that the forecast had promised a storm.

Numbers and dates appear everywhere: 0 1 2 3 4 5 6 7 8 9, 10, 42, 128, 256, 1024, 4096, 65536, 3.14159, 2.71828,
1e-6, -17, +23, 99%, $19.99, 2026-01-31, 12:45:07, version 0.1.0, and the answer is 7 * 6 = 42.

def softmax(logits: list[float], temperature: float = 1.0) -> list[float]:
    scaled = [x / temperature for x in logits]
    peak = max(scaled)
    exps = [math.exp(x - peak) for x in scaled]
    total = sum(exps)
    return [e / total for e in exps]


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens

    def admit(self) -> list[Request]:
        admitted = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_prompt_tokens > budget:
                break
            budget -= request.num_prompt_tokens
            admitted.append(self.waiting.pop(0))
        self.running.extend(admitted)
        return admitted

for i in range(10):
    if i % 2 == 0:
        print(f"even: {i}")
    else:
        print(f"odd: {i}")

{"model": "deepseek-v4-flash", "messages": [{"role": "system", "content": "You are a helpful assistant."},
 {"role": "user", "content": "What is the weather in Paris today?"}], "temperature": 0.6, "top_p": 0.95,
 "max_tokens": 512, "stream": true, "tools": [{"type": "function", "function": {"name": "get_weather",
 "description": "Get the current weather for a city", "parameters": {"type": "object", "properties":
 {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
 "required": ["city"]}}}]}
{"id": "chatcmpl-123", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
 "message": {"role": "assistant", "content": "It is sunny and 21 degrees.", "reasoning_content": null}}],
 "usage": {"prompt_tokens": 57, "completion_tokens": 9, "total_tokens": 66}}

<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is the weather in Paris?<｜Assistant｜><think>The user
wants the weather, so I should call the tool.</think>

<｜DSML｜tool_calls>
<｜DSML｜invoke name="get_weather">
<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>
</｜DSML｜invoke>
</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>{"temperature": 21, "sky": "clear"}</tool_result>

今天天气很好，我们去公园散步吧。模型把文本切分成词元，然后逐个生成新的词元。
请用中文回答这个问题，并给出简短的理由。北京、上海、广州和深圳都是大城市。
東京の天気は晴れです。明日は雨が降るかもしれません。ありがとうございます。
오늘은 날씨가 좋습니다. 감사합니다. 안녕하세요, 만나서 반갑습니다.
Ünïcödé àccénts: café, naïve, résumé, Zürich, São Paulo, Kraków, İstanbul, Ελληνικά, русский язык, עברית, العربية.
Emoji: 😀 😂 🎉 🚀 👍 ❤️ 🔥 ✨ 🤖 🌍 👨‍👩‍👧 🇫🇷 ✅ ❌ ⚠️ — “quotes”, ‘single’, «guillemets», … and • bullets.
"""


def build_tiny_tokenizer(vocab_size: int = 1024, split_digits: bool = False) -> Tokenizer:
    """Ids: the DeepSeek-V4 tokens, then the 256 byte tokens in byte order, then the merges learned on CORPUS. With
    `split_digits` (the demo model's tokenizer) every digit is a token of its own, as in DeepSeek's tokenizers: a
    number's tokens then are its digits, the same in every number, which arithmetic needs (the tiny tokenizer merges
    some digit pairs and triples, so a number splits by which of them it happens to hold)."""
    num_merges = vocab_size - len(DSV4_TOKENS) - 256
    if num_merges < 0:
        raise ValueError(f"vocab_size must be at least {len(DSV4_TOKENS) + 256}, got {vocab_size}")

    # Learn the merges first, then lay the ids out ourselves: the trainer would number the bytes by character and
    # could only add every DeepSeek token as special.
    trainee = Tokenizer(models.BPE())
    trainee.pre_tokenizer = _pre_tokenizer(split_digits)
    trainer = trainers.BpeTrainer(
        vocab_size=256 + num_merges, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    trainee.train_from_iterator([CORPUS], trainer)
    merges = [tuple(pair) for pair in json.loads(trainee.to_str())["model"]["merges"]]
    if len(merges) != num_merges:
        raise ValueError(f"the corpus yields {len(merges)} merges, fewer than vocab_size={vocab_size} needs")

    tokens = [token for token, _ in DSV4_TOKENS] + byte_level_chars() + [left + right for left, right in merges]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer(split_digits)
    tokenizer.decoder = decoders.ByteLevel()
    # Already in the vocabulary, so they keep their ids; as added tokens they match whole inside any text.
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, special in DSV4_TOKENS if special]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t, special in DSV4_TOKENS if not special])
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ValueError(f"built {tokenizer.get_vocab_size(with_added_tokens=True)} tokens, expected {vocab_size}")
    return tokenizer


def _pre_tokenizer(split_digits: bool) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if not split_digits:
        return byte_level
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])


def save_tiny_tokenizer(out_dir: Path, vocab_size: int = 1024, split_digits: bool = False) -> None:
    """Write `tokenizer.json` and a `tokenizer_config.json` that `transformers.AutoTokenizer` can load."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(vocab_size, split_digits).save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")
