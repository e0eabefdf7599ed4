"""The model facts the worker needs, parsed from a Hugging Face checkpoint's config.json.

Reads both spellings of the RoPE settings: transformers 4 (`rope_theta` + `rope_scaling` at the top
level) and transformers 5 (`rope_parameters` holding `rope_theta`, `rope_type` and the scaling
fields). Anything the model code cannot run raises ValueError naming the config field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class RopeScaling(msgspec.Struct, frozen=True, kw_only=True):
    """`linear` divides every frequency by `factor`; `llama3` is Llama 3.1's band-wise scaling."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str | None = None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly (full attention equals a window up to its size)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Parse `model_dir/config.json` and, when present, `generation_config.json`."""
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ValueError(f"model directory {str(model_dir)!r} has no config.json")
        hf = json.loads(path.read_text())
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_hf(hf, gen)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        generation = generation or {}
        archs = hf.get("architectures") or []
        if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json field 'architectures' is {archs!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        for field, want in (("hidden_act", "silu"), ("mlp_bias", False)):
            if field in hf and hf[field] != want:
                raise ValueError(
                    f"config.json field {field!r} is {hf[field]!r}; only {want!r} is supported"
                )
        hidden = _int(hf, "hidden_size")
        num_heads = _int(hf, "num_attention_heads")
        num_kv_heads = hf.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"config.json field 'num_key_value_heads' ({num_kv_heads}) must divide "
                f"'num_attention_heads' ({num_heads})"
            )
        head_dim = hf.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _rope(hf)
        attention_bias = bool(hf.get("attention_bias") or False)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        eos = generation.get("eos_token_id", hf.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=_int(hf, "vocab_size"),
            hidden_size=hidden,
            num_layers=_int(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            intermediate_size=_int(hf, "intermediate_size"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_int(hf, "max_position_embeddings"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(hf, arch),
            bos_token_id=generation.get("bos_token_id", hf.get("bos_token_id")),
            eos_token_ids=eos_ids,
            dtype=hf.get("dtype") or hf.get("torch_dtype"),
        )


def _int(hf: dict[str, Any], field: str) -> int:
    value = hf.get(field)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json field {field!r} must be a positive integer, got {value!r}")
    return value


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = dict(hf.get("rope_parameters") or {})
    if set(params) and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("config.json field 'rope_parameters' per layer type is not supported")
    params.update({k: v for k, v in (hf.get("rope_scaling") or {}).items() if k not in params})
    theta = float(params.get("rope_theta") or hf.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("config.json field 'partial_rotary_factor' must be 1.0")
    if rope_type == "default":
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise ValueError(
            f"config.json field 'rope_type' is {rope_type!r}; supported: default, linear, llama3"
        )
    if "factor" not in params:
        raise ValueError(f"config.json rope_type {rope_type!r} needs the field 'factor'")
    fields = {k: params[k] for k in _ROPE_KEYS if params.get(k) is not None}
    if rope_type == "llama3" and "original_max_position_embeddings" not in fields:
        fields["original_max_position_embeddings"] = _int(hf, "max_position_embeddings")
    return theta, RopeScaling(rope_type=rope_type, **fields)


def _sliding_window(hf: dict[str, Any], arch: str) -> int | None:
    """The window when any layer uses one (then max_model_len caps at it), else None."""
    window = hf.get("sliding_window")
    if not window:
        return None
    if arch == "MistralForCausalLM":
        return int(window)
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if arch.startswith("Qwen") and hf.get("use_sliding_window"):
        if hf.get("max_window_layers", 0) < hf.get("num_hidden_layers", 0):
            return int(window)
    return None


class ModelFacts(msgspec.Struct, frozen=True):
    """What the Scheduler and Engine need of the checkpoint, read from its JSON files alone."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]

    @classmethod
    def read(cls, model_dir: str | Path) -> ModelFacts:
        """Parse the checkpoint's config (the Worker's parser: unsupported models fail here,
        before any process starts). max_position_embeddings is capped by a sliding window."""
        config = ModelConfig.from_dir(model_dir)
        return cls(config.vocab_size, config.max_model_len, list(config.eos_token_ids))
