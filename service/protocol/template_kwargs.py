"""``chat_template_kwargs``: extra variables for the model's chat template (SGLang and vLLM extension).

SGLang 0.5.23 (``ChatCompletionRequest.chat_template_kwargs``) and vLLM pass a JSON object's entries to
``apply_chat_template`` as template variables: ``{"enable_thinking": false}`` switches Qwen 3's thinking
off, for one. The gateway renders the prompt itself (:mod:`service.pipeline.prompting`) and sends the worker
text,
so the entries go to the gateway's renderer only; the prompt's token count (what the quota reserves and
charges) is that of the prompt they rendered.

Bounds (:func:`check_template_kwargs`): at most :data:`MAX_KWARGS` entries, each named like a template
variable and none named like what the renderer passes itself (:data:`RESERVED`: ``messages``, ``tools``,
``add_generation_prompt``, ...), values nested at most :data:`MAX_DEPTH` deep, :data:`MAX_BYTES` of JSON in
all: a template sees a few switches, not a second prompt.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jinja2.defaults import DEFAULT_NAMESPACE

MAX_KWARGS = 16
"""Entries in one ``chat_template_kwargs`` (templates read a handful: Qwen 3 one, ``enable_thinking``)."""

MAX_BYTES = 4096
"""JSON size of all entries, bytes (UTF-8)."""

MAX_DEPTH = 4
"""Deepest nesting of lists and objects in one value (a scalar is depth 0)."""

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
"""An entry's name: a Jinja variable name (a template cannot read any other), at most 64 characters."""

RESERVED = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
        "raise_exception",
        "strftime_now",
        *DEFAULT_NAMESPACE,  # Jinja's own globals: range, dict, namespace, cycler, joiner, lipsum
    }
)
"""Names the renderer or Jinja gives the template itself (Hugging Face ``apply_chat_template``'s
arguments, the special tokens, its globals): an entry may not replace them."""


def _depth(value: Any) -> int:
    """Nesting of lists and objects in ``value`` (iterative; the JSON parser bounds the input)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            level += 1
            deepest = max(deepest, level)
            if level <= MAX_DEPTH:  # deeper is refused anyway: no need to walk it
                stack.extend((v, level) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """Check ``chat_template_kwargs`` against the bounds of the module docstring.

    Raises:
        ValueError: too many entries, a name that is not a variable name or is reserved, a value nested too
            deeply, too many bytes in all, or a value that is not JSON (the message says which).
    """
    if len(kwargs) > MAX_KWARGS:
        raise ValueError(f"at most {MAX_KWARGS} entries")
    for name, value in kwargs.items():
        if not NAME.match(name):
            raise ValueError(
                f"{name[:64]!r} is not a template variable name (letters, digits, _; 64 at most)"
            )
        if name in RESERVED:
            raise ValueError(f"{name!r} is set by the gateway itself and may not be replaced")
        if _depth(value) > MAX_DEPTH:
            raise ValueError(f"the value of {name!r} nests deeper than {MAX_DEPTH} levels")
    try:
        size = len(json.dumps(kwargs, ensure_ascii=False, allow_nan=False).encode("utf-8"))
    except (ValueError, UnicodeEncodeError):  # NaN or infinity, a lone surrogate
        raise ValueError("values must be JSON (finite numbers, valid Unicode)") from None
    if size > MAX_BYTES:
        raise ValueError(f"at most {MAX_BYTES} bytes of JSON in all")


__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_KWARGS", "RESERVED", "check_template_kwargs"]
