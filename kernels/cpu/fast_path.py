"""The CPU fast path's one interface: what the Worker's runner and its model get from it.

Built from four EngineConfig fields: `cpu_fast_path` (off: the model runs in plain torch, the
same tokens), `greedy_head_screen` (lm_head.py), `transparent_huge_pages` (huge_pages.py) and
`quantization`. `prepare` rewrites the model for the CPU once, after loading: each projection's
weight stored column-major (MKL's small-batch products read W.T row by row) and, where it has no
bias, its Linear replaced by a PackedLinear with the weight also in panels (panels.py); copies
of the LM head (lm_head.py); the decode stack over the KV caches (decode_stack.py). With
`quantization` int8 (an fp32 model) each bias-free projection is quantized as it is packed and
its panels are then its only copy (quantize.py); the embedding, the norms and the LM head stay
fp32, and the decode stack runs over the int8 panels. With `quantization` bf16 (an fp32 model,
typically a bf16 checkpoint upcast on a CPU without bf16 arithmetic) the same holds with the
weights in bf16-weight panels instead: half the bytes, fp32 arithmetic. Its elementwise ops
(`elementwise`) are given to the model when it is built, and its attention is the `cpu` backend
(kernels.attention_ops). A bf16 model, where the CPU multiplies bf16 natively (capability.py,
or `native_bf16` given), gets its projections packed in bf16 panels and an exact bf16 greedy
head (no screen: the screens are fp32 tricks), whose panels also give its decode-sized logits,
and over a bf16 KV cache the decode stack in its bf16 form. The runner then asks it for a decode
step's inputs (`decode_inputs`), the step's hidden states (`forward`), greedy tokens
(`greedy_tokens`), logits (`compute_logits`) and the sampler's argmax (`argmax_rows`).
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch
from torch import nn

from ..elementwise import ElementwiseOps
from . import bindings, huge_pages, lm_head
from .attention import argmax_rows
from .capability import cpu_has_bf16
from .decode_inputs import DecodeInputs
from .decode_stack import DecodeStack, StackLayer, StackShape
from .elementwise import C_ELEMENTWISE
from .panels import PANEL_ROWS, GreedyHead, PackedLinear, PanelLinear

log = logging.getLogger(__name__)


class CpuFastPath:
    """The C kernels, packed weights and fused heads for one model on the CPU (see the module
    docstring). Until `prepare`, nothing of a model is held and `forward` / `greedy_tokens`
    serve no step."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        screen: str = "auto",
        huge: bool = True,
        native_bf16: bool | None = None,
        quantization: str = "none",
    ) -> None:
        """native_bf16: whether bf16 weights get the bf16 kernels (None: where the CPU has bf16
        products, capability.cpu_has_bf16). quantization: EngineConfig.quantization (int8: an
        fp32 model's projections in int8 panels; bf16: in bf16-weight panels)."""
        self.lib = lib
        self.screen = screen
        self.huge = huge
        self.native_bf16 = cpu_has_bf16() if native_bf16 is None else native_bf16
        self.int8 = quantization == "int8"
        self.bf16_weights = quantization == "bf16"
        self.elementwise: ElementwiseOps = C_ELEMENTWISE
        self._model: nn.Module | None = None
        self._greedy_head = None  # GreedyHead | ScreenedHead, see lm_head.greedy_head
        self._packed_lm_head: torch.Tensor | None = None
        self._stack: DecodeStack | None = None
        self._stack_caches: list | None = None  # the KV caches the decode stack writes

    @classmethod
    def create(cls, config, device: torch.device | str) -> CpuFastPath | None:
        """The fast path for an EngineConfig on `device`, or None (the reason logged): turned
        off, not a CPU, or no C library (no compiler, a failed build)."""
        if not config.cpu_fast_path:
            log.info("CPU fast path off (cpu_fast_path=False): plain torch")
            return None
        if torch.device(device).type != "cpu":
            log.info("CPU fast path off: the device is %s", torch.device(device).type)
            return None
        lib = bindings.load()  # logs why when there is none
        if lib is None:
            return None
        return cls(
            lib, config.greedy_head_screen, config.transparent_huge_pages,
            quantization=config.quantization,
        )  # fmt: skip

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed CPU tensor on huge pages where asked: for the KV cache, which every decode
        step streams."""
        return huge_pages.zeros(shape, dtype, self.huge)

    def prepare(
        self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None
    ) -> None:
        """Lay out and pack `model`'s weights for the CPU (the module docstring) and pack the
        decode stack over `kv_caches` where it serves (None: no decode stack). A bf16 model gets
        bf16 panels, a bf16 greedy head and, over a bf16 KV cache, the decode stack where
        native_bf16 (else its weights stay as loaded and its steps run through the model, plain
        torch); an fp32 model over a bf16 KV cache gets no decode stack. With int8 (bf16)
        quantization an fp32 model's bias-free projections keep only their int8 (bf16-weight)
        panels."""
        self._model = model
        self._pack_projections(model)  # before the copies below: int8 panels replace weights
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.weight is not None:
                if module.weight.dtype == torch.float32:
                    module.weight.data = module.weight.data.t().contiguous().t()
        weight = model.lm_head_weight()
        if weight.device.type == "cpu" and weight.dtype == torch.float32:
            self._greedy_head = lm_head.greedy_head(weight, self.screen, self.huge)
            self._packed_lm_head = lm_head.packed_logits_weight(weight)
        elif weight.dtype == torch.bfloat16:
            self._greedy_head = GreedyHead.for_weight(weight, self.huge, self.native_bf16)
        if kv_caches is not None:
            self._pack_decode_stack(model, kv_caches)

    def _pack_projections(self, model: nn.Module) -> None:
        """Each decoder layer's bias-free Linear -> a PackedLinear sharing its weight, or over
        int8 or bf16-weight panels (quantization int8 or bf16, an fp32 weight) holding the
        weight alone."""
        quantized = kept = 0
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, child in list(parent.named_children()):
                    if type(child) is not nn.Linear or child.bias is not None:
                        kept += type(child) is nn.Linear
                        continue
                    fp32 = child.weight.dtype == torch.float32
                    int8, bf16_weights = self.int8 and fp32, self.bf16_weights and fp32
                    panel = PanelLinear.for_weight(
                        child.weight, self.huge, self.native_bf16, int8, bf16_weights
                    )
                    if panel is not None:
                        setattr(parent, name, PackedLinear(child, panel))
                        quantized += int8 or bf16_weights
        if self.int8 or self.bf16_weights:
            kind = "int8" if self.int8 else "bf16"
            log.info(
                "quantization %s: %d projections in %s panels, %d with a bias kept as loaded%s",
                kind, quantized, "int8" if self.int8 else "bf16-weight", kept,
                self._int8_products() if self.int8 else "",
            )  # fmt: skip

    def _int8_products(self) -> str:
        """How the int8 panels multiply on this CPU (csrc/cpu_panel_gemm_int8.c)."""
        if self.lib.panel_int8_dot():
            return "; int8 x int8 products (AVX512-VNNI), each row quantized per projection"
        return "; int8 weights widened to fp32 products (no AVX512-VNNI)"

    def _pack_decode_stack(self, model: nn.Module, kv_caches) -> bool:
        """Let decode steps run the whole decoder in one C call, over these KV caches: only
        where the layers' kernels are the ones the stack runs (the `cpu` attention backend, this
        path's elementwise ops, every projection packed), so an fp32 model's
        hidden states are theirs to the bit (a bf16 model's within bf16 rounding: fp32 inside
        the step). Returns whether it serves."""
        attentions = [layer.self_attn for layer in model.model.layers]
        projections = [
            p
            for layer in model.model.layers
            for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj)
            + (layer.mlp.gate_up_proj, layer.mlp.down_proj)
        ]
        if (
            model.elementwise is not self.elementwise
            or any(a.ops.name != "cpu" for a in attentions)
            or any(not isinstance(p, PackedLinear) for p in projections)
        ):
            return False
        c = model.config
        shape = StackShape(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.rms_norm_eps, attentions[0].scale,
        )  # fmt: skip
        layers = [
            StackLayer(
                layer.input_layernorm.weight.data.float(),
                layer.post_attention_layernorm.weight.data.float(),
                layer.self_attn.qkv_proj.panel.panels,
                layer.self_attn.o_proj.panel.panels,
                layer.mlp.gate_up_proj.panel.panels,
                layer.mlp.down_proj.panel.panels,
                *kv_cache,
                *_qk_norms(layer.self_attn),
            )
            for layer, kv_cache in zip(model.model.layers, kv_caches, strict=True)
        ]
        embed = model.model.embed_tokens.weight.data
        tables = (model.rotary.cos, model.rotary.sin)
        try:
            self._stack = DecodeStack(
                self.lib, shape, embed, tables, model.model.norm.weight.data.float(), layers
            )
        except ValueError:  # a tensor not of the model's dtypes or not contiguous
            return False
        self._stack_caches = kv_caches
        return True

    @property
    def greedy_head(self):
        """The greedy head `prepare` chose (lm_head.greedy_head), or None where none serves."""
        return self._greedy_head

    @property
    def serves_decode_stack(self) -> bool:
        """Whether `prepare` packed the decode stack (decode steps then run in one C call)."""
        return self._stack is not None

    def decode_inputs(self, numbers: np.ndarray, columns: int) -> DecodeInputs:
        """Buffers for a step of decodes' flat inputs, filled in C (decode_inputs.py); numbers
        [n, 4] int64 as DecodeInputs takes them, for requests of at most `columns` blocks."""
        return DecodeInputs(self.lib, numbers, columns)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor | None:
        """The model's forward for a step of decodes alone (one token a sequence, at most
        PANEL_ROWS) over the caches the stack was packed over: the hidden states after the final
        norm, the same as the model's; None for any other step (the model serves it)."""
        if self._stack is None or kv_caches is not self._stack_caches:
            return None
        if input_ids.shape[0] > PANEL_ROWS:  # the stack itself checks one token a sequence
            return None
        return self._stack(input_ids, positions, *meta)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] in the head's dtype -> [N] int64, the first maximum of each row's
        logits (what compute_logits then an argmax gives), or None where no fused head
        serves."""
        if self._greedy_head is None or hidden.dtype != self._model.lm_head_weight().dtype:
            return None
        return self._greedy_head(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's compute_logits: hidden [N, hidden] -> logits [N, vocab] float32. A bf16
        head's decode-sized rows come from its greedy head's panels: the fp32 sums that
        greedy_tokens compares, not rounded to bf16 first."""
        packed = self._packed_lm_head
        rows = hidden.shape[0]
        if packed is not None and rows >= lm_head.PACKED_MIN_ROWS and hidden.dtype == torch.float32:
            return lm_head.packed_logits(hidden, packed)
        head = self._greedy_head
        if (
            isinstance(head, GreedyHead)
            and head.dtype == torch.bfloat16 == hidden.dtype
            and rows <= PANEL_ROWS
        ):
            return head.logits(hidden)
        return self._model.compute_logits(hidden)

    @staticmethod
    def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
        """[N, V] -> [N] int64, the first maximum of each row (attention.argmax_rows: in C)."""
        return argmax_rows(logits)


def _qk_norms(attention: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """An attention layer's per-head q/k norm weights in fp32 (Qwen3), or (None, None)."""
    if attention.q_norm is None:
        return None, None
    return attention.q_norm.weight.data.float(), attention.k_norm.weight.data.float()
