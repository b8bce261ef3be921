"""What xgrammar makes of JSON schemas, run by the engine's own Python (it imports xgrammar, not the gateway).

Usage: ``<engine python> tests/support/xgrammar_verdicts.py < rows.json > verdicts.json``, where ``rows.json``
is a list of ``[schema, witness]``. Each verdict is ``{"compiled", "error", "starts", "witness"}``:

- ``compiled``: ``Grammar.from_json_schema`` (the converter SGLang 0.5.23's ``compile_json_schema`` runs:
  strict mode, any whitespace) took it; ``error``: its words when not;
- ``starts``: some JSON value can begin (a grammar with none is empty: every JSON text starts with one of
  ``{["-0123456789tfn``, after any whitespace);
- ``witness``: ``"complete"`` (accepted, and the grammar may end there), ``"prefix"`` (accepted, no end
  yet), ``"refused"``, or null without a witness.

The matching uses ``xgrammar.testing._is_grammar_accept_string`` (xgrammar's own test helper: a matcher
over a byte-level vocabulary, so no tokenizer is loaded).
"""

from __future__ import annotations

import json
import sys

FIRST_CHARACTERS = '{["-0123456789tfn \n'
"""What a JSON text may begin with (RFC 8259: a value, after optional whitespace)."""


def main() -> None:
    import xgrammar as xgr  # type: ignore[import-not-found]
    from xgrammar.testing import _is_grammar_accept_string as accepts  # type: ignore[import-not-found]

    out = []
    for schema, witness in json.load(sys.stdin):
        try:
            grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True)
        except RuntimeError as exc:
            out.append({"compiled": False, "error": str(exc)[-300:], "starts": None, "witness": None})
            continue
        starts = any(accepts(grammar, c, require_termination=False) for c in FIRST_CHARACTERS)
        seen = None
        if witness is not None:
            if accepts(grammar, witness):
                seen = "complete"
            elif accepts(grammar, witness, require_termination=False):
                seen = "prefix"
            else:
                seen = "refused"
        out.append({"compiled": True, "error": None, "starts": starts, "witness": seen})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
