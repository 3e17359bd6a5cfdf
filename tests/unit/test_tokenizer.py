"""The tiny tokenizer is deterministic and carries the DeepSeek-V4 tokens; the runtime Tokenizer round-trips any
text, streams text without splitting a character, agrees with transformers, and fails clearly on a bad directory."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import tokenizers

from engine.tokenizer import BOS_TOKEN, EOS_TOKEN, SEGMENT_CACHE_TOKENS, SegmentCache, Tokenizer
from engine.tools.tiny_tokenizer import DSV4_TOKENS, build_tiny_tokenizer, save_tiny_tokenizer

FIRST_BYTE_ID = len(DSV4_TOKENS)  # the 256 byte tokens follow the DeepSeek-V4 tokens, in byte order
SPECIAL = [token for token, special in DSV4_TOKENS if special]
MARKUP = [token for token, special in DSV4_TOKENS if not special]

SAMPLES = [
    "Hello, world!",
    "  leading and trailing spaces  \n\ttabs\r\n",
    f"{BOS_TOKEN}You are helpful.<｜User｜>天气怎么样？<｜Assistant｜><think>用户问天气。</think>晴天 ☀️{EOS_TOKEN}",
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
    "<tool_result>{'ok': true}</tool_result> e\u0301 a\u0308\u0323 👨‍👩‍👧 🇫🇷 한국어 עברית",
]

PIECES = [
    *SPECIAL,
    *MARKUP,
    '<｜DSML｜invoke name="f">',
    "</｜DSML｜parameter>",
    "｜｜DSML｜｜",
    "中文",
    "日本語",
    "😀",
    "👨‍👩‍👧",
    "🇯🇵",
    "e\u0301",
    "\u0308",
    "\u200d",
    "\n\n",
    " ",
    "\t",
    "the",
    " model",
    "{}",
    '"key": 1',
]
# Ranges for random code points: ASCII, Latin-1, combining marks, Greek/Cyrillic, Hebrew/Arabic, Hangul, CJK, emoji
# and the supplementary planes; surrogates are left out because they cannot be encoded.
RANGES = [(0x20, 0x7E), (0xA0, 0xFF), (0x300, 0x36F), (0x370, 0x4FF), (0x590, 0x6FF), (0xAC00, 0xD7A3)]
RANGES += [(0x4E00, 0x9FFF), (0xFF00, 0xFFEF), (0x1F300, 0x1FAFF), (0x10000, 0x10FFFF)]


def _random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 30)):
        if rng.random() < 0.3:
            parts.append(rng.choice(PIECES))
        else:
            low, high = rng.choice(RANGES)
            parts.append(chr(rng.randint(low, high)))
    return "".join(parts)


def _without_special(text: str) -> str:
    for token in SPECIAL:
        text = text.replace(token, "")
    return text


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool) -> list[str]:
    detok = tok.detokenizer(skip_special_tokens)
    return [detok.step(i) for i in ids] + [detok.flush()]


def test_build_is_deterministic(model_dir: Path):
    first = build_tiny_tokenizer().to_str()
    assert build_tiny_tokenizer().to_str() == first
    assert (model_dir / "tokenizer.json").read_text() == build_tiny_tokenizer().to_str(pretty=True)


@pytest.mark.parametrize("vocab_size", [FIRST_BYTE_ID + 256, 512, 1024])
def test_vocab_size_is_exact(vocab_size: int):
    assert Tokenizer(build_tiny_tokenizer(vocab_size)).vocab_size == vocab_size


def test_too_small_vocab_is_refused():
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_tokenizer(FIRST_BYTE_ID + 255)


def test_bos_and_eos_are_ids_0_and_1(tok: Tokenizer):
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert (tok.token_id(BOS_TOKEN), tok.token_id(EOS_TOKEN)) == (0, 1)
    assert tok.encode("hi", add_bos=True) == [0, *tok.encode("hi")]
    assert tok.token_id("no such token") is None


@pytest.mark.parametrize(("token_id", "token", "special"), [(i, t, s) for i, (t, s) in enumerate(DSV4_TOKENS)])
def test_each_dsv4_token_is_one_id(tok: Tokenizer, token_id: int, token: str, special: bool):
    assert tok.token_id(token) == token_id
    assert tok.encode(token) == [token_id]
    assert token_id in tok.encode(f"text{token}text")
    assert tok.decode([token_id], skip_special_tokens=False) == token
    # Control tokens vanish from visible text; reasoning and DSML markup must stay for the parsers.
    assert tok.decode([token_id]) == ("" if special else token)


def test_byte_tokens_follow_in_byte_order(tok: Tokenizer):
    text = "A~ é中😀\x00\x7f"
    assert tok.decode([FIRST_BYTE_ID + b for b in text.encode()]) == text


def test_random_unicode_round_trips(tok: Tokenizer):
    rng = random.Random(20260131)
    for _ in range(300):
        text = _random_text(rng)
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == _without_special(text)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streaming_equals_full_decode(tok: Tokenizer, skip_special_tokens: bool):
    rng = random.Random(7)
    streams = [tok.encode(_random_text(rng)) for _ in range(200)]
    # Any id sequence a model may emit: truncated and invalid UTF-8 included.
    streams += [[rng.randrange(tok.vocab_size) for _ in range(40)] for _ in range(200)]
    # Every character split into its single bytes, with control tokens in between.
    byte_ids = [FIRST_BYTE_ID + b for b in "中文 😀 e\u0301 🇫🇷".encode()]
    streams += [byte_ids, byte_ids[:-1], [tok.bos_id, *byte_ids[:4], tok.eos_id, *byte_ids[4:], tok.eos_id]]
    for ids in streams:
        deltas = _stream(tok, ids, skip_special_tokens)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens)


def test_streaming_holds_back_partial_characters(tok: Tokenizer):
    ids = [FIRST_BYTE_ID + b for b in "a中😀".encode()]  # 1 + 3 + 4 byte tokens
    assert _stream(tok, ids, skip_special_tokens=True) == ["a", "", "", "中", "", "", "", "😀", ""]
    # A character cut off at the end comes out on flush, as decode renders it.
    assert _stream(tok, ids[:3], skip_special_tokens=True) == ["a", "", "", "\ufffd"]


def test_autotokenizer_loads_the_saved_files_and_agrees(model_dir: Path, tok: Tokenizer):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert (hf.bos_token_id, hf.eos_token_id, len(hf)) == (0, 1, tok.vocab_size)
    assert hf.chat_template is None
    for text in SAMPLES:
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)


def test_missing_directory_is_named(tmp_path: Path):
    missing = tmp_path / "no-model"
    with pytest.raises(FileNotFoundError, match="no-model"):
        Tokenizer.from_model_dir(missing)


def test_missing_tokenizer_json_is_named(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)


def test_unreadable_tokenizer_json_is_named(tmp_path: Path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)


def test_tokenizer_without_the_deepseek_bos_is_refused(tmp_path: Path):
    tokenizers.Tokenizer(tokenizers.models.BPE()).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="begin▁of▁sentence"):
        Tokenizer.from_model_dir(tmp_path)


def test_a_long_prompt_tokenizes_without_holding_the_other_threads(tok: Tokenizer):
    """The server tokenizes in a worker thread; the engine's thread and the event loop must keep running meanwhile.
    A single `tokenizers` encode holds the GIL throughout (10 MB held every thread for 11 s here); the batch call
    releases it. A thread that wakes every millisecond sees no gap near the encode's own duration."""
    text = "a long prompt, tokenized while others run " * 50_000  # 2.1 MB
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.monotonic()
    try:
        assert len(tok.encode(text)) > 100_000
    finally:
        took = time.monotonic() - started
        done.set()
        ticker.join()
    # Generous for a loaded 2-core machine: the stall it replaced lasted the whole encode.
    assert max(gaps) < max(0.5, took / 3), (max(gaps), took)


def test_text_encoded_a_piece_at_a_time_is_what_one_encode_of_it_gives(model_dir: Path):
    """The pieces between added tokens are encoded alone and kept (engine/tokenizer.py's SegmentCache): random texts
    of added tokens, their look-alikes and any code points encode as the library's one call does, the first time, a
    second time from the kept pieces, and with a cache so small that it keeps dropping pieces."""
    whole = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(7)
    texts = [_random_text(rng) + rng.choice(PIECES) + _random_text(rng) for _ in range(300)]
    texts += [text + " and the next turn" + SPECIAL[2] + "more" for text in texts[:50]]  # a conversation grows
    for max_tokens in (SEGMENT_CACHE_TOKENS, 8):
        tok = Tokenizer.from_model_dir(model_dir)
        tok._segments._max_tokens = max_tokens
        for _ in range(2):
            for text in texts:
                assert tok.encode(text) == whole.encode(text, add_special_tokens=False).ids, repr(text)
        assert tok._segments._tokens <= max_tokens


def test_added_tokens_that_strip_whitespace_leave_the_text_encoded_whole(model_dir: Path):
    """An added token with an lstrip, rstrip or single-word rule eats or needs text around it: no piece-wise encode."""
    stripping = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stripping.add_tokens([tokenizers.AddedToken("<｜pad｜>", lstrip=True)])
    assert SegmentCache.for_tokenizer(stripping) is None
    text = "a  <｜pad｜> b" + SPECIAL[2]
    assert Tokenizer(stripping).encode(text) == stripping.encode(text, add_special_tokens=False).ids


def test_the_demo_tokenizer_makes_every_digit_a_token_and_keeps_the_rest():
    """split_digits (the demo model's): a number's tokens are its digits, whatever digit runs the tiny one merges."""
    demo, tiny = Tokenizer(build_tiny_tokenizer(split_digits=True)), Tokenizer(build_tiny_tokenizer())
    text = "<think>718 + 12 = 730</think>The code is 40962."
    pieces = [demo.decode([i], skip_special_tokens=False) for i in demo.encode(text)]
    assert [p for p in pieces if p.strip().isdigit()] == list("718127304096" + "2")
    assert len(tiny.encode("718")) < 3  # the tiny tokenizer merges digits
    assert demo.decode(demo.encode(text), skip_special_tokens=False) == text
    assert demo.vocab_size == tiny.vocab_size and demo.token_id("</think>") == tiny.token_id("</think>")
