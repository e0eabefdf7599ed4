"""Engine actor: the clients' door. Tokenizes, validates, journals, detokenizes, streams.

Inbox: TokensOut (Scheduler); StatsReply (BlockManager); Roster (supervisor); Stop.
Client socket (ROUTER): GenerateRequest, AbortRequest, HealthRequest in; Delta, ErrorReply,
HealthReply out, each to the client identity that asked.
Outbox: AddRequest, AbortRequests, StatsQuery -> Scheduler.
Owns: the tokenizer; the journal of live requests (prompt ids, params, tokens sent so far).
Dies when: Stop, SIGTERM, or its supervisor goes away. A client's bad bytes never kill it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import zmq

from ..messages.client import (
    AbortRequest,
    ClientToEngine,
    Delta,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
)
from ..messages.codec import DecodeError, Decoder, EngineInbox, encode, peek_request_id
from ..messages.common import FinishReason
from ..messages.control import ActorStatus, Roster
from ..messages.step import AbortRequests, AddRequest, StatsQuery, StatsReply, TokensOut
from .detokenizer import IncrementalDetokenizer
from .runtime import Actor, actor_main


@dataclass
class LiveRequest:
    """A journal entry: enough to re-submit the request with nothing lost."""

    identity: bytes
    request: AddRequest
    detokenizer: IncrementalDetokenizer
    output_token_ids: list[int] = field(default_factory=list)


class InvalidRequest(Exception):
    """A client error; the message names the field and its limit."""


class Engine(Actor):
    name = "engine"
    inbox = EngineInbox

    def __init__(self, config):
        super().__init__(config)
        self.facts = config.facts
        self.live: dict[str, LiveRequest] = {}
        self.health_waiters: dict[str, tuple[bytes, str]] = {}
        self.roster: list[ActorStatus] = []
        self.client_decoder = Decoder(ClientToEngine)
        self._query_seq = 0

    async def setup(self) -> None:
        import torch  # pulled in by transformers; keep it to one thread: the Worker owns the cores

        torch.set_num_threads(1)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.router.setsockopt(zmq.LINGER, 0)
        address = self.addresses.client
        if address.startswith("ipc://"):
            os.makedirs(os.path.dirname(address[len("ipc://") :]) or ".", exist_ok=True)
        self.router.bind(address)

    async def teardown(self) -> None:
        self.router.close(linger=0)

    async def background(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 2:
                continue  # not a DEALER/REQ peer speaking our protocol: nothing to answer
            identity, data = frames
            try:
                self.on_client_message(identity, data)
            except Exception as exc:  # never let one client's message kill the engine
                self.log.exception("client message failed")
                self.reply(
                    identity,
                    ErrorReply(f"internal error: {exc}", "internal", peek_request_id(data)),
                )

    def reply(self, identity: bytes, message) -> None:
        self.router.send_multipart([identity, encode(message)])

    # -- client requests ---------------------------------------------------------------------

    def on_client_message(self, identity: bytes, data: bytes) -> None:
        try:
            message = self.client_decoder.decode(data)
        except DecodeError as exc:
            self.reply(
                identity,
                ErrorReply(f"invalid message: {exc}", "invalid_request", peek_request_id(data)),
            )
            return
        if isinstance(message, GenerateRequest):
            try:
                self.admit(identity, message)
            except InvalidRequest as exc:
                self.reply(identity, ErrorReply(str(exc), "invalid_request", message.request_id))
        elif isinstance(message, AbortRequest):
            self.abort(message.request_id)
        elif isinstance(message, HealthRequest):
            self._query_seq += 1
            query_id = str(self._query_seq)
            self.health_waiters[query_id] = (identity, message.request_id)
            self.send("scheduler", StatsQuery(query_id))

    def admit(self, identity: bytes, message: GenerateRequest) -> None:
        rid = message.request_id
        if rid in self.live:
            raise InvalidRequest(f"request_id {rid!r} is already in use by a live request")
        if len(self.live) >= self.config.max_live_requests:
            self.reply(
                identity,
                ErrorReply(
                    f"too many live requests (max_live_requests={self.config.max_live_requests})",
                    "overloaded",
                    rid,
                ),
            )
            return
        error = message.params.validate(self.facts.vocab_size)
        if error:
            raise InvalidRequest(error)
        prompt_ids = self.prompt_token_ids(message)
        max_len = self.config.max_model_len
        if len(prompt_ids) >= max_len:
            raise InvalidRequest(
                f"prompt is {len(prompt_ids)} tokens, max_model_len is {max_len}: the prompt "
                f"must be at most {max_len - 1} tokens to leave room for one output token"
            )
        request = AddRequest(rid, prompt_ids, message.params)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        self.live[rid] = LiveRequest(identity, request, detok)
        self.send("scheduler", request)

    def prompt_token_ids(self, message: GenerateRequest) -> list[int]:
        if (message.prompt is None) == (message.prompt_token_ids is None):
            raise InvalidRequest("exactly one of prompt and prompt_token_ids must be given")
        if message.prompt is not None:
            ids = self.tokenizer.encode(message.prompt)
            if not ids:
                raise InvalidRequest("prompt must not be empty")
            return ids
        ids = message.prompt_token_ids
        if not ids:
            raise InvalidRequest("prompt_token_ids must not be empty")
        vocab = self.facts.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"prompt_token_ids must be in [0, vocab_size={vocab}), got {bad}")
        return list(ids)

    def abort(self, request_id: str) -> None:
        live = self.live.pop(request_id, None)
        if live is None:
            return
        self.send("scheduler", AbortRequests([request_id]))
        self.reply(live.identity, self._delta(request_id, live, "", [], FinishReason.ABORT))

    # -- outputs -----------------------------------------------------------------------------

    def on_tokens_out(self, message: TokensOut) -> None:
        for output in message.outputs:
            live = self.live.get(output.request_id)
            if live is None:  # aborted by the client already
                continue
            live.output_token_ids.extend(output.token_ids)
            text = live.detokenizer.add(output.token_ids) if output.token_ids else ""
            if output.finish_reason is not None:
                del self.live[output.request_id]
            delta = self._delta(
                output.request_id, live, text, output.token_ids, output.finish_reason
            )
            self.reply(live.identity, delta)

    @staticmethod
    def _delta(rid: str, live: LiveRequest, text: str, token_ids: list[int], reason) -> Delta:
        return Delta(
            rid,
            text,
            token_ids,
            reason,
            len(live.request.prompt_token_ids),
            len(live.output_token_ids),
        )

    def on_stats_reply(self, message: StatsReply) -> None:
        waiter = self.health_waiters.pop(message.query_id, None)
        if waiter is None:
            return
        identity, request_id = waiter
        ok = bool(self.roster) and all(a.state == "ready" for a in self.roster)
        self.reply(identity, HealthReply(request_id, ok, message.stats, self.roster))

    def on_roster(self, message: Roster) -> None:
        self.roster = message.actors


if __name__ == "__main__":
    actor_main(Engine, sys.argv[1])
