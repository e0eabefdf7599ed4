"""Engine actor: the clients' door. Tokenizes, validates, journals, detokenizes, streams.

Inbox: TokensOut, Recover (Scheduler); StatsReply (BlockManager); Roster, Drain (supervisor); Stop.
Client socket (ROUTER): GenerateRequest, AbortRequest, HealthRequest, Ping in; Delta, ErrorReply,
HealthReply, Pong out, each to the client identity that asked.
Outbox: AddRequest, AbortRequests, StatsQuery -> Scheduler.
Owns: the tokenizer; the journal of live requests (prompt ids, params, tokens sent so far).
Dies when: Stop, SIGTERM, or its supervisor goes away. A client's bad bytes never kill it.
On Recover (another actor restarted) it re-submits every live request with the tokens already
streamed, so generation resumes where it was: nothing lost, nothing sent twice.
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass, field

import msgspec
import zmq

from ..messages.client import (
    AbortRequest,
    ClientToEngine,
    Delta,
    EngineStats,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    Ping,
    Pong,
)
from ..messages.codec import DecodeError, Decoder, EngineInbox, encode, peek_request_id
from ..messages.common import FinishReason
from ..messages.control import ActorStatus, Drain, Drained, Recover, Roster
from ..messages.step import AbortRequests, AddRequest, StatsQuery, StatsReply, TokensOut
from .detokenizer import IncrementalDetokenizer
from .runtime import Actor, actor_main
from .stop_strings import StopStrings

STATS_TIMEOUT_S = 2.0


@dataclass
class LiveRequest:
    """A journal entry: enough to re-submit the request with nothing lost."""

    identity: bytes
    request: AddRequest
    detokenizer: IncrementalDetokenizer
    stop_strings: StopStrings | None = None
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
        self.draining = False

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
        for rid, live in self.live.items():
            self.reply(live.identity, ErrorReply("the engine stopped", "unavailable", rid))
        self.router.close(linger=100)

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
        elif isinstance(message, Ping):
            unknown = [rid for rid in message.request_ids if rid not in self.live]
            self.reply(identity, Pong(unknown, self.draining))
        elif isinstance(message, HealthRequest):
            self._query_seq += 1
            query_id = str(self._query_seq)
            self.health_waiters[query_id] = (identity, message.request_id)
            self.send("scheduler", StatsQuery(query_id))
            asyncio.get_running_loop().call_later(
                STATS_TIMEOUT_S, self._answer_health, query_id, None
            )

    def admit(self, identity: bytes, message: GenerateRequest) -> None:
        rid = message.request_id
        if self.draining:
            self.reply(identity, ErrorReply("the engine is shutting down", "unavailable", rid))
            return
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
        request = AddRequest(rid, prompt_ids, message.params, [], message.priority)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        params = message.params
        stops = StopStrings(params.stop, params.include_stop_str_in_output) if params.stop else None
        self.live[rid] = LiveRequest(identity, request, detok, stops)
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
        self._maybe_drained()

    # -- outputs -----------------------------------------------------------------------------

    def on_tokens_out(self, message: TokensOut) -> None:
        for output in message.outputs:
            live = self.live.get(output.request_id)
            if live is None:  # aborted by the client already
                continue
            live.output_token_ids.extend(output.token_ids)
            text = live.detokenizer.add(output.token_ids) if output.token_ids else ""
            reason = output.finish_reason
            if live.stop_strings is not None:
                text, matched = live.stop_strings.feed(text, final=reason is not None)
                if matched and reason is None:
                    reason = FinishReason.STOP
                    self.send("scheduler", AbortRequests([output.request_id]))
            if reason is not None:
                del self.live[output.request_id]
                self._maybe_drained()
            delta = self._delta(output.request_id, live, text, output.token_ids, reason)
            delta.cached_tokens = output.cached_tokens
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
        self._answer_health(message.query_id, message.stats)

    def _answer_health(self, query_id: str, stats: EngineStats | None) -> None:
        """Answer a health query; without stats (the Scheduler or BlockManager did not answer
        within STATS_TIMEOUT_S, e.g. while restarting) the reply says not ok."""
        waiter = self.health_waiters.pop(query_id, None)
        if waiter is None:
            return
        identity, request_id = waiter
        ok = stats is not None and bool(self.roster)
        ok = ok and all(a.state == "ready" for a in self.roster)
        self.reply(identity, HealthReply(request_id, ok, stats or EngineStats(), self.roster))

    def on_roster(self, message: Roster) -> None:
        self.roster = message.actors

    def on_recover(self, message: Recover) -> None:
        self.log.warning("epoch %d: re-submitting %d live requests", message.epoch, len(self.live))
        for live in self.live.values():
            resumed = msgspec.structs.replace(
                live.request, output_token_ids=list(live.output_token_ids)
            )
            self.send("scheduler", resumed)

    def on_drain(self, message: Drain) -> None:
        self.draining = True
        self._maybe_drained()

    def _maybe_drained(self) -> None:
        if self.draining and not self.live:
            self.send("supervisor", Drained(self.name, os.getpid()))


if __name__ == "__main__":
    actor_main(Engine, sys.argv[1])
