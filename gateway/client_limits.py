"""What one client of the gateway may hold: its requests in flight, as samples (n each), and the
output tokens they may generate, n x max_tokens (capped by max_model_len): the engine's
max_client_requests and max_client_output_tokens. Over either, a 429 naming it.

A client is the API key it presents where keys are used (several keys: several clients), else
its peer address (behind a proxy every request is the proxy's: give each client its own key).
Its name (`key:` and the key's place in `api_key`, never the key; `addr:` and the address) goes to
the Engine as the request's tenant (GenerateRequest.tenant), where the same limits hold on each
replica and the Scheduler shares the seats fairly among the clients.
"""

from __future__ import annotations

from starlette.datastructures import Address, Headers

from ..messages.common import SamplingParams
from .api_keys import matching_key, offered_keys
from .openai_errors import RETRY_AFTER, APIError


def client_name(
    api_keys: list[str], headers: Headers, peer: Address | None, subprotocols=()
) -> str:
    """Whom a request counts for (the request has passed the API key check)."""
    key = matching_key(api_keys, offered_keys(headers, subprotocols)) if api_keys else None
    if key is not None:
        return f"key:{api_keys.index(key)}"
    return f"addr:{peer.host if peer is not None else 'unknown'}"


class ClientLimits:
    """Each client's samples in flight and the output tokens they may generate."""

    def __init__(self, max_requests: int | None, max_tokens: int | None, max_model_len: int):
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.held: dict[str, tuple[int, int]] = {}  # client -> (samples, tokens)

    def reserved(self, params: SamplingParams) -> tuple[int, int]:
        """What one request holds: (samples, output tokens)."""
        return params.n, params.n * min(params.max_tokens, self.max_model_len)

    def check(self, client: str, samples: int, tokens: int) -> None:
        """A 429 naming the limit when `client` may not take `samples` and `tokens` more."""
        held_samples, held_tokens = self.held.get(client, (0, 0))
        if self.max_requests is not None and held_samples + samples > self.max_requests:
            raise APIError(
                429,
                f"this client has {held_samples} requests (samples) in flight and asks for "
                f"{samples} more, over max_client_requests={self.max_requests}; retry when some "
                "have finished",
                None,
                "rate_limit_exceeded",
                RETRY_AFTER,
            )
        if self.max_tokens is not None and held_tokens + tokens > self.max_tokens:
            raise APIError(
                429,
                f"this client's requests in flight may generate {held_tokens} tokens and this "
                f"asks for {tokens} more (n x max_tokens), over max_client_output_tokens="
                f"{self.max_tokens}; retry when some have finished",
                None,
                "rate_limit_exceeded",
                RETRY_AFTER,
            )

    def take(self, client: str, samples: int, tokens: int) -> None:
        """Check, then count them for `client` (until `give_back`)."""
        self.check(client, samples, tokens)
        held_samples, held_tokens = self.held.get(client, (0, 0))
        self.held[client] = (held_samples + samples, held_tokens + tokens)

    def give_back(self, client: str, samples: int, tokens: int) -> None:
        held_samples, held_tokens = self.held.pop(client)
        if held_samples > samples:
            self.held[client] = (held_samples - samples, held_tokens - tokens)
