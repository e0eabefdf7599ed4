"""Engine actor: the clients' door. Tokenizes, validates, journals, detokenizes, streams.

Inbox: TokensOut, Recover (Scheduler); StatsReply (BlockManager); Roster, Drain (supervisor); Stop.
Client socket (ROUTER): GenerateRequest, AbortRequest, HealthRequest, Ping in; Delta, ErrorReply,
HealthReply, Pong out, each to the client identity that asked (client_outbox.py).
Outbox: AddRequest, AbortRequests, StatsQuery -> Scheduler.
Owns: the tokenizer; the journal of live requests (prompt ids, params, tokens sent so far).
Dies when: Stop, or its supervisor goes away (then by SIGTERM). A client's bytes never kill it:
any bytes get an ErrorReply (frames no DEALER sends get nothing), frames over
max_client_message_bytes are dropped by ZeroMQ, the read loop yields to the event loop every
YIELD_EVERY messages (a flood cannot starve the heartbeat), and prompts long enough to take a
noticeable time are tokenized on a thread (`tokenizers` releases the GIL).

Recovery: on Recover (another actor restarted) it re-submits every live request with the tokens
already streamed, so generation resumes where it was; TokensOut of another epoch than the last
Recover's are dropped, so nothing is sent twice. A request that keeps killing one actor is failed
instead of replayed (quarantine.py). The Engine's own death is covered by its clients: the SDK
re-submits what it was receiving as a resumption (GenerateRequest.resume).

Ownership: a request belongs to the client identity (ROUTER routing id) that sent it. Its id in
the engine is `key(identity, request_id)`: ids of different clients never collide, and
AbortRequest and Ping act on the sender's own requests only. What one client (its identity and
the tenant it names) may hold is bounded, and its seats are shared fairly (client_shares.py).
A client that goes away (a send to it fails), takes none of its replies for send_timeout_s, or
sends nothing for client_lease_s (the SDK pings every second while it streams) has its requests
aborted: nothing runs on for nobody.

Parallel samples: a GenerateRequest with n > 1 fans out into n child requests (live_request.py),
each journaled and resumed like any request; aborting the client's id aborts every child. Sample
0 computes the prompt; samples i > 0 wait for it, then fork: they share its prompt blocks, the
partial last block copied on write (Request.fork_need, BlockPool._fork).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import msgspec

from ...messages.client import (
    AbortRequest,
    ClientToEngine,
    Delta,
    EngineStats,
    ErrorReply,
    GenerateRequest,
    HealthRequest,
    Ping,
    Pong,
)
from ...messages.codec import DecodeError, Decoder, EngineInbox, peek_request_id
from ...messages.common import FinishReason, max_prompt_chars
from ...messages.control import Drain, Drained, Recover, Roster, RosterEntry
from ...messages.step import AbortRequests, StatsQuery, StatsReply, TokensOut
from ..runtime.actor import YIELD_EVERY, Actor, ErrorThrottle, LoopSocket, actor_main
from ..runtime.grammars import CheckedSpecs
from ..runtime.tokenizer import Tokenizer
from .admission import (
    InvalidRequest,
    check_output_size,
    check_prompt_ids,
    check_prompt_length,
    check_prompt_text,
    check_request,
    check_resume,
    check_structured,
)
from .client_outbox import ClientOutbox
from .client_shares import ClientShares, client_key
from .client_socket import bind_client_router
from .health_queries import HealthQueries
from .journal import Journal
from .live_request import LiveRequest, journal_entries, key
from .quarantine import Quarantine

STATS_TIMEOUT_S = 2.0
INLINE_TOKENIZE_CHARS = 4096  # longer prompts are tokenized on a thread, off the event loop


class Engine(Actor):
    name = "engine"
    inbox = EngineInbox

    def __init__(self, config):
        super().__init__(config)
        self.facts = config.facts
        self.journal = Journal(ClientShares(config))
        self.heard: dict[bytes, float] = {}  # client identity -> when it last sent anything
        self.health = HealthQueries()  # waiting for the Scheduler's stats
        self.roster: list[RosterEntry] = []  # the supervisor's last
        self.client_decoder = Decoder(ClientToEngine)
        self.quarantine = Quarantine(config.poison_crashes)
        self.checked_specs = CheckedSpecs()  # structured outputs' grammars known to parse
        self.epoch = config.epoch  # of the last Recover: TokensOut of another epoch are stale
        self._client_errors = ErrorThrottle()
        self.draining = False

    async def setup(self) -> None:
        self.tokenizer = Tokenizer.from_dir(self.config.model)  # no transformers, no torch
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = max_prompt_chars(longest, self.config.max_model_len)
        router, self.zap = bind_client_router(self.ctx, self.config)
        self.router = LoopSocket(router)
        self.outbox = ClientOutbox(self.router, self._client_gone, self.config.send_timeout_s)

    async def teardown(self) -> None:
        for live in self.journal.live.values():
            self.reply(
                live.identity, ErrorReply("the engine stopped", "unavailable", live.client_id)
            )
        self.router.close(linger=100)
        if self.zap is not None:
            self.zap.stop()  # before the context terminates: its sockets would block that

    async def background(self) -> None:
        """The client socket's read loop (no bytes end it), and the client lease sweep."""
        sweep = asyncio.get_running_loop().create_task(self._sweep_clients())
        try:
            count = 0
            while True:
                frames = await self.router.receive_multipart()
                count += 1
                if count % YIELD_EVERY == 0:
                    await asyncio.sleep(0)  # a flood: let the heartbeat and the mailbox run
                if len(frames) != 2:
                    continue  # not a DEALER/REQ peer speaking our protocol: nothing to answer
                identity, data = frames
                self.heard[identity] = time.monotonic()
                try:
                    self.on_client_message(identity, data)
                except Exception as exc:  # never let one client's message kill the engine
                    if self._client_errors.take() is not None:
                        self.log.exception("a client message failed")
                    rid = peek_request_id(data)
                    self.reply(identity, ErrorReply(f"internal error: {exc}", "internal", rid))
        finally:
            sweep.cancel()

    def reply(self, identity: bytes, message) -> None:
        self.outbox.send(identity, message)

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
            self.on_generate(identity, message)
        elif isinstance(message, AbortRequest):
            self.abort(key(identity, message.request_id))
        elif isinstance(message, Ping):
            unknown = [rid for rid in message.request_ids if not self.journal.knows(identity, rid)]
            self.reply(identity, Pong(unknown, self.draining, message.seq))
        elif isinstance(message, HealthRequest):
            query_id = self.health.ask(identity, message.request_id)
            self.send("scheduler", StatsQuery(query_id))
            asyncio.get_running_loop().call_later(
                STATS_TIMEOUT_S, self._answer_health, query_id, None
            )

    def on_generate(self, identity: bytes, message: GenerateRequest) -> None:
        """Check, tokenize, then admit; on a thread when the prompt is long or the request has a
        structured output (_prepare)."""
        rid = message.request_id
        try:
            if self.draining:
                self.reply(identity, ErrorReply("the engine is shutting down", "unavailable", rid))
                return
            if self.journal.knows(identity, rid):
                raise InvalidRequest(f"request_id {rid!r} is already in use by a live request")
            check_request(message, self.config)
            check_resume(message, self.config)
            if message.prompt is not None:
                check_prompt_text(message.prompt, self.max_prompt_chars, self.config.max_model_len)
            long_prompt = message.prompt is not None and len(message.prompt) > INLINE_TOKENIZE_CHARS
            if long_prompt or message.params.structured is not None:
                self.journal.preparing[key(identity, rid)] = message
                asyncio.get_running_loop().create_task(self._prepare_then_admit(identity, message))
                return
            self.admit(identity, message, self.prompt_token_ids(message))
        except InvalidRequest as exc:
            self.reply(identity, ErrorReply(str(exc), "invalid_request", rid))

    def _prepare(self, message: GenerateRequest) -> list[int]:
        """On a thread: the structured output's check (xgrammar's import and parse take time),
        then the prompt's tokens."""
        check_structured(message.params, self.checked_specs)
        return self.prompt_token_ids(message)

    async def _prepare_then_admit(self, identity: bytes, message: GenerateRequest) -> None:
        eid = key(identity, message.request_id)
        try:
            ids = await asyncio.to_thread(self._prepare, message)
            if self.journal.preparing.get(eid) is not message:
                return  # aborted (or its client went away) meanwhile
            del self.journal.preparing[eid]
            self.admit(identity, message, ids)
        except InvalidRequest as exc:
            self.reply(identity, ErrorReply(str(exc), "invalid_request", message.request_id))
        except Exception as exc:
            self.log.exception("preparing request %r failed", message.request_id)
            self.reply(
                identity, ErrorReply(f"internal error: {exc}", "internal", message.request_id)
            )
        finally:
            if self.journal.preparing.get(eid) is message:
                del self.journal.preparing[eid]

    def prompt_token_ids(self, message: GenerateRequest) -> list[int]:
        if message.prompt is not None:
            return self.tokenizer.encode(message.prompt)
        check_prompt_ids(message.prompt_token_ids, self.config)
        return list(message.prompt_token_ids)

    def admit(self, identity: bytes, message: GenerateRequest, prompt_ids: list[int]) -> None:
        """Journal the request (each of its n samples, or those it resumes) and submit it."""
        rid, params = message.request_id, message.params
        check_prompt_length(len(prompt_ids), self.config)
        check_output_size(len(prompt_ids), params, self.config)
        eid, n, client = key(identity, rid), params.n, client_key(identity, message.tenant)
        samples = n if message.resume is None else len(message.resume)
        refusal = self.journal.refusal(client, samples, len(prompt_ids), params)
        if refusal is not None:
            self.reply(identity, ErrorReply(*refusal, rid))
            return
        entries = journal_entries(identity, message, prompt_ids, self.tokenizer, client)
        self.journal.add(eid, entries, grouped=n > 1)
        for live in entries:
            self.send("scheduler", live.request)

    def abort(self, engine_id: str, tell_client: bool = True) -> None:
        """Abort a client's request (every sample of an n > 1 one)."""
        self.journal.preparing.pop(engine_id, None)
        aborted = self.journal.live_children(engine_id)
        if not aborted:
            return
        self.send("scheduler", AbortRequests(aborted))
        retired = [self._retire(cid) for cid in aborted]
        if tell_client:
            self._send_deltas([(live, live.delta("", [], FinishReason.ABORT)) for live in retired])
        self._maybe_drained()

    def _retire(self, request_id: str) -> LiveRequest:
        """Drop a finished request from the journal, and from the quarantine's watch."""
        live = self.journal.retire(request_id)
        if self.quarantine.forget(request_id):
            self._release_probe()
        return live

    # -- clients that went away --------------------------------------------------------------

    def _client_gone(self, identity: bytes, tell_client: bool = False) -> None:
        """A send to this client failed (EHOSTUNREACH) or it took nothing for send_timeout_s
        (client_outbox.py), or it fell silent: abort its requests (telling it, if silent)."""
        self.heard.pop(identity, None)
        ids = self.journal.of_client(identity)
        if ids:
            self.log.warning(
                "client %s went away: aborting its %d requests", identity.hex(), len(ids)
            )
        for eid in ids:
            self.abort(eid, tell_client)

    async def _sweep_clients(self) -> None:
        """Abort the requests of clients silent for client_lease_s (stopped, or not speaking
        the protocol: the SDK pings every second while it has streams open)."""
        lease = self.config.client_lease_s
        while True:
            await asyncio.sleep(lease / 4)
            now = time.monotonic()
            owners = self.journal.owners()
            for identity, heard in list(self.heard.items()):
                if identity not in owners:
                    del self.heard[identity]
                elif now - heard > lease:
                    self.log.warning("client %s silent for %.0f s", identity.hex(), now - heard)
                    self._client_gone(identity, tell_client=True)

    # -- outputs -----------------------------------------------------------------------------

    def on_tokens_out(self, message: TokensOut) -> None:
        if message.epoch != self.epoch:
            return  # sent before a recovery: its tokens were re-submitted, or will be recomputed
        deltas: list[tuple[LiveRequest, Delta]] = []
        release = False
        for output in message.outputs:
            live = self.journal.get(output.request_id)
            if live is None:  # aborted by the client already
                continue
            if output.token_ids:
                release |= self.quarantine.progressed(output.request_id)
            delta = live.stream(output)
            if delta.finish_reason is not None:
                if output.finish_reason is None:  # a stop string: the Scheduler runs it still
                    self.send("scheduler", AbortRequests([output.request_id]))
                self._retire(output.request_id)
            deltas.append((live, delta))
        self._send_deltas(deltas)
        if release:
            self._release_probe()
        self._maybe_drained()  # after the last deltas went out

    def _send_deltas(self, deltas: list[tuple[LiveRequest, Delta]]) -> None:
        """One message per client: its Delta, or its deltas as one DeltaBatch."""
        by_client: dict[bytes, list[Delta]] = {}
        for live, delta in deltas:
            by_client.setdefault(live.identity, []).append(delta)
        for identity, batch in by_client.items():
            self.outbox.send_deltas(identity, batch)

    def on_stats_reply(self, message: StatsReply) -> None:
        self._answer_health(message.query_id, message.stats)

    def _answer_health(self, query_id: str, stats: EngineStats | None) -> None:
        answer = self.health.answer(query_id, stats, self.roster)
        if answer is not None:
            self.reply(*answer)

    def on_roster(self, message: Roster) -> None:
        self.roster = message.actors

    # -- recovery ----------------------------------------------------------------------------

    def on_recover(self, message: Recover) -> None:
        """Re-submit the journal, but for requests that keep killing one actor (quarantine)."""
        self.epoch = message.epoch
        in_flight = [rid for rid in self.journal if not self.quarantine.is_held(rid)]
        resubmit, failed = self.quarantine.crashed(message.actor, in_flight)
        self.log.warning(
            "epoch %d (%s restarted): re-submitting %d live requests, holding %d, failing %d",
            message.epoch,
            message.actor or "an actor",
            len(resubmit),
            len(self.quarantine.held),
            len(failed),
        )
        for rid in failed:
            live = self._retire(rid)
            crashes = self.config.poison_crashes
            error = (
                f"request failed: the {message.actor} crashed {crashes} or more times in a row "
                f"while it ran (poison_crashes={crashes}); it is not retried"
            )
            self.reply(live.identity, ErrorReply(error, "internal", live.client_id))
            if live.group_id is not None:  # its client's request has failed: stop its siblings
                self.abort(live.group_id, tell_client=False)
        for rid in resubmit:
            if (live := self.journal.get(rid)) is not None:  # not a sibling of a failed one
                self._resubmit(live)
        self._release_probe()
        self._maybe_drained()

    def _resubmit(self, live: LiveRequest) -> None:
        resumed = msgspec.structs.replace(
            live.request, output_token_ids=list(live.output_token_ids)
        )
        self.send("scheduler", resumed)

    def _release_probe(self) -> None:
        """Re-submit the next held suspect, once the last one has made progress or ended."""
        while (rid := self.quarantine.next_probe()) is not None:
            if (live := self.journal.get(rid)) is not None:
                self.log.warning("re-submitting held request %s alone, on trial", rid)
                self._resubmit(live)
                return
            self.quarantine.forget(rid)

    def on_drain(self, message: Drain) -> None:
        self.draining = True
        self._maybe_drained()

    def _maybe_drained(self) -> None:
        if self.draining and not self.journal:
            self.send("supervisor", Drained(self.name, os.getpid()))


if __name__ == "__main__":
    actor_main(Engine, sys.argv[1])
