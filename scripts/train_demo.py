"""Train the demo checkpoint that writes Python: a small Llama on permissively licensed Python.

    python scripts/train_demo.py [--steps N] [--lr LR] [--batch B] [--out weights/demo-python]

Reproduces the committed `weights/demo-python` (what `bash scripts/demo.sh` serves;
docs/benchmarks.md has the exact command and its figures). The data is
`actorserve.weights.python_corpus`: this interpreter's standard library plus every installed
distribution whose licence metadata is permissive, deduplicated by content hash, ~1/32 of the
files held out by hash. A byte-level BPE of `--vocab` tokens is trained on the training files
only (checkpoints.train_tokenizer); the corpus tokens and the tokenizer are cached under `--work`
(rebuilt when the file list or the vocab changes).

Training: each file is one document (BOS + its tokens + EOS), all concatenated; each step reads
`batch` windows of `seq_len + 1` tokens at seeded random offsets. fp32 weights under bf16 autocast,
AdamW, linear warm-up then cosine decay to a tenth of the peak, one torch thread (the machine's
other cores belong to others). The run ends after `--steps` or `--max-minutes` of training,
whichever comes first: the schedule follows whichever is further along, so the learning rate
has decayed either way. Every `--checkpoint-every` steps the model is saved to `--out` (bf16
safetensors plus the tokenizer), so a run stopped early still leaves a usable checkpoint.

At the end it prints the perplexity and bits per byte on the first held-out-by-hash files and on
weights/held_out/*.py (Python written for this evaluation, never trained on), and greedy
completions of `def fibonacci(n):` (plain, and with the playground's repetition penalty 1.3);
`--evaluate DIR` prints the same for any checkpoint (the old one, say) and trains nothing.
Reproducible on the same machine type with the same installed packages when `--steps` ends the
run (the seed fixes the initial weights and every window; a different CPU may round bf16 matmuls
differently); when `--max-minutes` ends it, the step count and the schedule followed the
machine's load, and a rerun with `--steps` set to the logged step count (no `--max-minutes`)
follows the same recipe, not the same numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizer's thread pool: one core, too
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from actorserve.weights import checkpoints, python_corpus  # noqa: E402

HELD_OUT_DIR = Path(__file__).resolve().parent.parent / "weights" / "held_out"
EVAL_BYTES = 64_000  # of held-out-by-hash files, the first in hash order
PROMPT = "def fibonacci(n):"


def prepare(work: Path, vocab: int) -> tuple[Path, np.ndarray, np.ndarray, dict]:
    """(tokenizer dir, training tokens, held-out tokens, corpus stats), built once into `work`."""
    sources = python_corpus.python_sources()
    listing = "\n".join(f"{s.distribution} {s.relative} {s.sha256}" for s in sources)
    key = hashlib.sha256(f"{vocab}\n{listing}".encode()).hexdigest()[:16]
    root = work / key
    if (root / "stats.json").exists():
        stats = json.loads((root / "stats.json").read_text())
        return root, np.load(root / "train.npy"), np.load(root / "held_out.npy"), stats
    from transformers import AutoTokenizer

    train_files = [s for s in sources if not s.held_out]
    held_files = sorted((s for s in sources if s.held_out), key=lambda s: s.sha256)
    tmp = work / f".{key}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    print(f"training a {vocab}-token BPE on {len(train_files)} files", flush=True)
    checkpoints.train_tokenizer((s.path.read_text("utf-8") for s in train_files), vocab, tmp)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    eos = tokenizer.convert_tokens_to_ids(checkpoints.EOS)

    def stream(files) -> np.ndarray:
        ids: list[int] = []
        for source in files:
            ids += tokenizer(source.path.read_text("utf-8"))["input_ids"] + [eos]  # BOS added
        return np.asarray(ids, dtype=np.uint16 if vocab <= 65536 else np.int32)

    train, held = stream(train_files), stream(held_files)
    licences: dict[str, list[str]] = {}
    for s in sources:
        licences.setdefault(s.licence, [])
        if s.distribution not in licences[s.licence]:
            licences[s.licence].append(s.distribution)
    stats = {
        "files": {"train": len(train_files), "held_out": len(held_files)},
        "bytes": {
            "train": sum(s.path.stat().st_size for s in train_files),
            "held_out": sum(s.path.stat().st_size for s in held_files),
        },
        "tokens": {"train": int(train.size), "held_out": int(held.size)},
        "distributions": len({s.distribution for s in sources}),
        "licences": licences,
    }
    np.save(tmp / "train.npy", train)
    np.save(tmp / "held_out.npy", held)
    (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    os.replace(tmp, root)
    return root, train, held, stats


def model_config(args: argparse.Namespace, tokenizer):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.kv_heads,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def learning_rate(progress: float, peak: float, warmup: float) -> float:
    """Linear warm-up over the first `warmup` of the run, then cosine decay to a tenth of the
    peak; `progress` is the fraction of the run done, 0 to 1."""
    if progress < warmup:
        return peak * max(progress, 1e-3) / warmup
    decayed = (progress - warmup) / max(1e-9, 1 - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, decayed))))


@torch.no_grad()
def mean_loss(model, ids: torch.Tensor, window: int) -> tuple[float, int]:
    """(summed next-token loss, tokens predicted) over `ids` cut into windows of `window`."""
    model.eval()
    total, count = 0.0, 0
    for chunk in ids.split(window):
        if chunk.numel() < 2:
            continue
        row = chunk.view(1, -1)
        total += model(input_ids=row, labels=row).loss.item() * (row.shape[1] - 1)
        count += row.shape[1] - 1
    model.train()
    return total, count


def evaluation_texts() -> dict[str, str]:
    """What every model is measured on, as text (so models with different tokenizers read the
    same bytes): the first held-out-by-hash files in hash order, ~EVAL_BYTES of them, joined
    into one name; and each weights/held_out file."""
    held = sorted(python_corpus.demo_corpus(held_out=True), key=lambda s: s.sha256)
    texts: list[str] = []
    while held and sum(map(len, texts)) < EVAL_BYTES:
        texts.append(held.pop(0).path.read_text("utf-8"))
    named = {"by_hash": texts}
    named.update({p.name: [p.read_text("utf-8")] for p in sorted(HELD_OUT_DIR.glob("*.py"))})
    return named


def evaluate(model, tokenizer, texts: dict[str, list[str]], window: int) -> dict:
    """Perplexity per token and bits per byte of each named group of texts: each text is its own
    document (BOS first) cut into windows of `window` tokens. Bits per byte compares models with
    different tokenizers; perplexity does not."""
    report = {}
    for name, group in texts.items():
        loss, count, size = 0.0, 0, 0
        for text in group:
            ids = torch.tensor(tokenizer(text)["input_ids"])
            part, n = mean_loss(model, ids, window)
            loss, count, size = loss + part, count + n, size + len(text.encode())
        report[name] = _figures(loss, count, size)
    return report


def _figures(loss: float, count: int, text_bytes: int) -> dict:
    return {
        "perplexity": round(math.exp(loss / count), 2),
        "bits_per_byte": round(loss / math.log(2) / text_bytes, 3),
        "tokens": count,
    }


def save(model, tokenizer_dir: Path, out: Path) -> None:
    """A Hugging Face directory: config.json, model.safetensors (bf16), tokenizer files."""
    import copy

    from transformers import GenerationConfig

    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    copy_ = copy.deepcopy(model).to(torch.bfloat16)
    copy_.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=model.config.eos_token_id
    )
    copy_.save_pretrained(tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def greedy(model, tokenizer, prompt: str, tokens: int = 64, penalty: float = 1.0) -> str:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False, repetition_penalty=penalty)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def train(args, model, tokenizer_dir: Path, data: np.ndarray, seconds: float = 0.0) -> dict:
    """Train in place for args.steps steps or `seconds` of wall clock, whichever ends first (the
    schedule follows whichever is further along, so the decay completes either way); save to
    args.out every args.checkpoint_every steps and at the end (the caller's)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    tokens = torch.from_numpy(data.astype(np.int64))
    windows = torch.Generator().manual_seed(args.seed + 1)
    model.train()
    start = time.perf_counter()
    losses: list[float] = []
    for step in range(args.steps):
        elapsed = time.perf_counter() - start
        progress = max(step / args.steps, elapsed / seconds if seconds else 0.0)
        if progress >= 1.0:
            print(f"stopping at step {step}: {seconds:.0f} s of wall clock ran out", flush=True)
            break
        lr = learning_rate(progress, args.lr, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(tokens) - args.seq_len - 1, (args.batch,), generator=windows)
        batch = torch.stack([tokens[o : o + args.seq_len + 1] for o in offsets.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        elapsed = time.perf_counter() - start
        if step % 25 == 0 or step == args.steps - 1:
            print(
                f"step {step:5d}  loss {loss.item():.3f}  lr {lr:.2e}  {elapsed:6.0f} s", flush=True
            )
        if args.checkpoint_every and step and step % args.checkpoint_every == 0 and args.out:
            save(model, tokenizer_dir, args.out)
            print(f"saved {args.out} at step {step}", flush=True)
    return {
        "steps": len(losses),
        "seconds": round(time.perf_counter() - start),
        "final_train_loss": round(sum(losses[-10:]) / len(losses[-10:]), 3),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=checkpoints.TRAINED_DEMO)
    p.add_argument("--work", type=Path, default=checkpoints.REPO / ".checkpoints" / "demo-work")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=384, help="a multiple of 64 (the head size)")
    p.add_argument("--intermediate", type=int, default=960)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=2600)
    p.add_argument("--batch", type=int, default=4, help="windows per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=float, default=0.05, help="the fraction of the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads: the cores this run may take"
    )
    p.add_argument("--checkpoint-every", type=int, default=250)
    p.add_argument(
        "--max-minutes", type=float, default=0.0, help="training's wall-clock limit; 0: none"
    )
    p.add_argument(
        "--evaluate", type=Path, default=None, help="only measure this model directory and exit"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.evaluate:
        return report_on(args.evaluate, args.seq_len)
    tokenizer_dir, data, held, stats = prepare(args.work, args.vocab)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(args.seed)  # the initial weights
    model = AutoModelForCausalLM.from_config(model_config(args, tokenizer), dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params / 1e6:.2f}M parameters; corpus {json.dumps(stats['tokens'])}", flush=True
    )
    run = train(args, model, tokenizer_dir, data, seconds=args.max_minutes * 60)
    if args.out:
        save(model, tokenizer_dir, args.out)
    report = {
        **run,
        "parameters": params,
        "evaluation": evaluate(model, tokenizer, evaluation_texts(), args.seq_len),
    }
    print(json.dumps(report, indent=2))
    print_completions(model, tokenizer)
    print(f"corpus: {json.dumps(stats)}")
    return 0


def print_completions(model, tokenizer) -> None:
    for penalty in (1.0, 1.3):
        text = greedy(model, tokenizer, PROMPT, penalty=penalty)
        print(f"repetition_penalty {penalty}: {PROMPT!r} -> {text!r}")


def report_on(model_dir: Path, window: int) -> int:
    """--evaluate: the figures of any checkpoint (with its own tokenizer) on the same texts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    print(json.dumps(evaluate(model, tokenizer, evaluation_texts(), window), indent=2))
    print_completions(model, tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
