"""Memory for prompt rendering and token counting: repeated prompts and repeated message prefixes (a
system prompt, a conversation's earlier turns) are not tokenized again.

A chat template wraps every message in the tokenizer's added (special) tokens, and a Hugging Face
tokenizer splits its input at added tokens before anything else (``AddedVocabulary``, leftmost-longest
match), then normalizes, pre-tokenizes and encodes each piece between them on its own. So the token
count of a rendered prompt is the number of added tokens in it plus the counts of the pieces between
them, and each piece's count can be remembered. That holds when no added token strips or widens its
neighbours (``lstrip``/``rstrip``/``single_word``) and nothing depends on a piece's place in the text
(Metaspace's ``prepend_scheme: first``); :func:`added_token_splitter` checks both from the tokenizer's
own description and then on probe texts, and otherwise whole texts are remembered instead.

Both caches are bounded by the characters they hold (least recently used first out).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from tokenizers import Tokenizer

K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """Least-recently-used map bounded by the total weight (characters) of its entries.

    Args:
        max_weight: the bound; 0 keeps nothing.
    """

    def __init__(self, max_weight: int) -> None:
        self._max = max_weight
        self._weight = 0
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        # long prompts are prepared in worker threads (``api.offload_body_bytes``) beside the event loop
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def weight(self) -> int:
        """Total weight held."""
        return self._weight

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or None."""
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
            return found[0]

    def put(self, key: K, value: V, weight: int) -> None:
        """Remember ``value``; entries are dropped, least recently used first, to stay in the bound (a
        value heavier than the bound is not kept)."""
        if weight > self._max:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._weight -= old[1]
            while self._entries and self._weight + weight > self._max:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._weight -= dropped
            self._entries[key] = (value, weight)
            self._weight += weight


def _mentions_first_prepend(node: object) -> bool:
    if isinstance(node, dict):
        if node.get("prepend_scheme") == "first":
            return True
        return any(_mentions_first_prepend(v) for v in node.values())
    if isinstance(node, list):
        return any(_mentions_first_prepend(v) for v in node)
    return False


def added_token_splitter(tokenizer: Tokenizer) -> re.Pattern[str] | None:
    """A pattern matching the tokenizer's added tokens as it splits on them, when counting the pieces
    between them separately gives the count of the whole (see the module); None otherwise."""
    config = json.loads(tokenizer.to_str())
    added = [t for t in config.get("added_tokens") or [] if t.get("content")]
    if not added:
        return None
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None
    if config.get("normalizer") is not None and any(t.get("normalized") for t in added):
        return None
    if _mentions_first_prepend(config.get("pre_tokenizer")) or _mentions_first_prepend(
        config.get("normalizer")
    ):
        return None
    contents = sorted({t["content"] for t in added}, key=len, reverse=True)  # leftmost-longest
    pattern = re.compile("|".join(re.escape(c) for c in contents))
    special = contents[-1]
    probes = [
        f"hello{special}world",
        f"{special}hello  there",
        f"a b{special} c{special}\nd e{special}",
        f" {special}{special}x\n\n y{special}",
    ]
    for probe in probes:
        pieces = _split(pattern, probe)
        counted = sum(1 if special_piece else len(_ids(tokenizer, p)) for p, special_piece in pieces)
        if counted != len(_ids(tokenizer, probe)):
            return None
    return pattern


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def _split(pattern: re.Pattern[str], text: str) -> list[tuple[str, bool]]:
    """``text`` as (piece, is an added token) in order; empty pieces left out."""
    out: list[tuple[str, bool]] = []
    pos = 0
    for match in pattern.finditer(text):
        if match.start() > pos:
            out.append((text[pos : match.start()], False))
        out.append((match.group(), True))
        pos = match.end()
    if pos < len(text):
        out.append((text[pos:], False))
    return out


class TokenCounter:
    """Counts the tokens of texts, remembering the counts of pieces between added tokens (or of whole
    texts where that is not exact).

    Args:
        tokenizer: the model's tokenizer.
        count: the uncached count of one text (tokens; raises on invalid input).
        max_chars: characters of text whose counts are remembered at most.
    """

    def __init__(self, tokenizer: Tokenizer, count: Callable[[str], int], max_chars: int) -> None:
        self._count = count
        self._cache: BoundedCache[str, int] = BoundedCache(max_chars)
        self._splitter = added_token_splitter(tokenizer) if max_chars > 0 else None

    @property
    def by_pieces(self) -> bool:
        """Counts are remembered per piece between added tokens (else per whole text)."""
        return self._splitter is not None

    def _piece(self, text: str) -> int:
        found = self._cache.get(text)
        if found is None:
            found = self._count(text)
            self._cache.put(text, found, len(text))
        return found

    def count(self, text: str) -> int:
        """Tokens in ``text``, exactly as the uncached count."""
        if self._splitter is None:
            return self._piece(text)
        total = 0
        pos = 0
        for match in self._splitter.finditer(text):
            if match.start() > pos:
                total += self._piece(text[pos : match.start()])
            total += 1
            pos = match.end()
        if pos < len(text):
            total += self._piece(text[pos:])
        return total


__all__ = ["BoundedCache", "TokenCounter", "added_token_splitter"]
