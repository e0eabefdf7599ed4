"""The tensor-parallel model (actors/runtime/sharding.py, parallel.py): which slices each
rank holds, checked in-process; and two real ranks on gloo (tensor_parallel_support.py, one
torch thread each) whose logits are TP=1's and whose runner samples TP=1's and transformers'
tokens, the same on both ranks, through chunked prefill and a recompute preemption. tiny-llama
has fewer KV heads than ranks (1 of 2: replicated), tiny-qwen3 splits its 2; a synthetic Llama
with biases and a vocabulary of 1001 (padded to 1002) covers o_proj's bias and the padding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tensor_parallel_support import RankJob, RunnerRequest, run_in_process, run_ranks

from actorserve.actors.runtime.model_config import ModelConfig
from actorserve.actors.runtime.sharding import ShardLayout, TensorSlice
from actorserve.actors.worker.loader import load_model
from actorserve.actors.worker.models.parallel import global_best, local_best
from actorserve.actors.worker.tensor_parallel import TensorParallel
from actorserve.kernels import attention_ops
from actorserve.messages.common import SamplingParams
from actorserve.weights.checkpoints import corpus, train_tokenizer
from support import hf_greedy, prompts_of_lengths, smallest_greedy_margin

MAX_TOKENS = 8
MIN_MARGIN = 1e-3  # top-two gap every greedy step of a compared prompt keeps (fp32 noise ~1e-5)
LOGITS_ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(temperature=0.0, logprobs=2, max_tokens=MAX_TOKENS)


def config_of(**fields) -> ModelConfig:
    base = dict(
        architecture="LlamaForCausalLM", vocab_size=32000, hidden_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=256, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=2048,
        tie_word_embeddings=False, qkv_bias=False, o_bias=False, qk_norm=False,
    )  # fmt: skip
    return ModelConfig(**{**base, **fields})


# --- the sharding math, in-process ---


def test_split_kv_heads_give_each_rank_its_query_heads_and_their_kv_heads():
    layout = ShardLayout.of(config_of(), rank=1, size=2)
    assert (layout.q_heads, layout.kv_heads, layout.intermediate) == ((2, 4), (1, 2), (128, 256))
    assert layout.vocab == (16000, 32000) and layout.vocab_rows == 16000
    slices = {
        name: layout.checkpoint_slice(f"model.layers.0.{name}")
        for name in (
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.bias",
            "self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.gate_proj.weight",
            "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
            "self_attn.q_norm.weight",
        )
    }  # fmt: skip
    assert slices == {
        "self_attn.q_proj.weight": TensorSlice(0, 128, 256, 128),
        "self_attn.k_proj.weight": TensorSlice(0, 64, 128, 64),
        "self_attn.v_proj.bias": TensorSlice(0, 64, 128, 64),
        "self_attn.o_proj.weight": TensorSlice(1, 128, 256, 128),
        "self_attn.o_proj.bias": None,  # added once, after the all-reduce
        "mlp.gate_proj.weight": TensorSlice(0, 128, 256, 128),
        "mlp.up_proj.weight": TensorSlice(0, 128, 256, 128),
        "mlp.down_proj.weight": TensorSlice(1, 128, 256, 128),
        "input_layernorm.weight": None,
        "self_attn.q_norm.weight": None,
    }
    assert layout.checkpoint_slice("lm_head.weight") == TensorSlice(0, 16000, 32000, 16000)
    assert layout.checkpoint_slice("model.embed_tokens.weight") == TensorSlice(
        0, 16000, 32000, 16000
    )
    rank = layout.rank_config(config_of())
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size) == (2, 1, 128)
    assert (rank.vocab_size, rank.hidden_size, rank.head_dim) == (32000, 128, 64)


@pytest.mark.parametrize("heads, kv_heads, size", [(8, 2, 4), (2, 1, 2), (8, 1, 8), (12, 3, 6)])
def test_fewer_kv_heads_than_ranks_are_replicated_to_the_ranks_whose_queries_read_them(
    heads, kv_heads, size
):
    config = config_of(num_heads=heads, num_kv_heads=kv_heads, intermediate_size=96 * size)
    group = heads // kv_heads
    held = []
    for rank in range(size):
        layout = ShardLayout.of(config, rank, size)
        assert layout.num_kv_heads == 1
        kv = layout.kv_heads[0]
        assert all(h // group == kv for h in range(*layout.q_heads))  # the head its queries read
        held.append(kv)
    assert held == sorted(held) and set(held) == set(range(kv_heads))
    assert held.count(0) == size // kv_heads  # each KV head on size / num_kv_heads ranks


def test_the_vocabulary_is_padded_up_to_a_multiple_of_the_ranks():
    last = ShardLayout.of(config_of(vocab_size=1001), rank=1, size=2)
    assert last.vocab == (501, 1001) and last.vocab_rows == 501
    assert last.checkpoint_slice("lm_head.weight") == TensorSlice(0, 501, 1001, 501)
    three = config_of(vocab_size=1000, num_heads=6, num_kv_heads=3, intermediate_size=300)
    spans = [ShardLayout.of(three, r, 3).vocab for r in range(3)]
    assert spans == [(0, 334), (334, 668), (668, 1000)]  # 1002 padded rows, 334 a rank


@pytest.mark.parametrize(
    "fields, size, field",
    [
        (dict(num_heads=6, num_kv_heads=2), 4, "num_attention_heads"),
        (dict(intermediate_size=250), 4, "intermediate_size"),
        (dict(num_heads=12, num_kv_heads=6), 4, "num_key_value_heads"),
        (dict(num_heads=6, num_kv_heads=2, intermediate_size=96), 3, "num_key_value_heads"),
    ],
)
def test_a_model_that_does_not_split_raises_naming_the_field(fields, size, field):
    with pytest.raises(ValueError, match=f"'{field}'.*tensor_parallel_size \\({size}\\)"):
        ShardLayout.of(config_of(**fields), 0, size)


def test_a_single_device_holds_the_whole_model_read_whole():
    config = config_of(vocab_size=1001)
    layout = ShardLayout.of(config)
    assert layout.rank_config(config) is config
    assert layout.checkpoint_slice("model.layers.0.self_attn.q_proj.weight") is None
    assert layout.checkpoint_slice("lm_head.weight") is None
    assert layout.vocab == (0, 1001) and layout.vocab_rows == 1001


def test_greedy_skips_the_padded_columns_even_where_every_real_logit_is_negative():
    layout = ShardLayout.of(config_of(vocab_size=1001), rank=1, size=2)
    logits = -1.0 - torch.rand(3, 501)
    logits[:, 500] = 0.0  # the padded column (what a zero weight row gives)
    best = local_best(logits, layout)
    assert best[:, 1].tolist() == (logits[:, :500].argmax(-1) + 501).tolist()
    assert (best[:, 1] < 1001).all()


def test_global_greedy_pick_is_torch_argmax_over_the_full_row_ties_included():
    config = config_of(vocab_size=1001)
    layouts = [ShardLayout.of(config, r, 2) for r in range(2)]
    full = torch.randint(0, 4, (64, 1001)).float()  # many ties, within and across ranks
    padded = torch.cat((full, torch.full((64, 1), 99.0)), dim=1)  # a padded column never wins
    gathered = torch.stack(
        [local_best(padded[:, r * 501 : (r + 1) * 501], layouts[r]) for r in range(2)]
    )
    assert torch.equal(global_best(gathered), full.argmax(-1))


def test_a_rank_loads_exactly_its_slices_of_the_checkpoint(qwen3_dir):
    ops = attention_ops("cpu", "reference")
    whole, _ = load_model(qwen3_dir, "cpu", torch.float32, ops)
    shard, shape = load_model(qwen3_dir, "cpu", torch.float32, ops, tp=TensorParallel(1, 2))
    assert (shape.num_heads, shape.num_kv_heads, shape.intermediate_size) == (2, 1, 128)
    full = dict(whole.named_parameters())
    part = dict(shard.named_parameters())
    q, kv, d, inter = 4 * 64, 2 * 64, 64, 256
    qkv = full["model.layers.1.self_attn.qkv_proj.weight"]
    q_rows, k_rows, v_rows = qkv[:q], qkv[q : q + kv], qkv[q + kv :]
    want = torch.cat((q_rows[2 * d :], k_rows[d:], v_rows[d:]))  # query heads 2, 3; KV head 1
    assert torch.equal(part["model.layers.1.self_attn.qkv_proj.weight"], want)
    o = full["model.layers.1.self_attn.o_proj.weight"]
    assert torch.equal(part["model.layers.1.self_attn.o_proj.weight"], o[:, 2 * d :])
    gate_up = full["model.layers.1.mlp.gate_up_proj.weight"]
    want = torch.cat((gate_up[inter // 2 : inter], gate_up[inter + inter // 2 :]))
    assert torch.equal(part["model.layers.1.mlp.gate_up_proj.weight"], want)
    down = full["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(part["model.layers.1.mlp.down_proj.weight"], down[:, inter // 2 :])
    assert torch.equal(part["lm_head.weight"], full["lm_head.weight"][16000:])
    assert torch.equal(part["model.embed_tokens.weight"], full["model.embed_tokens.weight"][16000:])
    norm = "model.layers.1.self_attn.q_norm.weight"
    assert torch.equal(part[norm], full[norm])  # replicated


# --- two ranks on gloo ---


def synthetic_llama(path: Path) -> Path:
    """A 1-layer Llama with q/k/v and o biases (attention_bias), 4 query and 2 KV heads, and a
    vocabulary of 1001: odd, so two ranks pad it. Random weights as weights/checkpoints.py sizes
    them, and a byte-level BPE of at most 1001 tokens (the config checks that a tokenizer is
    there)."""
    hidden, inter, heads, kv_heads, d, vocab = 64, 96, 4, 2, 16, 1001
    hf = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab,
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=d,
        max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
        attention_bias=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        dtype="float32",
    )  # fmt: skip
    gen = torch.Generator().manual_seed(11)

    def normal(*shape, std=1.0):
        return torch.randn(*shape, generator=gen) * std

    p = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": normal(vocab, hidden),
        "model.norm.weight": 1 + normal(hidden, std=0.1),
        "lm_head.weight": normal(vocab, hidden, std=4 / hidden**0.5),
        p + "input_layernorm.weight": 1 + normal(hidden, std=0.1),
        p + "post_attention_layernorm.weight": 1 + normal(hidden, std=0.1),
        p + "mlp.gate_proj.weight": normal(inter, hidden, std=hidden**-0.5),
        p + "mlp.up_proj.weight": normal(inter, hidden, std=hidden**-0.5),
        p + "mlp.down_proj.weight": normal(hidden, inter, std=inter**-0.5),
        p + "self_attn.o_proj.weight": normal(hidden, heads * d, std=(heads * d) ** -0.5),
        p + "self_attn.o_proj.bias": normal(hidden, std=0.3),
    }
    for name, rows in (("q", heads * d), ("k", kv_heads * d), ("v", kv_heads * d)):
        tensors[f"{p}self_attn.{name}_proj.weight"] = normal(rows, hidden, std=hidden**-0.5)
        tensors[f"{p}self_attn.{name}_proj.bias"] = normal(rows, std=0.3)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(path / "model.safetensors"))
    train_tokenizer(corpus(limit=200_000), vocab, path)  # at most `vocab` tokens: every id fits
    return path


def clear_prompts(model_dir: Path, count: int = 3) -> list[list[int]]:
    """Prompts whose transformers greedy continuation has a clear winner at every step."""
    candidates = prompts_of_lengths(model_dir, [5, 17, 23, 31, 40, 48, 9, 29])
    clear = [p for p in candidates if smallest_greedy_margin(model_dir, p, MAX_TOKENS) > MIN_MARGIN]
    assert len(clear) >= 2, "too few prompts without near-ties"
    return clear[:count]


def tp_job(model_dir: Path, prompts: list[list[int]]) -> RankJob:
    """Greedy rows (plain: the gathered ids), a greedy row with logprobs and a seeded draw (the
    gathered full logits), chunked prefill of 13 tokens, one request preempted and recomputed."""
    requests = [RunnerRequest(f"g{i}", p, GREEDY) for i, p in enumerate(prompts)]
    requests.append(RunnerRequest("logprobs", prompts[0], GREEDY_LOGPROBS))
    requests.append(RunnerRequest("seeded", prompts[-1], SEEDED))
    return RankJob(
        model_dir=str(model_dir), logits_prompts=prompts, runner_requests=requests,
        max_tokens=MAX_TOKENS, chunk=13, preempt="g0", preempt_after=3,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """(name, model_dir) -> (prompts, TP=1's result, each of two ranks' results), run once."""
    runs = {}

    def run(name: str, model_dir: Path, prompts: list[list[int]] | None = None):
        if name not in runs:
            prompts = clear_prompts(model_dir) if prompts is None else prompts
            job = tp_job(model_dir, prompts)
            workdir = tmp_path_factory.mktemp(f"tp-{name}")
            runs[name] = (prompts, run_in_process(job), run_ranks(job, 2, workdir))
        return runs[name]

    return run


@pytest.fixture(params=["llama_dir", "qwen3_dir"])
def tp_run(request, tp_runs):
    """tiny-llama (1 KV head, replicated on both ranks; tied embeddings) and tiny-qwen3 (2 KV
    heads, split; q/k norm), on prompts without near-ties in transformers' greedy output."""
    model_dir = request.getfixturevalue(request.param)
    return model_dir, *tp_runs(request.param, model_dir)


@pytest.mark.slow
def test_two_ranks_give_the_single_device_logits(tp_run):
    _, prompts, one, ranks = tp_run
    for rank in ranks:  # the full vocabulary on every rank
        for ours, ref, prompt in zip(rank.logits, one.logits, prompts, strict=True):
            assert ours.shape == ref.shape == (len(prompt), 32000)
            assert float((ours - ref).abs().max()) <= LOGITS_ATOL
    assert all(torch.equal(a, b) for a, b in zip(ranks[0].logits, ranks[1].logits))


@pytest.mark.slow
def test_two_ranks_decode_the_single_device_and_transformers_greedy_tokens(tp_run):
    model_dir, prompts, one, ranks = tp_run
    for i, prompt in enumerate(prompts):
        ref = hf_greedy(model_dir, prompt, MAX_TOKENS)  # stops at EOS; the runner does not
        assert ranks[0].tokens[f"g{i}"][: len(ref)] == ref
        assert ranks[0].tokens[f"g{i}"] == one.tokens[f"g{i}"]
    assert ranks[0].tokens["logprobs"] == one.tokens["g0"]  # through the gathered logits


@pytest.mark.slow
def test_every_rank_samples_the_same_tokens_as_the_single_device(tp_run):
    _, _, one, ranks = tp_run
    assert ranks[0].tokens == ranks[1].tokens == one.tokens  # the seeded draw included
    assert all(len(tokens) == MAX_TOKENS for tokens in one.tokens.values())


@pytest.mark.slow
def test_biases_and_a_padded_vocabulary_give_the_single_device_results(tmp_path, tp_runs):
    model_dir = synthetic_llama(tmp_path / "llama-1001")
    prompts = [[1, 5, 999, 1000, 17, 400, 3] * 3, [1, 1000, 501, 500, 502, 2]]
    _, one, ranks = tp_runs("synthetic", model_dir, prompts)
    for rank in ranks:
        for ours, ref in zip(rank.logits, one.logits, strict=True):
            assert ours.shape == ref.shape and ours.shape[1] == 1001
            assert float((ours - ref).abs().max()) <= LOGITS_ATOL
        assert rank.tokens == one.tokens
