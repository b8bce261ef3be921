"""Gateway benchmark: radixgate against sglang-router, LiteLLM and a direct baseline on an instant
fake SGLang upstream (``python -m loadgen bench-gateway``)."""
