"""Engine actor: the clients' door. Tokenizes, validates, journals, detokenizes, streams.

Inbox: TokensOut, Recover (Scheduler); StatsReply (BlockManager); Roster, Drain (supervisor); Stop.
Client socket (ROUTER): GenerateRequest, AbortRequest, HealthRequest, Ping in; Delta, ErrorReply,
HealthReply, Pong out, each to the client identity that asked.
Outbox: AddRequest, AbortRequests, StatsQuery -> Scheduler.
Owns: the tokenizer; the journal of live requests (prompt ids, params, tokens sent so far).
Dies when: Stop, or its supervisor goes away (then by SIGTERM). A client's bad bytes never kill it.
On Recover (another actor restarted) it re-submits every live request with the tokens already
streamed, so generation resumes where it was: nothing lost, nothing sent twice.

Parallel samples: a GenerateRequest with n > 1 fans out into n child requests `{id}#{i}` (seeds
seed + i when seeded, so the samples differ and are reproducible); each is journaled and resumed
like any request, its deltas go to the client under the client's id with `index` i, and aborting
the client's id aborts every child. Sample 0 computes the prompt; samples i > 0 wait for it, then
fork: they share its prompt blocks, the partial last block copied on write, and recompute only the
last prompt token for their own first draw (Scheduler._fork_need, BlockPool._fork).
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
    DeltaBatch,
    EngineStats,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    HealthRequest,
    Ping,
    Pong,
)
from ..messages.codec import DecodeError, Decoder, EngineInbox, encode, peek_request_id
from ..messages.common import FinishReason, SamplingParams
from ..messages.control import ActorStatus, Drain, Drained, Recover, Roster
from ..messages.step import AbortRequests, AddRequest, StatsQuery, StatsReply, TokensOut
from .detokenizer import Detokenizer, incremental_detokenizer
from .runtime import Actor, LoopSocket, actor_main
from .stop_strings import StopStrings

STATS_TIMEOUT_S = 2.0


@dataclass
class LiveRequest:
    """A journal entry: enough to re-submit the request with nothing lost. `request.request_id`
    is the client's id, or for sample `index` of an n > 1 request that of a child."""

    identity: bytes
    request: AddRequest
    detokenizer: Detokenizer
    stop_strings: StopStrings | None = None
    output_token_ids: list[int] = field(default_factory=list)
    client_id: str = ""  # the id the client knows (deltas carry it)
    index: int = 0  # which of the client's n samples


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of an n > 1 request: n = 1, seed + index, and only sample 0 computes the
    prompt logprobs (the others may then share the prompt's blocks)."""
    seed = None if params.seed is None else (params.seed + index) % 2**63
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return msgspec.structs.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


class InvalidRequest(Exception):
    """A client error; the message names the field and its limit."""


class Engine(Actor):
    name = "engine"
    inbox = EngineInbox

    def __init__(self, config):
        super().__init__(config)
        self.facts = config.facts
        self.live: dict[str, LiveRequest] = {}  # by request id (a child's for n > 1)
        self.groups: dict[str, list[str]] = {}  # client id of an n > 1 request -> live children
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
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        address = self.addresses.client
        if address.startswith("ipc://"):
            os.makedirs(os.path.dirname(address[len("ipc://") :]) or ".", exist_ok=True)
        router.bind(address)
        self.router = LoopSocket(router)

    async def teardown(self) -> None:
        for live in self.live.values():
            self.reply(
                live.identity, ErrorReply("the engine stopped", "unavailable", live.client_id)
            )
        self.router.close(linger=100)

    async def background(self) -> None:
        while True:
            frames = await self.router.receive_multipart()
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
            unknown = [
                rid
                for rid in message.request_ids
                if rid not in self.live and rid not in self.groups
            ]
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
        if rid in self.live or rid in self.groups:
            raise InvalidRequest(f"request_id {rid!r} is already in use by a live request")
        error = message.params.validate(self.facts.vocab_size)
        if error:
            raise InvalidRequest(error)
        n = message.params.n
        if len(self.live) + n > self.config.max_live_requests:
            self.reply(
                identity,
                ErrorReply(
                    f"too many live requests (max_live_requests={self.config.max_live_requests})",
                    "overloaded",
                    rid,
                ),
            )
            return
        prompt_ids = self.prompt_token_ids(message)
        max_len = self.config.max_model_len
        if len(prompt_ids) >= max_len:
            raise InvalidRequest(
                f"prompt is {len(prompt_ids)} tokens, max_model_len is {max_len}: the prompt "
                f"must be at most {max_len - 1} tokens to leave room for one output token"
            )
        if n == 1:
            children = [(rid, message.params)]
        else:
            children = [(f"{rid}#{i}", child_params(message.params, i)) for i in range(n)]
            taken = next((cid for cid, _ in children if cid in self.live), None)
            if taken is not None:
                raise InvalidRequest(f"request_id {taken!r} is already in use by a live request")
            self.groups[rid] = [cid for cid, _ in children]
        for index, (cid, params) in enumerate(children):
            fork_of = children[0][0] if index else None  # share sample 0's prompt KV
            request = AddRequest(cid, prompt_ids, params, [], message.priority, fork_of)
            detok = incremental_detokenizer(self.tokenizer, prompt_ids)
            stops = (
                StopStrings(params.stop, params.include_stop_str_in_output) if params.stop else None
            )
            self.live[cid] = LiveRequest(identity, request, detok, stops, [], rid, index)
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
        """Abort a client's request (every sample of an n > 1 one)."""
        children = self.groups.get(request_id) or [request_id]
        aborted = [cid for cid in children if cid in self.live]
        if not aborted:
            return
        self.send("scheduler", AbortRequests(aborted))
        retired = [self._retire(cid) for cid in aborted]
        self._send_deltas(
            [(live, self._delta(live, "", [], FinishReason.ABORT)) for live in retired]
        )
        self._maybe_drained()

    def _retire(self, request_id: str) -> LiveRequest:
        """Drop a finished request from the journal (and from its n > 1 group)."""
        live = self.live.pop(request_id)
        group = self.groups.get(live.client_id)
        if group is not None:
            group.remove(request_id)
            if not group:
                del self.groups[live.client_id]
        return live

    # -- outputs -----------------------------------------------------------------------------

    def on_tokens_out(self, message: TokensOut) -> None:
        deltas: list[tuple[LiveRequest, Delta]] = []
        for output in message.outputs:
            live = self.live.get(output.request_id)
            if live is None:  # aborted by the client already
                continue
            first = not live.output_token_ids
            live.output_token_ids.extend(output.token_ids)
            text = live.detokenizer.add(output.token_ids) if output.token_ids else ""
            reason = output.finish_reason
            if live.stop_strings is not None:
                text, matched = live.stop_strings.feed(text, final=reason is not None)
                if matched:  # a stop string wins over the length limit of the same token
                    if reason is None:
                        self.send("scheduler", AbortRequests([output.request_id]))
                    reason = FinishReason.STOP
            if reason is not None:
                self._retire(output.request_id)
            delta = self._delta(live, text, output.token_ids, reason)
            delta.cached_tokens = output.cached_tokens
            if output.logprobs:
                delta.logprobs = output.logprobs
            if first and output.prompt_logprobs is not None:
                delta.prompt_logprobs = output.prompt_logprobs
            deltas.append((live, delta))
        self._send_deltas(deltas)
        self._maybe_drained()  # after the last deltas went out

    def _send_deltas(self, deltas: list[tuple[LiveRequest, Delta]]) -> None:
        """One message per client: its Delta, or its deltas as one DeltaBatch."""
        by_client: dict[bytes, list[Delta]] = {}
        for live, delta in deltas:
            by_client.setdefault(live.identity, []).append(delta)
        for identity, batch in by_client.items():
            self.reply(identity, batch[0] if len(batch) == 1 else DeltaBatch(batch))

    @staticmethod
    def _delta(live: LiveRequest, text: str, token_ids: list[int], reason) -> Delta:
        return Delta(
            live.client_id,
            text,
            token_ids,
            reason,
            len(live.request.prompt_token_ids),
            len(live.output_token_ids),
            index=live.index,
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
