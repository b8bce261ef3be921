"""Chat-template rendering and prompt token counting, done in the gateway.

The gateway renders the prompt itself (the model's Jinja chat template, as Hugging Face transformers
does: sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``) and counts its tokens with the
model's ``tokenizer.json`` (Hugging Face ``tokenizers``). That gives the exact prompt-token count for the
quota reservation, the prompt text for cache-aware routing and for resuming a broken stream, and the same
text SGLang would render for its own chat route.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson
from jinja2 import TemplateError, meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from service.pipeline.prompt_cache import BoundedCache, TokenCounter


class PromptError(ValueError):
    """The messages cannot be rendered by the model's chat template."""


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A prompt ready for the engine: its text and its length in tokens."""

    text: str
    num_tokens: int


def _special(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


def _raise(message: str) -> None:
    raise PromptError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Hugging Face's ``tojson`` for chat templates (transformers ``chat_template_utils``): plain
    ``json.dumps``, keys in their order and no HTML escaping, unlike Jinja's built-in filter."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    """Hugging Face's ``strftime_now`` global (Llama 3.x templates print today's date with it)."""
    return datetime.now().strftime(format)


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode`` (the byte-level BPE alphabet; OpenAI's GPT-2 encoder,
    used by Hugging Face ``tokenizers``' ``ByteLevel``): printable character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in mapping.items()}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class PromptRenderer:
    """Renders chat messages with the model's template and counts tokens.

    Rendered chats and token counts are remembered (:mod:`service.pipeline.prompt_cache`): a repeated chat is
    neither rendered nor tokenized again, and a repeated message prefix is not tokenized again.

    Args:
        model_dir: Hugging Face folder with ``tokenizer.json`` and a chat template
            (``chat_template.jinja`` or ``tokenizer_config.json["chat_template"]``).
        cache_chars: characters of prompts (and of prompt pieces) remembered at most, each; 0: none.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` in ``model_dir``.
    """

    def __init__(self, model_dir: Path, cache_chars: int = 4_000_000) -> None:
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._counter = TokenCounter(self._tokenizer, self._count_uncached, cache_chars)
        self._rendered: BoundedCache[bytes, RenderedPrompt] = BoundedCache(cache_chars)
        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.exists():
            config = json.loads(config_path.read_text())
        template_path = model_dir / "chat_template.jinja"
        source = template_path.read_text() if template_path.exists() else config.get("chat_template")
        if isinstance(source, list):  # named templates: take "default"
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        self._template = env.from_string(source) if source else None
        variables = meta.find_undeclared_variables(env.parse(source)) if source else set()
        self.renders_tools = "tools" in variables
        self._dated = bool(source) and "strftime_now" in str(source)
        """The template prints the date or time: its renders are not cached (they change with the clock)."""
        """The chat template lays out ``tools`` itself (Hugging Face ``apply_chat_template(tools=...)``)."""
        self.renders_tool_calls = bool(source) and "tool_calls" in str(source)
        """The chat template writes assistant ``tool_calls`` itself."""
        self._bos = _special(config.get("bos_token"))
        self._eos = _special(config.get("eos_token"))
        spec = json.loads((model_dir / "tokenizer.json").read_text())
        self._byte_level = _uses_byte_level(spec.get("decoder"))
        self._special_ids = frozenset(
            int(t["id"]) for t in spec.get("added_tokens", []) if isinstance(t, dict) and t.get("special")
        )
        self._bytes_of = lru_cache(maxsize=65536)(self._token_bytes)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as the engine tokenizes a raw prompt (no special tokens added).

        Raises:
            PromptError: ``text`` is not valid Unicode (e.g. a lone surrogate such as ``"\\ud800"``).
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PromptError("the prompt is not valid Unicode (lone surrogate)") from exc
        if len(text) > _UNLOCKED_ENCODE_CHARS:
            # the same tokens; Hugging Face tokenizers' batch call releases Python's lock while it works
            # (``encode`` holds it): a long prompt counted in a worker thread leaves the event loop running
            return list(self._tokenizer.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def _count_uncached(self, text: str) -> int:
        return len(self.encode(text))

    def count(self, text: str) -> int:
        """Tokens in ``text`` (see :meth:`encode`). Raises :class:`PromptError` for invalid Unicode."""
        return self._counter.count(text)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> RenderedPrompt:
        """Render ``[{"role", "content", ...}, ...]`` with the generation prompt appended; ``tools`` (OpenAI
        function tools) are passed to the template as Hugging Face's ``apply_chat_template(tools=...)``
        does, and ``template_kwargs`` (a request's ``chat_template_kwargs``, checked by
        :func:`service.protocol.template_kwargs.check_template_kwargs`) as further variables, as its
        ``**kwargs`` (the renderer's own variables win).

        Raises:
            PromptError: the model has no chat template, or the template rejects the messages.
        """
        if self._template is None:
            raise PromptError("the model has no chat template; use /v1/completions")
        key: bytes | None = None
        if not self._dated:
            try:  # the tools and the template's variables shape the prompt too: all make the key
                key = orjson.dumps([messages, tools or None, template_kwargs or None])
            except TypeError:  # not JSON (cannot be a cache key): rendered every time
                key = None
        if key is not None and (found := self._rendered.get(key)) is not None:
            return found
        try:
            text = self._template.render(
                {
                    **(template_kwargs or {}),
                    "messages": list(messages),
                    "tools": list(tools) if tools else None,
                    "add_generation_prompt": True,
                    "bos_token": self._bos,
                    "eos_token": self._eos,
                }
            )
        except (TemplateError, TypeError, ValueError, KeyError, RecursionError) as exc:
            raise PromptError(f"chat template failed: {exc}") from exc
        rendered = RenderedPrompt(text=text, num_tokens=self.count(text))
        if key is not None:
            self._rendered.put(key, rendered, len(key) + len(text))
        return rendered

    # -- output tokens -------------------------------------------------------------------------------
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` as the engine detokenizes an answer (special tokens skipped)."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token (end of turn, ...), which answers do not show."""
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprob ``bytes``): byte-level BPE pieces mapped back
        to bytes, ``<0xNN>`` byte tokens, SentencePiece ``▁`` as a space; special tokens give ``b""``."""
        return bytes(self._bytes_of(token_id))

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special_ids:
            return b""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            decoder = _BYTE_DECODER
            if all(ch in decoder for ch in piece):
                return bytes(decoder[ch] for ch in piece)
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("▁", " ").encode("utf-8")

    def render_text(self, prompt: str) -> RenderedPrompt:
        """A raw completion prompt, counted."""
        return RenderedPrompt(text=prompt, num_tokens=self.count(prompt))


_BYTE_DECODER = _byte_decoder()
_UNLOCKED_ENCODE_CHARS = 4096
"""Texts longer than this are encoded through the batch call, which releases Python's lock (its
per-call overhead is not worth it for short texts)."""


def _uses_byte_level(decoder: Any) -> bool:
    """Whether a ``tokenizer.json`` decoder (possibly a ``Sequence``) includes ``ByteLevel``."""
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(d) for d in decoder.get("decoders") or [])


__all__ = ["PromptError", "PromptRenderer", "RenderedPrompt"]
