"""What every actor process shares (no process of its own).

The Actor base (actor.py: mailbox, typed dispatch to on_<message>, Ready, Heartbeat, stop), the
engine's settings (config.py), where the actors are (addresses.py), the checkpoint's facts
(model_config.py) and how they split across tensor-parallel ranks (sharding.py), its tokenizer
and chat templates without transformers (tokenizer.py, chat_templates.py: the Engine and the
gateway), CurveZMQ (curve.py), the structured-output specs' checks (grammars.py: the Engine
checks, the Worker compiles) and the step trace (step_trace.py). A process folder may import
this one, messages/ and kernels/; this folder imports none of them but messages/.
"""
