"""A tiny tokenizer folder for gateways run without the real model (tests, and benchmarks on a machine
where the engine's model is not converted).

Word-level tokenizer (every whitespace-separated word or punctuation mark is one token) and a ChatML
chat template, written with Hugging Face ``tokenizers`` so the gateway's real loading code runs on it.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_stub_model(folder: Path) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    (folder / "chat_template.jinja").write_text(CHATML)
    return folder
