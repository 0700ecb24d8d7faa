"""Train the byte-level BPE tokenizer on the training split only (held-out files never shape the vocab)."""

from __future__ import annotations

import argparse
import json
import os

from deepinfer.checkpoints.tokenizer_factory import BOS_TOKEN, EOS_TOKEN, train_byte_level_bpe, write_tokenizer_config
from tools.stdlib_coder.corpus import split, stdlib_files

VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 4096


def train_tokenizer(out_dir: str, vocab_size: int = VOCAB_SIZE) -> None:
    train, _ = split(stdlib_files())
    tok = train_byte_level_bpe((f.text for f in train), vocab_size, min_frequency=2)
    os.makedirs(out_dir, exist_ok=True)
    tok_json = json.loads(tok.to_str())
    ids = {a["content"]: a["id"] for a in tok_json["added_tokens"]}
    assert ids[BOS_TOKEN] == 0 and ids[EOS_TOKEN] == 1, ids
    size = len(tok_json["model"]["vocab"])
    if size != vocab_size:
        raise SystemExit(f"BPE produced {size} tokens, wanted {vocab_size}")
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok_json, f, ensure_ascii=False)
    write_tokenizer_config(out_dir, model_max_length=MODEL_MAX_LENGTH)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_dir")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args()
    train_tokenizer(args.out_dir, args.vocab_size)


if __name__ == "__main__":
    main()
