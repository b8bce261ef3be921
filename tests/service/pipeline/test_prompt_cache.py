"""Remembered renders and token counts (service/pipeline/prompt_cache.py) give exactly the uncached answers,
on a
byte-level BPE tokenizer with ChatML special tokens (counted piece by piece) and on tokenizers where that
would not be exact (whole texts remembered instead)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from service.pipeline.prompt_cache import BoundedCache, TokenCounter
from service.pipeline.prompting import PromptError, PromptRenderer
from tests.support.model_stub import CHATML

CORPUS = [
    "You are a concise assistant for an infrastructure team.",
    "Explain in two sentences why a radix cache speeds up shared prompts.",
    "the quick brown fox jumps over the lazy dog 0123456789 !? éü 中文",
] * 20
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
PIECES = [*"ab xé\n中!?", "  ", "<|im_end|>", "<|im_start|>", "<|im_start|>user", "the ", " dog", "0123"]


def bpe_folder(folder: Path, kind: str = "bytelevel") -> Path:
    """A trained BPE tokenizer with ChatML specials and the ChatML template in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None if kind == "bytelevel" else "<unk>"))
    if kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # SentencePiece-like: a space marker prepended to the first piece only
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=alphabet, special_tokens=["<unk>"])
    tok.train_from_iterator(CORPUS, trainer)
    rstrip = kind == "rstrip"
    tok.add_special_tokens([AddedToken(s, rstrip=rstrip, normalized=False) for s in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (folder / "chat_template.jinja").write_text(CHATML)
    return folder


@pytest.fixture(scope="module")
def bytelevel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bpe_folder(tmp_path_factory.mktemp("bpe"))


def test_bounded_cache_keeps_its_bound_least_recently_used_first() -> None:
    cache: BoundedCache[str, int] = BoundedCache(10)
    for key in "abc":
        cache.put(key, ord(key), 3)
    assert cache.weight == 9 and cache.get("a") == ord("a")  # 'a' is now the most recent
    cache.put("d", 4, 3)  # over the bound: 'b', the least recently used, leaves
    assert cache.get("b") is None and cache.get("a") == ord("a") and cache.weight == 9
    cache.put("e", 5, 4)  # then 'c'
    assert cache.get("c") is None and cache.get("d") == 4 and cache.weight == 10 and len(cache) == 3
    cache.put("huge", 1, 11)
    assert cache.get("huge") is None and cache.weight == 10


def test_bytelevel_chatml_counts_piece_by_piece_and_reuses_prefixes(bytelevel: Path) -> None:
    renderer = PromptRenderer(bytelevel)
    assert renderer._counter.by_pieces
    tokenizer = Tokenizer.from_file(str(bytelevel / "tokenizer.json"))
    calls: list[str] = []

    def counted(text: str) -> int:
        calls.append(text)
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    counter = TokenCounter(tokenizer, counted, 10_000)
    system = "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n"
    first = system + "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    second = system + "<|im_start|>user\nthe lazy dog<|im_end|>\n<|im_start|>assistant\n"
    for text in (first, second):
        assert counter.count(text) == len(tokenizer.encode(text, add_special_tokens=False).ids)
    # the system prompt, role lines and separators were tokenized once; the second text only its new piece
    assert calls.count("system\nYou are a concise assistant.") == 1
    assert calls[-1] == "user\nthe lazy dog"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["system", "user", "assistant"]),
            st.lists(st.sampled_from(PIECES), max_size=12).map("".join),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_cached_render_and_count_equal_uncached(bytelevel: Path, messages: list[tuple[str, str]]) -> None:
    cached, plain = _renderers(bytelevel)
    chat = [{"role": role, "content": content} for role, content in messages]
    for _ in range(2):  # first computed, then remembered
        assert cached.render_chat(chat) == plain.render_chat(chat)
        text = "".join(content for _, content in messages)
        assert cached.render_text(text) == plain.render_text(text)
        assert cached.count(text) == len(plain.encode(text))


_RENDERERS: dict[Path, tuple[PromptRenderer, PromptRenderer]] = {}


def _renderers(folder: Path) -> tuple[PromptRenderer, PromptRenderer]:
    if folder not in _RENDERERS:
        _RENDERERS[folder] = (PromptRenderer(folder), PromptRenderer(folder, cache_chars=0))
    return _RENDERERS[folder]


@pytest.mark.parametrize("kind", ["metaspace_first", "rstrip"])
def test_where_pieces_would_not_add_up_whole_texts_are_remembered(tmp_path: Path, kind: str) -> None:
    folder = bpe_folder(tmp_path / kind, kind)
    cached, plain = PromptRenderer(folder), PromptRenderer(folder, cache_chars=0)
    assert not cached._counter.by_pieces
    chat = [{"role": "system", "content": "the quick fox"}, {"role": "user", "content": " lazy dog 01"}]
    for _ in range(2):
        assert cached.render_chat(chat) == plain.render_chat(chat)


def test_invalid_unicode_is_refused_cached_or_not(bytelevel: Path) -> None:
    renderer = PromptRenderer(bytelevel)
    renderer.render_chat([{"role": "user", "content": "fine"}])
    for _ in range(2):
        with pytest.raises(PromptError):
            renderer.render_chat([{"role": "user", "content": "fine"}, {"role": "user", "content": "\ud800"}])


def test_renders_are_remembered_per_messages_and_tools_and_never_for_dated_templates(tmp_path: Path) -> None:
    folder = bpe_folder(tmp_path / "tools")
    (folder / "chat_template.jinja").write_text(
        "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    renderer = PromptRenderer(folder)
    messages = [{"role": "user", "content": "weather?"}]
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    plain = renderer.render_chat(messages).text
    with_tool = renderer.render_chat(messages, [tool]).text
    assert plain == "user: weather?\n" and with_tool.startswith('tools: [{"type": "function"')
    assert renderer.render_chat(messages).text == plain  # the cached render, not the other one
    dated = bpe_folder(tmp_path / "dated")
    template = "{{ strftime_now('%H:%M:%S.%f') }} {{ messages[0]['content'] }}"
    (dated / "chat_template.jinja").write_text(template)
    renderer = PromptRenderer(dated)
    assert renderer.render_chat(messages).text != renderer.render_chat(messages).text
