"""What the SDK raises when the engine refuses, fails or does not answer a request."""

from __future__ import annotations


class EngineError(Exception):
    """The engine refused or failed a request. `code`: invalid_request, overloaded, ..."""

    def __init__(self, message: str, code: str = "internal", request_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.request_id = request_id


class EngineUnavailable(EngineError):
    """No answer from the engine within the client's timeout."""

    def __init__(self, message: str):
        super().__init__(message, "unavailable")
