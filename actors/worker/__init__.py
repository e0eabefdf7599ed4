"""The Worker process: the device (`python -m actorserve.actors.worker.worker`).

Inbox: StepPlan, CompileGrammar, Reset from the Scheduler on its forward thread's mailbox; Stop.
Owns: the model (models/, loaded by loader.py), the paged KV cache (kv_cache.py, sized by
sizing.py), the persistent batch and the step's inputs (runner.py, flat_step.py,
decode_batch.py, step_buffers.py), sampling (sampler.py and its filters), compiled grammars
(grammar_cache.py), CUDA graphs (graph_runner.py) and, under tensor parallelism, the follower
ranks (tp_group.py, tp_follower.py).
"""
