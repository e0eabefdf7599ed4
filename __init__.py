"""actorserve: vLLM's design as an asyncio actor microkernel over ZeroMQ."""
