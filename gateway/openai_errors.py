"""Errors in OpenAI's shape, and the 400 that names the field a request body got wrong."""

from __future__ import annotations

import re
import sys
from typing import Any

import msgspec

RETRY_AFTER = {"Retry-After": "1"}  # on a 429 or 503: the refusal is for now, not for good


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {
        400: "invalid_request_error",
        401: "invalid_request_error",
        403: "invalid_request_error",
        404: "invalid_request_error",
        408: "invalid_request_error",
        413: "invalid_request_error",
        415: "invalid_request_error",
        431: "invalid_request_error",
        429: "rate_limit_error",
        503: "server_error",
    }

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return self.TYPES.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None) -> APIError:
    return APIError(400, message, param, "invalid_request")


_AT = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_FIELD = re.compile(r"field `(?P<name>[^`]+)`")


def decode_error(exc: msgspec.DecodeError, what: str = "request body") -> APIError:
    """A 400 for a body msgspec refused, naming the field (`$.messages[0].role` -> that path),
    or `what` was refused as a whole."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return invalid(f"{what} is not valid JSON: {text}", None)
    match = _AT.search(text)
    path = match.group("path") if match else ""
    reason = text[: match.start()] if match else text
    named = _FIELD.search(reason)
    if named and ("unknown field" in reason or "missing required field" in reason):
        path = f"{path}.{named.group('name')}" if path else named.group("name")
        if "unknown field" in reason:
            return invalid(f"Unrecognized request argument supplied: {path}", path)
    return invalid(f"{path or what}: {reason}", path or None)


def decode_json(decoder: msgspec.json.Decoder, data: bytes | str, what: str = "request body"):
    """`decoder.decode(data)`, every failure a 400: msgspec's own (see decode_error), and the
    RecursionError it raises for nesting deeper than Python's recursion limit."""
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise decode_error(exc, what) from None
    except RecursionError:
        raise invalid(
            f"{what} nests arrays or objects too deeply (the limit is about "
            f"{sys.getrecursionlimit()} levels)",
            None,
        ) from None
