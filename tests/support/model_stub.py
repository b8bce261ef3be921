"""A tiny tokenizer folder for tests that do not run the real engine (see
:mod:`loadgen.bench.stub_tokenizer`, which the gateway benchmark shares)."""

from loadgen.bench.stub_tokenizer import CHATML, write_stub_model

__all__ = ["CHATML", "write_stub_model"]
