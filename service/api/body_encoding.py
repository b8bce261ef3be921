"""Request bodies sent with ``Content-Encoding`` (RFC 9110 §8.4): decoded as they arrive, or refused.

``gzip`` (and its alias ``x-gzip``, RFC 9110 §8.4.1.3) and ``deflate`` are decoded with :mod:`zlib`;
``identity`` is no coding. ``deflate`` is the zlib format (RFC 1950) by the HTTP standard, but clients
send raw deflate (RFC 1951) too: the first two bytes tell which, as curl and the browsers decide it
(a zlib header has compression method 8 and a 16-bit value that is a multiple of 31). Several codings
(``Content-Encoding: gzip, deflate``: gzip applied first) are undone in the reverse order of the list.
A gzip body may hold several members (RFC 1952 §2.2), decoded one after another.

Each coding's output is bounded by the body limit as it is produced (zlib's ``max_length``), so a small
body that inflates far beyond the limit (a "zip bomb": 10 MB of zeros is 10 KB of gzip) is refused with
413 after at most ``limit + 1`` decoded bytes, never decoded whole into memory. A stream that zlib cannot
decode, that ends early, or that has bytes after its end is a 400; any other coding (``br``, ``zstd``,
``compress``, ...) a 415 with ``Accept-Encoding: gzip, deflate`` (RFC 9110 §15.5.16, RFC 7694).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from service.api.errors import APIError

DECODED = ("gzip", "deflate")
"""The content codings decoded (``x-gzip`` is read as ``gzip``; ``identity`` is no coding)."""

MAX_CODINGS = 4
"""Most codings one body may stack (``gzip, deflate, ...``); more is refused with 415."""

_ALIASES = {"x-gzip": "gzip"}


def _shown(value: str, limit: int = 40) -> str:
    return value if len(value) <= limit else f"{value[:limit]}..."


def unsupported(message: str) -> APIError:
    """The 415 ``unsupported_content_encoding`` answer, naming what is decoded (``Accept-Encoding``)."""
    return APIError(
        415, message, code="unsupported_content_encoding", headers={"Accept-Encoding": ", ".join(DECODED)}
    )


def parse_codings(values: Iterable[str]) -> list[str]:
    """The content codings of ``Content-Encoding`` header values, in the order they were applied,
    lower-cased, without ``identity``.

    Raises:
        APIError: 415 an unknown coding, or more than :data:`MAX_CODINGS`.
    """
    codings: list[str] = []
    for value in values:
        for token in value.split(","):
            coding = token.strip().lower()
            if coding in ("", "identity"):
                continue
            coding = _ALIASES.get(coding, coding)
            if coding not in DECODED:
                raise unsupported(
                    f"Content-Encoding '{_shown(token.strip())}' is not supported; send the request body "
                    "uncompressed, or as gzip or deflate."
                )
            codings.append(coding)
    if len(codings) > MAX_CODINGS:
        raise unsupported(f"At most {MAX_CODINGS} content codings may be stacked, not {len(codings)}.")
    return codings


def _is_zlib_header(head: bytes) -> bool:
    """Whether two bytes start a zlib stream (RFC 1950 §2.2: CM = 8, CMF*256 + FLG divisible by 31)."""
    return head[0] & 0x0F == 8 and head[0] >> 4 <= 7 and (head[0] << 8 | head[1]) % 31 == 0


class _Layer:
    """The decoder of one content coding, its output bounded by ``limit`` bytes in all."""

    def __init__(self, coding: str, limit: int) -> None:
        self.coding = coding
        self.limit = limit
        self.produced = 0
        self._zlib: zlib._Decompress | None = None
        self._head = b""  # deflate: the first byte, until the second tells zlib from raw deflate

    def _corrupt(self, why: str) -> APIError:
        return APIError(
            400,
            f"The request body is not valid {self.coding} data ({why}); it was sent with "
            f"Content-Encoding: {self.coding}.",
            code="invalid_content_encoding",
        )

    def _new(self, data: bytes) -> zlib._Decompress:
        if self.coding == "gzip":
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        return zlib.decompressobj(zlib.MAX_WBITS if _is_zlib_header(data) else -zlib.MAX_WBITS)

    def _take(self, out: bytes) -> bytes:
        self.produced += len(out)
        if self.produced > self.limit:
            raise APIError(
                413,
                f"Request body is larger than {self.limit} bytes once decoded (Content-Encoding: "
                f"{self.coding}).",
                code="request_too_large",
            )
        return out

    def feed(self, data: bytes) -> bytes:
        """Decode the next bytes of the body: what they decode to.

        Raises:
            APIError: 413 the output passed ``limit``; 400 not this coding, or bytes after its end.
        """
        if self._head:
            data, self._head = self._head + data, b""
        out: list[bytes] = []
        while data:
            if self._zlib is None:
                if self.coding == "deflate" and len(data) < 2:
                    self._head = data
                    break
                self._zlib = self._new(data)
            elif self._zlib.eof:
                if self.coding != "gzip":
                    raise self._corrupt("bytes after the end of the stream")
                self._zlib = self._new(data)  # the next gzip member
            try:
                # at most one byte over what is left: more output is refused at once, so what is held
                # back (unconsumed_tail) is never needed
                out.append(self._take(self._zlib.decompress(data, self.limit - self.produced + 1)))
            except zlib.error as exc:
                raise self._corrupt(str(exc)) from None
            data = self._zlib.unused_data if self._zlib.eof else b""
        return b"".join(out)

    def finish(self) -> bytes:
        """The last decoded bytes, once the body has ended (an empty body decodes to nothing).

        Raises:
            APIError: 400 the stream ended before its end (truncated); 413 as :meth:`feed`.
        """
        if self._head:
            raise self._corrupt("it ends early")
        if self._zlib is None:
            return b""
        try:
            rest = self._take(self._zlib.flush(self.limit - self.produced + 1))
        except zlib.error as exc:
            raise self._corrupt(str(exc)) from None
        if not self._zlib.eof:
            raise self._corrupt("it ends early")
        return rest


class BodyDecoder:
    """Undoes a body's content codings as its chunks arrive, every stage bounded by ``limit`` bytes.

    Args:
        codings: as :func:`parse_codings` gives them (the order they were applied).
        limit: most bytes any stage may produce (``api.max_body_bytes``), bytes.
    """

    def __init__(self, codings: list[str], limit: int) -> None:
        self._layers = [_Layer(c, limit) for c in reversed(codings)]

    def feed(self, data: bytes) -> bytes:
        """The decoded bytes of the next chunk (often empty). Raises :class:`APIError` 413 or 400."""
        for layer in self._layers:
            data = layer.feed(data)
        return data

    def finish(self) -> bytes:
        """The decoded bytes still held once the body has ended. Raises :class:`APIError` 413 or 400."""
        data = b""
        for layer in self._layers:
            data = layer.feed(data) + layer.finish()
        return data


def body_decoder(header_values: Iterable[str], limit: int) -> BodyDecoder | None:
    """The decoder for a request's ``Content-Encoding`` header values; None when the body is not encoded.

    Raises:
        APIError: 415 an unsupported coding (see :func:`parse_codings`).
    """
    codings = parse_codings(header_values)
    return BodyDecoder(codings, limit) if codings else None
