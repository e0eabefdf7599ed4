"""Small Llama-family checkpoints with seeded random weights, for tests, demos and benchmarks.

    python -m actorserve.weights.checkpoints KIND [KIND ...] [--root DIR]     # prints each path

Each kind is a Hugging Face directory (config.json, generation_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) that transformers' AutoModelForCausalLM / AutoTokenizer load.
The tokenizer is a byte-level BPE (vocab 32000, so any UTF-8 round-trips) trained once on the first
8 MB of this interpreter's standard library sources (sorted by path, deterministic) and shared by
every kind. Builds go to a temporary directory renamed into place, so concurrent builders are safe;
a directory is rebuilt only when missing or built from a different spec.

Weight init (seeded, parameters visited in name order): projections are N(0, 1/fan_in), so
attention scores and MLP outputs are O(1) and every layer matters; norm weights are
1 + N(0, 0.1^2) and biases N(0, 0.3^2), so a mis-mapped tensor shows; the output head gives logits
of standard deviation `logit_std` (8 untied: a clear favourite at most positions, not a certain
one). Greedy decoding's gap between the top two logits is then orders of magnitude above fp32
op-order noise (the difference of fp32 and fp64 logits) at nearly every position, so two fp32
implementations agree token for token over hundreds of positions. Tied embeddings (tiny-llama)
feed the input token straight back into its own logit, which makes greedy text loop on a few
tokens; `residual_gain` 3 on o_proj and down_proj lets the layers outweigh it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent  # the project root: weights/ is one level down
VOCAB_SIZE = 32000
CORPUS_BYTES = 8_000_000
FORMAT = 1  # bump to rebuild every cached checkpoint
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")  # ids 0..4
UNK, BOS, EOS, IM_START, IM_END = SPECIAL_TOKENS
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen2's split (words, single digits, punctuation runs, newlines); transformers rebuilds any
# "qwen2" tokenizer with it (plus NFC), so every kind uses it to tokenize the same everywhere.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Trained, not random: the checkpoint `bash scripts/demo.sh` serves, committed in the repo and
# reproduced by scripts/train_demo.py (a Llama that writes Python-looking text; its data is
# python_corpus.py's, its tokenizer its own, not the shared one). Its kind name
# resolves to the directory; it is never built here.
TRAINED_DEMO_KIND = "demo-python"
TRAINED_DEMO = Path(__file__).resolve().parent / TRAINED_DEMO_KIND
_STAMP = "actorserve_checkpoint.json"
_RESIDUAL_OUT = ("o_proj.weight", "down_proj.weight")  # projections that write the residual


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    """`config` holds the transformers config fields; `model_type` picks the config class."""

    model_type: str
    config: dict[str, Any]
    seed: int
    logit_std: float = 8.0
    residual_gain: float = 1.0
    description: str = ""
    dtype: str = "float32"  # on disk; released checkpoints ship bfloat16


def _spec(
    model_type: str,
    seed: int,
    description: str,
    *,
    logit_std: float = 8.0,
    residual_gain: float = 1.0,
    dtype: str = "float32",
    **config: Any,
) -> CheckpointSpec:
    base = dict(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
    )
    return CheckpointSpec(
        model_type, {**base, **config}, seed, logit_std, residual_gain, description, dtype
    )


_TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=64)
_DEMO = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
)  # fmt: skip
KINDS: dict[str, CheckpointSpec] = {
    "demo": _spec("llama", 1, "Llama, ~19M params", **_DEMO),
    "demo-bf16": _spec(
        "llama", 9, "the demo's shape, bf16 on disk as released checkpoints ship", **_DEMO,
        dtype="bfloat16",
    ),
    "tiny-qwen3-bf16": _spec(
        "qwen3", 10, "tiny-qwen3's shape (q/k norm), bf16 on disk",
        **_TINY, num_attention_heads=4, num_key_value_heads=2, dtype="bfloat16",
    ),
    "tiny-llama": _spec(
        "llama", 2, "Llama, tied embeddings",
        **_TINY, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
        logit_std=4.0, residual_gain=3.0,
    ),
    "tiny-qwen3": _spec(
        "qwen3", 3, "Qwen3: q/k norm, head_dim 64 with 4 heads on hidden 128",
        **_TINY, num_attention_heads=4, num_key_value_heads=2,
    ),
    "tiny-qwen2": _spec(
        "qwen2", 4, "Qwen2: q/k/v biases",
        **_TINY, num_attention_heads=2, num_key_value_heads=1,
    ),
    "tiny-mistral": _spec(
        "mistral", 5, "Mistral, no sliding window",
        **_TINY, num_attention_heads=2, num_key_value_heads=1, sliding_window=None,
    ),
    "tiny-llama3": _spec(
        "llama", 6, "Llama with llama3 rope scaling",
        **_TINY, num_attention_heads=2, num_key_value_heads=1,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
        },
    ),
    "llama-125m": _spec(
        "llama", 7, "Llama, ~134M params (benchmarks)",
        hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, head_dim=64,
    ),
    "llama-350m": _spec(
        "llama", 8, "Llama, ~350M params, bf16 on disk as released checkpoints ship (benchmarks)",
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=8, head_dim=64, dtype="bfloat16",
    ),
    "qwen3-350m": _spec(
        "qwen3", 12, "Qwen3's shape (q/k norm, head_dim 128, tied) at ~350M params, the "
        "benchmark vocab, bf16 on disk (benchmarks)",
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=20, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0, tie_word_embeddings=True,
        logit_std=4.0, residual_gain=3.0, dtype="bfloat16",
    ),
    "qwen3-0.6b-shape": _spec(
        "qwen3", 11, "Qwen3-0.6B's shape (28 layers, vocab 151936, tied), bf16 on disk (GPU check)",
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1_000_000.0, tie_word_embeddings=True, logit_std=4.0, residual_gain=3.0,
        dtype="bfloat16",
    ),
}  # fmt: skip


def default_root() -> Path:
    return Path(os.environ.get("ACTORSERVE_CHECKPOINTS") or REPO / ".checkpoints")


def ensure_checkpoint(kind: str, root: Path | None = None) -> Path:
    """The directory of checkpoint `kind` under `root`, built first when missing or stale; the
    trained demo's is its committed directory (`root` does not apply)."""
    if kind == TRAINED_DEMO_KIND:
        if not (TRAINED_DEMO / "config.json").exists():
            raise FileNotFoundError(f"{TRAINED_DEMO} is missing: run scripts/train_demo.py")
        return TRAINED_DEMO
    if kind not in KINDS:
        known = ", ".join([*KINDS, TRAINED_DEMO_KIND])
        raise ValueError(f"unknown checkpoint kind {kind!r}; known: {known}")
    root = Path(root) if root is not None else default_root()
    tokenizer_dir = ensure_tokenizer(root)
    spec = dataclasses.asdict(KINDS[kind])
    del spec["description"]
    fingerprint = _fingerprint({"spec": spec, "tokenizer": _file_sha(tokenizer_dir)})
    return _ensure_dir(
        root / kind, fingerprint, lambda out: _build_model(KINDS[kind], tokenizer_dir, out)
    )


def ensure_tokenizer(root: Path) -> Path:
    """root/tokenizer: tokenizer.json + tokenizer_config.json shared by every kind."""
    fingerprint = _fingerprint({"vocab": VOCAB_SIZE, "corpus": CORPUS_BYTES, "format": FORMAT})
    return _ensure_dir(root / "tokenizer", fingerprint, _build_tokenizer)


def _ensure_dir(final: Path, fingerprint: str, build: Callable[[Path], None]) -> Path:
    if _stamp(final) == fingerprint:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        (tmp / _STAMP).write_text(json.dumps({"fingerprint": fingerprint}) + "\n")
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if final.exists() and _stamp(final) != fingerprint:  # stale: move it out of the way
            stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale.", dir=final.parent))
            os.replace(final, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if _stamp(final) != fingerprint:  # not a concurrent builder's identical result
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _stamp(path: Path) -> str | None:
    try:
        return json.loads((path / _STAMP).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError):
        return None


def _fingerprint(obj: Any) -> str:
    data = json.dumps({"format": FORMAT, **obj}, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _file_sha(tokenizer_dir: Path) -> str:
    return hashlib.sha256((tokenizer_dir / "tokenizer.json").read_bytes()).hexdigest()[:16]


def stdlib_sources() -> list[tuple[str, Path]]:
    """This interpreter's standard-library .py files as (relative path, path), sorted by path."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = (p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    return sorted((p.relative_to(stdlib).as_posix(), p) for p in files)


def corpus(limit: int = CORPUS_BYTES) -> Iterator[str]:
    """Standard-library .py sources sorted by relative path, UTF-8 ones only, ~`limit` bytes."""
    total = 0
    for _, path in stdlib_sources():
        try:
            data = path.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        total += len(data)
        if total >= limit:
            return


def _build_tokenizer(out: Path) -> None:
    train_tokenizer(corpus(), VOCAB_SIZE, out)


def train_tokenizer(texts: Iterator[str], vocab_size: int, out: Path) -> None:
    """A byte-level BPE of `vocab_size` trained on `texts` (the special tokens first, ids 0..4):
    out/tokenizer.json and out/tokenizer_config.json, as every checkpoint here carries."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _build_model(spec: CheckpointSpec, tokenizer_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging

    logging.disable_progress_bar()
    config = AutoConfig.for_model(spec.model_type, **spec.config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights(model, spec)  # in fp32, so every dtype on disk rounds the same draws
    model.to(getattr(torch, spec.dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=spec.config["bos_token_id"], eos_token_id=spec.config["eos_token_id"]
    )
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = spec.config["max_position_embeddings"]
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")


def init_weights(model: Any, spec: CheckpointSpec) -> None:
    """Seeded init (see the module docstring), parameters visited in name order."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    hidden = spec.config["hidden_size"]
    tied = spec.config["tie_word_embeddings"]
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.3, generator=gen)
            elif "embed_tokens" in name:
                param.normal_(0.0, spec.logit_std / hidden**0.5 if tied else 1.0, generator=gen)
            elif name == "lm_head.weight":
                param.normal_(0.0, spec.logit_std / hidden**0.5, generator=gen)
            else:
                gain = spec.residual_gain if name.endswith(_RESIDUAL_OUT) else 1.0
                param.normal_(0.0, gain * param.shape[1] ** -0.5, generator=gen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m actorserve.weights.checkpoints",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("kinds", nargs="+", metavar="KIND", choices=[*KINDS, TRAINED_DEMO_KIND])
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="default: $ACTORSERVE_CHECKPOINTS or <repo>/.checkpoints",
    )
    args = parser.parse_args(argv)
    for kind in args.kinds:
        print(ensure_checkpoint(kind, args.root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
