"""Pseudo-tokens and deterministic output text of the simulated SGLang worker (no real model).

Tokenization: the regular expression ``\\w+|[^\\w\\s]+`` (a word, or a run of punctuation; whitespace is
dropped), the same rule as Hugging Face's ``Whitespace`` pre-tokenizer. So a prompt has as many
tokens here as the gateway's word-level test tokenizer counts (``tests/support/model_stub.py``); for
English prose it is ~0.75-1x what a BPE tokenizer (Llama 3: ~4 characters a token) would count.

Token ids are stable across processes (BLAKE2b of the token's text, 31 bits), so equal text gives equal
ids and the simulated radix cache hits exactly when a real one would hit on identical prefix text.

Output: the ``i``-th output word of a request is picked from :data:`VOCABULARY` by a hash of the prompt's
ids, ``i`` and a salt (0 for greedy decoding). Greedy output is thus a pure function of the prompt:
reproducible, and a follow-up turn that quotes the answer re-tokenizes to the same ids (cache hit).
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from collections.abc import Sequence

TOKEN_PATTERN = re.compile(r"\w+|[^\w\s]+")

VOCABULARY: tuple[str, ...] = (
    "the", "a", "model", "token", "cache", "prefix", "request", "batch", "server", "worker", "gateway",
    "tenant", "quota", "stream", "answer", "prompt", "radix", "tree", "decode", "prefill", "queue", "time",
    "first", "latency", "throughput", "memory", "kernel", "tensor", "parallel", "simulated", "engine",
    "priority", "fair", "share", "route", "load", "node", "step", "output", "input", "is", "of", "and",
    "to", "in", "on", "with", "for", "fast", "slow", "small", "large", "many", "few", "each", "every",
    "runs", "holds", "keeps", "sends", "reads", "writes", "waits", "serves",
)  # fmt: skip


def token_id(text: str) -> int:
    """Stable id of one token's text (31-bit, never 0)."""
    digest = hashlib.blake2b(text.encode(), digest_size=4).digest()
    return (struct.unpack(">I", digest)[0] & 0x7FFFFFFF) or 1


VOCAB_IDS: dict[int, str] = {token_id(word): word for word in VOCABULARY}


def tokenize(text: str) -> list[int]:
    """Pseudo-token ids of ``text`` (see the module docstring for the rule)."""
    return [token_id(piece) for piece in TOKEN_PATTERN.findall(text)]


def prompt_key(ids: Sequence[int]) -> int:
    """A 64-bit digest of a prompt's token ids (the seed of its output text)."""
    packed = struct.pack(f">{len(ids)}I", *ids)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "big")


def output_token_id(key: int, index: int, salt: int = 0) -> int:
    """Id of output token ``index`` (0-based) for a prompt with digest ``key``; ``salt`` 0 is greedy."""
    digest = hashlib.blake2b(struct.pack(">QQQ", key, index, salt & 0xFFFFFFFFFFFFFFFF), digest_size=4)
    word = VOCABULARY[int.from_bytes(digest.digest(), "big") % len(VOCABULARY)]
    return token_id(word)


def detokenize(ids: Sequence[int]) -> str:
    """Text of output ids produced by :func:`output_token_id` (words joined by single spaces)."""
    return " ".join(VOCAB_IDS.get(i, "?") for i in ids)


def natural_length(key: int, salt: int, eos_per_token: float, limit: int) -> int | None:
    """Where the simulated model "emits EOS" for this prompt, or None if not before ``limit`` tokens.

    Geometric with per-token probability ``eos_per_token``, drawn from the prompt digest (deterministic).
    """
    if eos_per_token <= 0:
        return None
    digest = hashlib.blake2b(struct.pack(">QQ", key, salt & 0xFFFFFFFFFFFFFFFF), digest_size=8).digest()
    u = (int.from_bytes(digest, "big") + 0.5) / 2**64
    # inverse CDF of a geometric distribution on 1, 2, ...
    length = 1 + int(math.log(u) / math.log1p(-min(eos_per_token, 0.999999)))
    return length if length < limit else None
