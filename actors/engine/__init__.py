"""The Engine process: the clients' door (`python -m actorserve.actors.engine.engine`).

Inbox: GenerateRequest, AbortRequest, HealthRequest, Ping on the clients' ROUTER; TokensOut,
Recover from the Scheduler; StatsReply; Roster, Drain, Stop from the supervisor.
Owns: the tokenizer, the journal of live requests (live_request.py: prompt ids, params, tokens
sent), admission (admission.py), detokenization and stop strings (detokenizer.py,
stop_strings.py), the per-client outbox (client_outbox.py) and the poison quarantine
(quarantine.py).
"""
