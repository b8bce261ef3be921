"""OpenAI features served on top of SGLang's ``/generate``: tool calling, structured outputs, logprobs,
``n`` > 1 and the Responses API (issue 11)."""
