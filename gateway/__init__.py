"""The users' doors: the ZeroMQ SDK (client.py) and the gateway process (process.py) serving the
HTTP / WebSocket / OpenAI-compatible routes (server.py), which reaches the Engine only through
the SDK and routes across data-parallel replicas (replicas.py).
"""
