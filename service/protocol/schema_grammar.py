"""What the engine's grammar compiler makes of a JSON schema, checked before a schema reaches a worker.

SGLang 0.5.23 compiles ``response_format`` schemas and tool parameters with xgrammar 0.2.7 (strict mode,
its default). A schema it cannot compile is refused by the worker (a 400), but a schema that compiles
into a grammar with no finite instance is worse: when the grammar admits no value at all (a cycle of
``$ref`` / ``allOf`` / ``anyOf`` with nothing else in it), its first token is masked out and the engine
answers 500 ("Grammar accept_token failed"); when every instance must recurse again (``{"properties":
{"x": {"$ref": "#"}}, "required": ["x"]}``), the model writes ``{"x": {"x": ...`` until ``max_tokens``.
:func:`grammar_problem` finds both, and the compile errors, and names the JSON pointer at fault.

What xgrammar 0.2.7 does, found by compiling a table of schemas with it (``tests/support/schema_table.py``;
``tests/engine/test_schema_grammar_xgrammar.py`` checks each row against xgrammar itself):

- One keyword decides a subschema, the first present of: ``$ref``, ``const`` / ``enum``, ``anyOf``,
  ``oneOf``, ``allOf`` (one member: that member; several: any JSON value), ``type``. Keywords beside it
  are ignored. Without ``type``, a subschema is an object when it has ``properties``,
  ``additionalProperties`` or ``unevaluatedProperties``, an array when it has ``items``, ``prefixItems``
  or ``unevaluatedItems``, else any value; a ``type`` list is any of its types.
- ``$ref``: ``#`` then object keys split on ``/`` (empty ones skipped; no ``~1`` or ``%`` unescaping,
  no array indices); ``#name`` (an anchor) is taken as any value.
- Objects: any property may be written (none under ``maxProperties: 0``); the ``required`` names that are
  in ``properties`` must be (the others are not enforced); other keys only when ``additionalProperties``
  (without it, ``unevaluatedProperties``) is a schema or ``patternProperties`` is given.
- Arrays: ``prefixItems`` in order, then ``items`` (without it, ``unevaluatedItems``); without either,
  no more items than ``prefixItems``.
- Compile errors: ``false`` where a value could be written (a property, a ``prefixItems`` entry, a branch,
  a ``$ref`` target; ``items: false`` and ``additionalProperties: false`` are fine); an empty ``enum``;
  ``minLength`` > ``maxLength``; ``minItems`` > ``maxItems``, ``maxItems`` < ``prefixItems``, ``minItems`` >
  ``prefixItems`` with no more items allowed; ``minProperties`` > ``maxProperties``, ``maxProperties`` <
  ``required``, ``minProperties`` > ``properties`` with no other keys allowed; a number range with no
  number in it, an integer bound that is not whole or a range with no integer in it; a ``$ref`` to
  something that is not a schema.

A finite instance is a least fixed point over the subschemas the grammar can enter (the productive
nonterminals of a context-free grammar; Hopcroft & Ullman, *Introduction to Automata Theory*, 4.4),
computed in linear time with per-requirement counters (Dowling & Gallier, "Linear-time algorithms for
testing the satisfiability of propositional Horn formulae", 1984). Every subschema the grammar can enter
must have one: the model may otherwise walk into a part it can never leave.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

_SHOWN_POINTERS = 8
"""Most JSON pointers a cycle's message lists (the rest are elided)."""

_POINTER_CHARS = 100
"""Longest JSON pointer shown in a message, characters."""

_OBJECT_KEYWORDS = ("properties", "additionalProperties", "unevaluatedProperties")
_ARRAY_KEYWORDS = ("items", "prefixItems", "unevaluatedItems")
_MANY = math.inf
"""Weight of a source of any number of object keys (``additionalProperties``, ``patternProperties``)."""


class _Refused(Exception):
    """A schema xgrammar cannot compile; the message says why and where."""


@dataclass(slots=True)
class _Way:
    """One way a subschema has a finite instance: each of ``must`` has one, and the members of ``pool``
    that have one weigh ``pool_left`` in all (an object's ``minProperties``)."""

    owner: int
    must: list[int] = field(default_factory=list)
    pool: list[tuple[int, float]] = field(default_factory=list)
    must_left: int = 0
    pool_left: float = 0


def _show(pointer: str) -> str:
    return pointer if len(pointer) <= _POINTER_CHARS else pointer[: _POINTER_CHARS - 1] + "…"


def _token(key: str) -> str:
    """``key`` as one token of a JSON pointer (RFC 6901: ``~`` and ``/`` escaped)."""
    return key.replace("~", "~0").replace("/", "~1")


class _Grammar:
    """The subschemas of one schema that xgrammar's grammar can enter, and the ways each has an instance."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.pointers: list[str] = []
        self.ways: list[list[_Way]] = []
        self._index: dict[int, int] = {}
        self._todo: list[tuple[dict[str, Any], int]] = []

    def build(self) -> None:
        """Walk every subschema reachable from the root (iteratively: nesting is bounded, not small).

        Raises:
            _Refused: a compile error of xgrammar 0.2.7.
        """
        self.child(self.root, "#")
        while self._todo:
            node, index = self._todo.pop()
            self.ways[index] = self._ways(node, index)

    def child(self, value: Any, pointer: str) -> int | None:
        """The node of subschema ``value`` (registered and queued on first sight); None for ``true``."""
        if value is True:
            return None
        if value is False:
            raise _Refused(f"the schema at '{_show(pointer)}' is false: it admits no value")
        if not isinstance(value, dict):
            raise _Refused(f"'{_show(pointer)}' is not a schema (an object or a boolean)")
        index = self._index.get(id(value))
        if index is None:
            index = self._index[id(value)] = len(self.pointers)
            self.pointers.append(pointer)
            self.ways.append([])
            self._todo.append((value, index))
        return index

    def _resolve(self, ref: str, pointer: str) -> tuple[Any, str]:
        """The target of local ``$ref`` ``ref`` (at ``pointer``) and its own pointer, as xgrammar reads it."""
        node: Any = self.root
        tokens = [token for token in ref[1:].split("/") if token]
        for token in tokens:
            if not isinstance(node, dict) or token not in node:
                raise _Refused(f"$ref {ref[:_POINTER_CHARS]!r} at '{_show(pointer)}' does not resolve")
            node = node[token]
        return node, "#" + "".join(f"/{_token(t)}" for t in tokens)

    def _ways(self, node: dict[str, Any], index: int) -> list[_Way]:
        if "$ref" in node:
            ref = node["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#"):
                _refuse(f"only local $ref (#/...) is supported, not {str(ref)[:_POINTER_CHARS]!r}")
            if ref != "#" and not ref.startswith("#/"):
                return [_Way(index)]  # an anchor: xgrammar 0.2.7 takes it as any value
            target, where = self._resolve(ref, self.pointers[index])
            return [self._way(index, [self.child(target, where)])]
        if "const" in node:
            return [_Way(index)]
        if "enum" in node:
            if not node["enum"]:
                _refuse(f"the enum at '{_show(self.pointers[index])}' is empty: it admits no value")
            return [_Way(index)]
        here = self.pointers[index]
        for key in ("anyOf", "oneOf"):
            if key in node:
                return [
                    self._way(index, [self.child(v, f"{here}/{key}/{i}")]) for i, v in enumerate(node[key])
                ]
        if "allOf" in node:
            members = node["allOf"]
            if len(members) > 1:
                return [_Way(index)]  # several members: xgrammar 0.2.7 writes any value
            return [self._way(index, [self.child(members[0], f"{here}/allOf/0")])]
        kind = node.get("type")
        if kind is None:
            kinds = (
                ["object"]
                if any(k in node for k in _OBJECT_KEYWORDS)
                else ["array"]
                if any(k in node for k in _ARRAY_KEYWORDS)
                else []
            )
        else:
            kinds = [kind] if isinstance(kind, str) else list(kind)
        if not kinds:
            return [_Way(index)]
        ways = []
        for each in kinds:
            if each == "object":
                ways.append(self._object(node, index))
            elif each == "array":
                ways.append(self._array(node, index))
            else:
                _leaf_problem(node, each, here)
                ways.append(_Way(index))
        return ways

    @staticmethod
    def _way(
        index: int,
        must: Sequence[int | None],
        pool: Sequence[tuple[int | None, float]] = (),
        need: float = 0,
    ) -> _Way:
        """A way of node ``index``: ``must`` each, and ``need`` in weight of ``pool`` (None: ``true``, which
        always has an instance)."""
        way = _Way(index)
        way.must = [m for m in must if m is not None]
        for member, weight in pool:
            if member is None:
                need -= weight
            else:
                way.pool.append((member, weight))
        way.must_left, way.pool_left = len(way.must), max(0.0, need)
        return way

    def _object(self, node: dict[str, Any], index: int) -> _Way:
        here = self.pointers[index]
        properties: dict[str, Any] = node.get("properties", {})
        required = set(node.get("required", []))
        extra = node.get(
            "additionalProperties" if "additionalProperties" in node else "unevaluatedProperties", False
        )
        patterns: dict[str, Any] = node.get("patternProperties", {})
        least, most = node.get("minProperties", 0), node.get("maxProperties")
        if most is not None and least > most:
            _refuse(f"at '{_show(here)}' minProperties {least} is greater than maxProperties {most}")
        if most is not None and most < len(required):
            _refuse(f"at '{_show(here)}' maxProperties {most} is less than the {len(required)} required")
        if least > len(properties) and extra is False and not patterns:
            _refuse(
                f"at '{_show(here)}' minProperties {least} is more than its {len(properties)} properties, "
                "and no other keys are allowed"
            )
        if most == 0:
            return _Way(index)
        must: list[int | None] = []
        pool: list[tuple[int | None, float]] = []
        for key, value in properties.items():
            member = self.child(value, f"{here}/properties/{_token(key)}")
            if key in required:
                must.append(member)
            else:
                pool.append((member, 1))
        if extra is not False:
            keyword = "additionalProperties" if "additionalProperties" in node else "unevaluatedProperties"
            pool.append((self.child(extra, f"{here}/{keyword}"), _MANY))
        for key, value in patterns.items():
            pool.append((self.child(value, f"{here}/patternProperties/{_token(key)}"), _MANY))
        return self._way(index, must, pool, least - len(required & properties.keys()))

    def _array(self, node: dict[str, Any], index: int) -> _Way:
        here = self.pointers[index]
        prefix: list[Any] = node.get("prefixItems", [])
        rest_keyword = "items" if "items" in node else "unevaluatedItems"
        rest = node.get(rest_keyword, False)
        least, most = node.get("minItems", 0), node.get("maxItems")
        if any(item is False for item in prefix):
            _refuse(f"prefixItems at '{_show(here)}' holds false: it admits no value")
        if most is not None and least > most:
            _refuse(f"at '{_show(here)}' minItems {least} is greater than maxItems {most}")
        if most is not None and most < len(prefix):
            _refuse(f"at '{_show(here)}' maxItems {most} is less than its {len(prefix)} prefixItems")
        if least > len(prefix) and rest is False:
            _refuse(
                f"at '{_show(here)}' minItems {least} is more than its {len(prefix)} prefixItems, "
                "and no other items are allowed"
            )
        items = [self.child(item, f"{here}/prefixItems/{i}") for i, item in enumerate(prefix)]
        must = items[: int(least)]
        if rest is not False and (most is None or most > len(prefix)):
            member = self.child(rest, f"{here}/{rest_keyword}")
            if least > len(prefix):
                must.append(member)
        return self._way(index, must)


def _refuse(message: str) -> NoReturn:
    raise _Refused(message)


def _whole(value: Any) -> bool:
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _leaf_problem(node: dict[str, Any], kind: str, here: str) -> None:
    """Raise :class:`_Refused` when ``node`` as a ``kind`` value (string, number, integer...) has no value
    xgrammar 0.2.7 can write."""
    if kind == "string":
        least, most = node.get("minLength", 0), node.get("maxLength")
        if most is not None and least > most:
            _refuse(f"at '{_show(here)}' minLength {least} is greater than maxLength {most}")
        return
    if kind not in ("number", "integer"):
        return
    bounds = {k: node[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in node}
    if kind == "integer":
        if not all(_whole(v) for v in bounds.values()):
            _refuse(f"at '{_show(here)}' an integer bound is not a whole number")
        low = max(bounds.get("minimum", -math.inf), bounds.get("exclusiveMinimum", -math.inf) + 1)
        high = min(bounds.get("maximum", math.inf), bounds.get("exclusiveMaximum", math.inf) - 1)
        if low > high:
            _refuse(f"at '{_show(here)}' the range holds no integer")
        return
    low, low_open = bounds.get("minimum", -math.inf), False
    if "exclusiveMinimum" in bounds and bounds["exclusiveMinimum"] >= low:
        low, low_open = bounds["exclusiveMinimum"], True
    high, high_open = bounds.get("maximum", math.inf), False
    if "exclusiveMaximum" in bounds and bounds["exclusiveMaximum"] <= high:
        high, high_open = bounds["exclusiveMaximum"], True
    if low > high or (low == high and (low_open or high_open)):
        _refuse(f"at '{_show(here)}' the range holds no number")


def _productive(grammar: _Grammar) -> list[bool]:
    """Which subschemas have a finite instance (the least fixed point, linear in the ways' sizes)."""
    done = [False] * len(grammar.pointers)
    watchers: list[list[tuple[_Way, float | None]]] = [[] for _ in grammar.pointers]
    ready: list[int] = []
    for ways in grammar.ways:
        for way in ways:
            for member in way.must:
                watchers[member].append((way, None))
            for member, share in way.pool:
                watchers[member].append((way, share))
            if way.must_left == 0 and way.pool_left <= 0:
                ready.append(way.owner)
    while ready:
        node = ready.pop()
        if done[node]:
            continue
        done[node] = True
        for way, weight in watchers[node]:
            if weight is None:
                way.must_left -= 1
            else:
                way.pool_left -= weight
            if way.must_left == 0 and way.pool_left <= 0 and not done[way.owner]:
                ready.append(way.owner)
    return done


def _blocker(grammar: _Grammar, node: int, done: list[bool]) -> int | None:
    """A member without a finite instance that keeps ``node`` from having one (its first way's)."""
    for way in grammar.ways[node]:
        for member in way.must:
            if not done[member]:
                return member
        for member, _ in way.pool:
            if not done[member]:
                return member
    return None


def _no_way_out(grammar: _Grammar, start: int, done: list[bool]) -> str:
    """Why ``start`` has no finite instance: the cycle its blockers go round."""
    chain = [start]
    seen = {start: 0}
    while (nxt := _blocker(grammar, chain[-1], done)) is not None and nxt not in seen:
        seen[nxt] = len(chain)
        chain.append(nxt)
    where = f"'{_show(grammar.pointers[start])}' has no finite instance"
    if nxt is None:
        return f"{where}: it admits no value"
    cycle = [grammar.pointers[i] for i in chain[seen[nxt] :]] + [grammar.pointers[nxt]]
    shown = [_show(p) for p in cycle]
    if len(shown) > _SHOWN_POINTERS:
        shown = [*shown[: _SHOWN_POINTERS - 1], "…", shown[-1]]
    return (
        f"{where}: {' -> '.join(shown)} is a cycle that every instance must go round again "
        "(recursion with no way out: make a property optional, give anyOf a branch that does not recur, "
        "or let the array be empty)"
    )


def grammar_problem(schema: dict[str, Any]) -> str | None:
    """Why xgrammar 0.2.7 cannot compile ``schema``, or why a part of it has no finite instance; None
    when neither (see the module docstring).

    ``schema`` has passed the Draft 2020-12 meta-schema and the size bounds (keyword types are right and
    nesting is bounded); the walk is iterative and linear in the schema's size.
    """
    grammar = _Grammar(schema)
    try:
        grammar.build()
    except _Refused as exc:
        return str(exc)
    done = _productive(grammar)
    for node, ok in enumerate(done):  # in discovery order: the outermost part at fault first
        if not ok:
            return _no_way_out(grammar, node, done)
    return None


__all__ = ["grammar_problem"]
