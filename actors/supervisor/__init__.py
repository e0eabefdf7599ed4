"""The supervisor process (or the `serve` process's event loop): the actors' parent.

Inbox: its own mailbox: Ready, Heartbeat, ActorError, Drained from every child.
Owns: the child processes (actor_process.py: spawn, exit, recent deaths, restart delay), the
restart budget, the epoch; it starts the four actors in order, restarts one that dies or stops
beating, sends Reset after a replacement is Ready, and stops them in reverse order
(supervisor.py).
"""
