"""The `actorserve` command (main.py) and `actorserve serve` (serve.py): the one place that wires
the supervisor, the actors and the gateway together; its flags are generated from the config
Structs' fields (flags.py).
"""
