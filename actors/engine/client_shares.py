"""What each client holds in the Engine, against the limits on one client: its live requests
(samples), max_client_requests, and the output tokens they may generate, n x max_tokens
(capped by max_model_len), max_client_output_tokens. Over a limit, an ErrorReply with code
`rate_limit_exceeded` (HTTP 429 at the gateway) naming it; over the engine's own door,
max_live_requests, `overloaded`.

A client is its sender's identity (the ROUTER routing id) and the tenant the sender names
(`GenerateRequest.tenant`: the gateway names each API key or peer address it serves), as one
string, `client_key`. The tenant is scoped by the identity, so it needs no trust: a sender that
names many tenants is as many clients, which it could be by opening as many sockets, and no
sender can spend what another sender's tenants hold. The same key goes to the Scheduler
(AddRequest.client), whose planner shares the seats fairly among clients.
"""

from __future__ import annotations

from ...messages.common import SamplingParams
from ...messages.step import AddRequest
from ..runtime.config import EngineConfig


def client_key(identity: bytes, tenant: str | None) -> str:
    return f"{identity.hex()}/{tenant or ''}"


class ClientShares:
    def __init__(self, config: EngineConfig):
        self.max_live = config.max_live_requests
        self.max_requests = config.client_request_limit()
        self.max_tokens = config.max_client_output_tokens
        self.max_model_len = config.max_model_len
        self.requests: dict[str, int] = {}  # client -> live samples
        self.tokens: dict[str, int] = {}  # client -> output tokens its live samples may generate

    def reserved(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The output tokens one sample may generate."""
        return min(params.max_tokens, self.max_model_len - num_prompt_tokens)

    def refusal(
        self, client: str, live: int, samples: int, num_prompt_tokens: int, params: SamplingParams
    ) -> tuple[str, str] | None:
        """(message, code) when `samples` more samples of `client` would be over a limit, with
        `live` samples in the engine; None when they fit."""
        if live + samples > self.max_live:
            return f"too many live requests (max_live_requests={self.max_live})", "overloaded"
        held = self.requests.get(client, 0)
        if held + samples > self.max_requests:
            return (
                f"this client has {held} live requests (samples) and asks for {samples} more, "
                f"over max_client_requests={self.max_requests}; retry when some have finished",
                "rate_limit_exceeded",
            )
        if self.max_tokens is None:
            return None
        tokens = samples * self.reserved(num_prompt_tokens, params)
        held = self.tokens.get(client, 0)
        if held + tokens > self.max_tokens:
            return (
                f"this client's live requests may generate {held} tokens and this one "
                f"{tokens} (n x max_tokens), over max_client_output_tokens={self.max_tokens}; "
                "retry when some have finished",
                "rate_limit_exceeded",
            )
        return None

    def take(self, request: AddRequest) -> None:
        """A sample of `request.client` is live."""
        client = request.client
        self.requests[client] = self.requests.get(client, 0) + 1
        tokens = self.reserved(len(request.prompt_token_ids), request.params)
        self.tokens[client] = self.tokens.get(client, 0) + tokens

    def give_back(self, request: AddRequest) -> None:
        """A sample `take` counted has finished (or was aborted, or failed)."""
        client = request.client
        left = self.requests.pop(client) - 1
        tokens = self.tokens.pop(client) - self.reserved(
            len(request.prompt_token_ids), request.params
        )
        if left:
            self.requests[client] = left
            self.tokens[client] = tokens
