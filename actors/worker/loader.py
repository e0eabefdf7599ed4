"""Load a Hugging Face Llama-family checkpoint directory into our CausalLM.

The model is built on the meta device (no random init, no memory), the checkpoint's tensors are
read from every *.safetensors shard, q/k/v and gate/up are concatenated into the fused
parameters, and the results are assigned in place. Every tensor the model needs must be in the
files and every tensor in the files must be used; either failure names the tensors.

A tensor-parallel rank reads only its shard of each tensor (models/sharding.py), through
safetensors' get_slice, so no rank holds the full model, even while loading.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from actorserve.kernels import AttentionOps
from actorserve.kernels.elementwise import TORCH_ELEMENTWISE, ElementwiseOps

from ..runtime.model_config import ModelConfig
from ..runtime.sharding import ShardLayout, TensorSlice
from .models.llama import CausalLM
from .tensor_parallel import TensorParallel

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_MAX_NAMES = 8


def checkpoint_names(our_name: str) -> tuple[str, ...]:
    """Our parameter name -> the checkpoint tensors it is made of, in concatenation order."""
    for fused, parts in _FUSED.items():
        if f".{fused}." in our_name:
            return tuple(our_name.replace(f".{fused}.", f".{part}.") for part in parts)
    return (our_name,)


def safetensors_files(model_dir: Path) -> list[Path]:
    """The shards named by model.safetensors.index.json, else every model*.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in shards]
    files = sorted(model_dir.glob("model*.safetensors")) or sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(model_dir)!r} has no *.safetensors files")
    return files


def load_model(
    model_dir: str | Path,
    device: torch.device | str,
    dtype: torch.dtype,
    ops: AttentionOps,
    elementwise: ElementwiseOps = TORCH_ELEMENTWISE,
    tp: TensorParallel | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """-> (the model, holding rank `tp.rank`'s shard, whose forward does the collectives; its
    config: this rank's num_heads, num_kv_heads and intermediate_size, the full vocab_size:
    ShardLayout.rank_config). The single-device model without `tp`."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = CausalLM(config, ops, elementwise, tp)
    wanted = {name: checkpoint_names(name) for name, _ in model.named_parameters()}
    needed = {part for parts in wanted.values() for part in parts}
    tensors = _read_tensors(safetensors_files(model_dir), needed, config, model.layout)
    state = {}
    for name, parts in wanted.items():
        pieces = [tensors.pop(part) for part in parts]
        merged = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        state[name] = merged.to(device=device, dtype=dtype)
    _check_shapes(model, state)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary.rebuild(device)
    return model.requires_grad_(False).eval(), model.config


def _read_tensors(
    files: list[Path], needed: set[str], config: ModelConfig, layout: ShardLayout
) -> dict:
    tensors: dict[str, torch.Tensor] = {}
    unexpected = []
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key in needed:
                    tensors[key] = _read_shard(f, key, layout.checkpoint_slice(key))
                elif not _ignorable(key, config):
                    unexpected.append(f"{key} ({path.name})")
    missing = sorted(needed - tensors.keys())
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {_names(missing)}")
    if unexpected:
        raise ValueError(
            f"checkpoint has {len(unexpected)} unexpected tensor(s) for "
            f"{config.architecture}: {_names(sorted(unexpected))}"
        )
    return tensors


def _read_shard(f, key: str, part: TensorSlice | None) -> torch.Tensor:
    """The tensor `key`, or only `part` of it (zero-padded to its length)."""
    if part is None:
        return f.get_tensor(key)
    view = f.get_slice(key)
    tensor = view[part.start : part.stop] if part.dim == 0 else view[:, part.start : part.stop]
    missing = part.length - (part.stop - part.start)
    if missing:
        pad = list(tensor.shape)
        pad[part.dim] = missing
        tensor = torch.cat((tensor, tensor.new_zeros(pad)), dim=part.dim)
    return tensor


def _ignorable(key: str, config: ModelConfig) -> bool:
    """Rotary buffers some exports keep, and the duplicate head of a tied checkpoint."""
    return key.endswith(_IGNORED_SUFFIXES) or (
        config.tie_word_embeddings and key == "lm_head.weight"
    )


def _check_shapes(model: CausalLM, state: dict[str, torch.Tensor]) -> None:
    bad = [
        f"{name} {tuple(state[name].shape)} != {tuple(param.shape)}"
        for name, param in model.named_parameters()
        if state[name].shape != param.shape
    ]
    if bad:
        raise ValueError(f"checkpoint tensor shapes do not match config.json: {_names(bad)}")


def _names(names: list[str]) -> str:
    more = f" ... and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else ""
    return ", ".join(names[:_MAX_NAMES]) + more
