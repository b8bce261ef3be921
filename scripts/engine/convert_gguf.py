"""Convert a GGUF checkpoint (here SmolLM2-135M-Instruct.Q4_1.gguf) into a Hugging Face folder SGLang can load.

Run with the engine venv's python (transformers 5.19 + gguf + torch live there):

    ENGINE_VENV/bin/python convert_gguf.py MODEL.gguf OUT_DIR [--dtype bfloat16|float32]

Recipe: load the GGUF with ``GgufConfig(dequantize=True)`` (weights become plain tensors), build a fresh model
``from_config`` with the ``quantization_config`` removed (so SGLang does not think the folder is quantized),
copy the weights with ``load_state_dict(strict=True)``, and ``save_pretrained`` model and tokenizer (the
tokenizer carries the chat template, written as ``chat_template.jinja``). The output is byte-identical on
every run. bfloat16 (the default, SmolLM2's own dtype) gives a ``model.safetensors`` with sha256
7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b; serve it with ``--dtype float32`` on CPU.
Works offline (set HF_HUB_OFFLINE=1); writes into OUT_DIR, which must not exist yet.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path, help="path of the .gguf file")
    parser.add_argument("out_dir", type=Path, help="output folder (must not exist)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if args.out_dir.exists():
        print(f"convert_gguf: {args.out_dir} already exists", file=sys.stderr)
        return 1
    torch.manual_seed(0)  # from_config initialises weights before they are overwritten; keep it reproducible
    src_dir, name = str(args.gguf.parent), args.gguf.name
    dtype = getattr(torch, args.dtype)

    quantized = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, quantization_config=GgufConfig(dequantize=True), dtype=torch.float32
    )
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(quantized.state_dict(), strict=True)
    del quantized
    model.eval()

    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    if not tokenizer.chat_template:
        print("convert_gguf: the GGUF carries no chat template", file=sys.stderr)
        return 1

    args.out_dir.mkdir(parents=True)
    model.save_pretrained(args.out_dir)
    tokenizer.save_pretrained(args.out_dir)
    print(f"convert_gguf: wrote {args.out_dir} ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
