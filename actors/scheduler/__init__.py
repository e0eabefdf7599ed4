"""The Scheduler process: continuous batching (`python -m actorserve.actors.scheduler.scheduler`).

Inbox: AddRequest, AbortRequests, StatsQuery from the Engine; Allocation from the BlockManager;
StepResult, GrammarReady from the Worker; Reset from the supervisor.
Owns: the waiting and running requests (request_state.py) in the pure StepPlanner
(step_planner.py, step_budget.py, admission.py, with the fit of its step times:
step_cost.py), and the
grammar gate (grammar_gate.py); the actor (scheduler.py) only moves the planner's messages.
"""
