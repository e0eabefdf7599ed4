"""The CPU fast path: C kernels over the paged KV cache, weights packed for them, fused greedy
heads. Everything here is optional: with EngineConfig.cpu_fast_path=False, or without a C
compiler, the model runs in plain torch with the same tokens.

The runner and the Worker use one interface, fast_path.CpuFastPath. Behind it:
    build.py            compile csrc/ into one library, cached per user
    bindings.py         load it: the ctypes signatures, one typed wrapper per kernel
    panel_bindings.py   ... those of the panel products: each kind of panels' packing
    csrc/               the C sources and headers
    attention.py        the `cpu` attention backend (C paged attention, torch fallbacks), store_kv,
                        argmax_rows
    elementwise.py      RMSNorm, RoPE, SiLU-and-multiply in C (ElementwiseOps)
    panels.py           weights packed in panels: PanelLinear, PackedLinear, GreedyHead
    quantize.py         int8 weights with a scale per output channel (quantization int8)
    bf16_weight_rule.py whether bf16-weight panels (quantization bf16) beat fp32 ones here, timed
    lm_head.py          the LM head's copies: the greedy head and its screens, oneDNN's packed one
    screened_head.py    greedy tokens behind a bf16 screen, exact
    screened_head_int8.py  the same behind an AMX int8 screen
    decode_stack.py     a whole decode step in one C call
    decode_inputs.py    a decode step's flat inputs, written in C into reused buffers
    huge_pages.py       large tensors on 2 MiB pages
    capability.py       what the CPU does in hardware (native bf16): one place for every choice
"""
