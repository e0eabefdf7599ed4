"""A checkpoint converted to GGUF for llama.cpp, with llama.cpp's own converter.

    python scripts/peers_gguf.py --llama-cpp .peers/llama.cpp --model DIR --outtype f32 \
        --outfile .peers/gguf/NAME-f32.gguf

The converter (`convert_hf_to_gguf.py` and its `conversion` package, in llama.cpp's tree) names
a BPE tokenizer's pre-tokenizer by hashing how the tokenizer splits a fixed text, and stops on a
hash it does not know. The checkpoints of weights/checkpoints.py split text with Qwen2's
pre-tokenizer regex (checkpoints.PRETOKENIZE_REGEX, the same as Qwen2's): this wrapper imports
the converter as a module and answers `--pre-tokenizer` (default qwen2) where its table has no
entry, and moves past the sentencepiece vocabulary where the checkpoint has no tokenizer.model
(as the converter does when sentencepiece is installed), then runs its main() unchanged.
Nothing of llama.cpp's is copied or edited.

`q8_0` is written by the converter itself (it quantizes from the checkpoint's values), like
`f32` and `bf16`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def convert(llama_cpp: Path, model_dir: Path, outtype: str, outfile: Path, pre: str) -> None:
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    sys.path.insert(0, str(llama_cpp))
    import convert_hf_to_gguf
    from conversion import base

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            base.logger.info(f"pre-tokenizer not in llama.cpp's table: using {pre!r}")
            return pre

    spm = base.TextModel._set_vocab_sentencepiece

    def set_vocab_sentencepiece(self, *a, **k) -> None:
        # What the converter does with sentencepiece installed and no tokenizer.model: it moves
        # on to the next vocabulary kind (here: the BPE of tokenizer.json).
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError("no tokenizer.model")
        spm(self, *a, **k)

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    base.TextModel._set_vocab_sentencepiece = set_vocab_sentencepiece
    outfile.parent.mkdir(parents=True, exist_ok=True)
    sys.argv = [
        "convert_hf_to_gguf.py",
        str(model_dir),
        "--outtype",
        outtype,
        "--outfile",
        str(outfile),
    ]
    convert_hf_to_gguf.main()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree")
    parser.add_argument("--model", type=Path, required=True, help="a checkpoint directory")
    parser.add_argument("--outtype", choices=["f32", "bf16", "q8_0"], required=True)
    parser.add_argument("--outfile", type=Path, required=True)
    parser.add_argument("--pre-tokenizer", default="qwen2", help="llama.cpp's name for it")
    args = parser.parse_args(argv)
    convert(args.llama_cpp, args.model, args.outtype, args.outfile, args.pre_tokenizer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
