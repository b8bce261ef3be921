"""Tool calls read out of a model's answer piece by piece, in the order written, the same for a streamed
answer and a whole one; the call syntax of each model family is :mod:`service.openai.tool_formats`'.
"""

from __future__ import annotations

from service.openai.tool_formats import ParseStep, ToolCallFormat


class CallParser:
    """Splits one answer into content and tool calls, piece by piece, in the order written
    (:attr:`ParseStep.parts`); the result does not depend on how the answer was cut into pieces, so a
    streamed answer gives what the whole one gives (``tests/service/openai/test_stream_folds.py`` cuts it
    at every boundary).

    Rules: text before a call block is content, except the whitespace right before the block; whitespace
    after a call is dropped; a block that is not a valid call of a declared function stays content,
    as written, unless the answer was cut off inside it (``max_tokens``: a call the model had not finished
    writing is dropped, not passed on as markup; nu11 saw ``"<tool_call>"`` as content); with
    ``parallel`` False only the first call is kept.

    Args:
        fmt: the model family's format.
        names: the declared functions' names.
        parallel: several calls allowed (OpenAI's ``parallel_tool_calls``).
    """

    def __init__(self, fmt: ToolCallFormat, names: frozenset[str], parallel: bool = True) -> None:
        self._fmt = fmt
        self._names = names
        self._parallel = parallel
        self._pending = ""  # text not yet decided (a possible marker prefix, trailing whitespace, a block)
        self._in_block = False
        self._gap = ""  # whitespace between the text and the block being read
        self._seen_text = False  # non-whitespace content emitted (Llama's bare JSON only starts an answer)
        self._skip_space = False
        self.calls = 0

    def feed(self, text: str) -> ParseStep:
        """Take the next piece of the answer."""
        self._pending += text
        return self._drain(final=False)

    def finish(self, cut: bool = False) -> ParseStep:
        """The answer ended (``cut``: at ``max_tokens``, not by itself): decide what is still held back."""
        return self._drain(final=True, cut=cut)

    def _emit(self, step: ParseStep, text: str) -> None:
        if self._skip_space:
            text = text.lstrip()
            if not text:
                return
            self._skip_space = False
        if text.strip():
            self._seen_text = True
        step.add_text(text)

    def _block_start(self) -> int:
        """Index of the next block start in the pending text, or -1."""
        best = -1
        for marker in self._fmt.markers:
            at = self._pending.find(marker)
            if at >= 0 and (best < 0 or at < best):
                best = at
        if not self._seen_text:
            stripped = self._pending.lstrip()
            offset = len(self._pending) - len(stripped)
            if stripped and self._fmt.start_at_output_begin(stripped) and (best < 0 or offset < best):
                best = offset
        return best

    def _undecided_tail(self) -> int:
        """Length of the pending text's tail that may still belong to a block: a cut-off marker and the
        whitespace before it (dropped if the block comes)."""
        cut = 0
        for marker in self._fmt.markers:
            for k in range(len(marker) - 1, cut, -1):
                if self._pending.endswith(marker[:k]):
                    cut = k
                    break
        body = self._pending[: len(self._pending) - cut]
        return cut + len(body) - len(body.rstrip())

    def _drain(self, final: bool, cut: bool = False) -> ParseStep:
        step = ParseStep()
        while self._pending:
            if not self._in_block:
                at = self._block_start()
                if at < 0:
                    if final:
                        text, self._pending = self._pending, ""
                        self._emit(step, text if not self.calls else text.rstrip())
                        break
                    keep = len(self._pending) - self._undecided_tail()
                    self._emit(step, self._pending[:keep])
                    self._pending = self._pending[keep:]
                    break
                before = self._pending[:at].rstrip()
                self._emit(step, before)
                self._gap = self._pending[len(before) : at]  # dropped if the block is a call
                self._pending = self._pending[at:]
                self._in_block = True
            # cut off inside the block: it would still be incomplete if more text were to come
            unfinished = cut and self._fmt.extract(self._pending, self._names, False).consumed == 0
            found = self._fmt.extract(self._pending, self._names, final)
            if found.consumed == 0:
                break
            block, self._pending = self._pending[: found.consumed], self._pending[found.consumed :]
            self._in_block = False
            if found.calls is None:
                if not unfinished:
                    self._emit(step, self._gap + block)
                continue
            for call in found.calls:
                if self._parallel or self.calls == 0:
                    step.parts.append(call)
                    self.calls += 1
            self._skip_space = True
        return step


__all__ = ["CallParser"]
