"""Our Llama-family model in plain torch (reference kernels, fp32, CPU) against transformers, logit
for logit (tolerance: tests/model_support.py), and the checkpoint's config and loader. The CPU fast
path's pieces are tested in tests/test_cpu_fast_path_model.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from actorserve.actors.runtime.model_config import ModelConfig, RopeScaling
from actorserve.actors.worker.loader import load_model
from actorserve.kernels import attention_ops
from actorserve.weights.checkpoints import ensure_checkpoint
from model_support import (
    PagedCache,
    assert_close,
    check_chunked_prefill_then_decode,
    hf_logits,
    random_prompt,
    torch_threads,
)

KINDS = ["tiny-llama", "tiny-qwen3", "tiny-qwen2", "tiny-mistral", "tiny-llama3", "demo"]


@pytest.fixture(scope="session")
def checkpoint():
    """kind -> directory in the shared default root (built once, reused by every test file)."""
    return ensure_checkpoint


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matmuls gain nothing from a second thread and lose much when the cores are busy."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module", params=KINDS)
def models(request, checkpoint):
    """(HF model, our model with the reference kernels, config, checkpoint path) of one kind."""
    from transformers import AutoModelForCausalLM

    path = checkpoint(request.param)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    ours, config = load_model(path, "cpu", torch.float32, attention_ops("cpu", "reference"))
    return hf.eval(), ours, config, path


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


TRITON_ON = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            torch.cuda.is_available() or not _triton_importable(),
            reason="Triton's CPU interpreter runs only where there is no CUDA device",
        ),
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def test_batched_prefill_matches_hf(models):
    hf, ours, config, _ = models
    prompts = {"a": random_prompt(5, 1), "b": random_prompt(19, 2), "c": random_prompt(37, 3)}
    out = PagedCache(ours, config).step(prompts)
    for seq, prompt in prompts.items():
        assert_close(out[seq], hf_logits(hf, prompt))


def test_chunked_prefill_then_decode_matches_hf(models):
    hf, ours, config, _ = models
    check_chunked_prefill_then_decode(hf, ours, config)


@pytest.mark.parametrize("device", TRITON_ON)
def test_triton_kernels_match_hf(models, device):
    """The same schedule through the Triton kernels (interpreted on CPU), fp32."""
    hf, _, _, path = models
    ours, config = load_model(path, device, torch.float32, attention_ops(device, "triton"))
    check_chunked_prefill_then_decode(hf, ours, config, device)


def test_config_fields(checkpoint):
    qwen2 = ModelConfig.from_dir(checkpoint("tiny-qwen2"))
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_dir(checkpoint("tiny-qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 64 and qwen3.num_heads * 64 != qwen3.hidden_size
    llama = ModelConfig.from_dir(checkpoint("tiny-llama"))
    assert llama.tie_word_embeddings and llama.rope_scaling is None
    assert (llama.bos_token_id, llama.eos_token_ids, llama.max_model_len) == (1, (2,), 2048)
    llama3 = ModelConfig.from_dir(checkpoint("tiny-llama3"))
    assert llama3.rope_scaling == RopeScaling(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=256,
    )


def test_config_reads_transformers4_rope_spelling(checkpoint):
    hf = json.loads((checkpoint("tiny-llama3") / "config.json").read_text())
    old = dict(hf)
    params = dict(old.pop("rope_parameters"))
    old["rope_theta"] = params.pop("rope_theta")
    old["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in params.items()}
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(hf)


def test_sliding_window_caps_max_model_len(checkpoint):
    hf = json.loads((checkpoint("tiny-mistral") / "config.json").read_text())
    config = ModelConfig.from_hf({**hf, "sliding_window": 1024})
    assert (config.sliding_window, config.max_model_len) == (1024, 1024)
    qwen2 = json.loads((checkpoint("tiny-qwen2") / "config.json").read_text())
    assert ModelConfig.from_hf({**qwen2, "sliding_window": 1024}).sliding_window is None


def test_config_rejects_unsupported(checkpoint):
    hf = json.loads((checkpoint("tiny-llama") / "config.json").read_text())
    with pytest.raises(ValueError, match="architectures.*GPT2LMHeadModel"):
        ModelConfig.from_hf({**hf, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="rope_type.*yarn"):
        ModelConfig.from_hf({**hf, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf({**hf, "hidden_act": "gelu"})


@pytest.fixture
def broken_checkpoint(checkpoint, tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    src = checkpoint("tiny-llama")
    for name in ("config.json", "generation_config.json"):
        shutil.copyfile(src / name, tmp_path / name)
    return tmp_path, load_file(src / "model.safetensors")


def test_loader_names_missing_tensor(broken_checkpoint):
    path, tensors = broken_checkpoint
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model.layers.1.self_attn.k_proj"):
        load_model(path, "cpu", torch.float32, attention_ops("cpu", "reference"))


def test_loader_names_unexpected_tensor(broken_checkpoint):
    path, tensors = broken_checkpoint
    tensors["model.layers.7.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor.*model.layers.7.mlp.up_proj.weight"):
        load_model(path, "cpu", torch.float32, attention_ops("cpu", "reference"))


def test_loader_names_wrong_shape(broken_checkpoint):
    path, tensors = broken_checkpoint
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:8]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.mlp.gate_up_proj.weight"):
        load_model(path, "cpu", torch.float32, attention_ops("cpu", "reference"))
