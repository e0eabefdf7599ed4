"""Train the demo checkpoint that writes Python: a small Llama on the standard library's sources.

    python scripts/train_demo.py [--steps 440] [--out weights/demo-python]

Reproduces the committed `weights/demo-python` (what `bash scripts/demo.sh` serves): a Llama of
~11M parameters (hidden 256, 4 layers, tied embeddings, so 8.2M of them are the embedding) with
the tokenizer every random checkpoint shares (actorserve.weights.checkpoints), trained from a
fixed seed on this interpreter's standard-library .py files, minus the held-out ones
(`checkpoints.demo_sources`), with one torch thread. At the end it prints the perplexity of the
trained model and of the random `demo` checkpoint on the held-out files, and a greedy completion.

The data: each file is one document (BOS + its tokens + EOS); the documents are concatenated in
path order and each step reads `batch` windows of `seq_len + 1` tokens at seeded random offsets.
Files under test/, tests/, encodings/ and idlelib/ are left out (checkpoints.DEMO_SKIPPED_DIRS).
The weights are trained in fp32 under bf16 autocast (the matmuls in bf16 where the CPU has it:
roughly twice the tokens in the same minutes) and saved in bf16, which keeps the file under 25 MB.

Reproducible on the same machine type (same stdlib, torch and CPU kernels): the seed fixes the
initial weights and every window; a different CPU may round bf16 matmuls differently.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizer's thread pool: one core, too
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from actorserve.weights import checkpoints  # noqa: E402

EVAL_WINDOWS = 64  # held-out windows of seq_len tokens each, the same for both models
PROMPT = "def fibonacci(n):"
MODEL_CONFIG = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    tie_word_embeddings=True, max_position_embeddings=2048,
)  # fmt: skip


def stdlib_documents(tokenizer, held_out: bool) -> list[int]:
    """The token stream of the training (or held-out) files: BOS + file + EOS, in path order."""
    eos = tokenizer.convert_tokens_to_ids(checkpoints.EOS)
    stream: list[int] = []
    for _, path in checkpoints.demo_sources(held_out):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        stream += tokenizer(text)["input_ids"] + [eos]  # the tokenizer adds BOS
    return stream


def eval_windows(stream: list[int], seq_len: int) -> torch.Tensor:
    """The first EVAL_WINDOWS non-overlapping windows of seq_len tokens: [EVAL_WINDOWS, seq_len]."""
    count = min(EVAL_WINDOWS, len(stream) // seq_len)
    return torch.tensor(stream[: count * seq_len]).view(count, seq_len)


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> float:
    """exp of the mean next-token loss over every window (each window predicts seq_len - 1)."""
    model.eval()
    total = 0.0
    for row in windows.split(8):
        total += model(input_ids=row, labels=row).loss.item() * row.shape[0]
    return math.exp(total / windows.shape[0])


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace, tokenizer, train_stream: list[int]):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(args.seed)  # the initial weights
    config = AutoConfig.for_model(
        "llama",
        vocab_size=checkpoints.VOCAB_SIZE,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **MODEL_CONFIG,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters; {len(train_stream):,} training tokens")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    data = torch.tensor(train_stream)
    windows = torch.Generator().manual_seed(args.seed + 1)
    model.train()
    start = time.perf_counter()
    for step in range(args.steps):
        lr = learning_rate(step, args.steps, args.lr, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(data) - args.seq_len - 1, (args.batch,), generator=windows)
        batch = torch.stack([data[o : o + args.seq_len + 1] for o in offsets.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 20 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - start
            print(
                f"step {step:4d}  loss {loss.item():.3f}  lr {lr:.2e}  {elapsed:6.0f} s", flush=True
            )
    return model


def save(model, tokenizer_dir: Path, out: Path) -> None:
    """A Hugging Face directory: config.json, model.safetensors (bf16), tokenizer files."""
    from transformers import GenerationConfig

    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id
    )
    model.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    model.to(torch.float32)


def greedy(model, tokenizer, prompt: str, tokens: int = 48) -> str:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=checkpoints.TRAINED_DEMO)
    parser.add_argument("--steps", type=int, default=440)
    parser.add_argument("--batch", type=int, default=8, help="windows per step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the machine's other cores belong to others
    torch.use_deterministic_algorithms(True)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_dir = checkpoints.ensure_tokenizer(checkpoints.default_root())
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    train_stream = stdlib_documents(tokenizer, held_out=False)
    held_out = eval_windows(stdlib_documents(tokenizer, held_out=True), args.seq_len)
    model = train(args, tokenizer, train_stream)
    save(model, tokenizer_dir, args.out)

    trained = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    random_demo = AutoModelForCausalLM.from_pretrained(
        checkpoints.ensure_checkpoint("demo"), dtype=torch.float32
    )
    report = {
        "held_out_tokens": held_out.numel(),
        "perplexity_trained": perplexity(trained, held_out),
        "perplexity_random_demo": perplexity(random_demo, held_out),
    }
    print(json.dumps(report, indent=2))
    print(f"{PROMPT!r} -> {greedy(trained, tokenizer, PROMPT)!r}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
