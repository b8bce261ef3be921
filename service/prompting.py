"""Chat-template rendering and prompt token counting, done in the gateway.

The gateway renders the prompt itself (the model's Jinja chat template, as Hugging Face transformers
does: sandboxed Jinja, ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``) and counts its tokens with the
model's ``tokenizer.json`` (Hugging Face ``tokenizers``). That gives the exact prompt-token count for the
quota reservation, the prompt text for cache-aware routing and for resuming a broken stream, and the same
text SGLang would render for its own chat route.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from service.prompt_cache import BoundedCache, TokenCounter


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


class PromptRenderer:
    """Renders chat messages with the model's template and counts tokens.

    Rendered chats and token counts are remembered (:mod:`service.prompt_cache`): a repeated chat is
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
        self._template = env.from_string(source) if source else None
        self._bos = _special(config.get("bos_token"))
        self._eos = _special(config.get("eos_token"))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as the engine tokenizes a raw prompt (no special tokens added).

        Raises:
            PromptError: ``text`` is not valid Unicode (e.g. a lone surrogate such as ``"\\ud800"``).
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PromptError("the prompt is not valid Unicode (lone surrogate)") from exc
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def _count_uncached(self, text: str) -> int:
        return len(self.encode(text))

    def count(self, text: str) -> int:
        """Tokens in ``text`` (see :meth:`encode`). Raises :class:`PromptError` for invalid Unicode."""
        return self._counter.count(text)

    def render_chat(self, messages: Sequence[dict[str, str]]) -> RenderedPrompt:
        """Render ``[{"role", "content"}, ...]`` with the generation prompt appended.

        Raises:
            PromptError: the model has no chat template, or the template rejects the messages.
        """
        if self._template is None:
            raise PromptError("the model has no chat template; use /v1/completions")
        try:
            key: bytes | None = orjson.dumps(messages)
        except TypeError:  # not JSON (cannot be a cache key): rendered every time
            key = None
        if key is not None and (found := self._rendered.get(key)) is not None:
            return found
        try:
            text = self._template.render(
                messages=list(messages),
                add_generation_prompt=True,
                bos_token=self._bos,
                eos_token=self._eos,
            )
        except TemplateError as exc:
            raise PromptError(f"chat template failed: {exc}") from exc
        rendered = RenderedPrompt(text=text, num_tokens=self.count(text))
        if key is not None:
            self._rendered.put(key, rendered, len(key) + len(text))
        return rendered

    def render_text(self, prompt: str) -> RenderedPrompt:
        """A raw completion prompt, counted."""
        return RenderedPrompt(text=prompt, num_tokens=self.count(prompt))


__all__ = ["PromptError", "PromptRenderer", "RenderedPrompt"]
