"""Tokenize the split corpus into flat token streams: each file is BOS + its tokens + EOS, files in path
order, stored as uint16 .npy (the vocab is < 65536). The streams are what train.py and evaluate.py read."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from tools.stdlib_coder.corpus import python_version, split, stdlib_files

EOS_ID = 1


def encode_files(tokenizer_dir: str, texts: list[str]) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    parts = []
    for enc in tok.encode_batch(texts):  # the post-processor prepends BOS
        parts.append(np.asarray(enc.ids + [EOS_ID], dtype=np.uint16))
    return np.concatenate(parts)


def prepare(tokenizer_dir: str, out_dir: str) -> dict:
    train, held = split(stdlib_files())
    os.makedirs(out_dir, exist_ok=True)
    info = {"python": python_version(), "train_files": len(train), "held_out_files": len(held),
            "train_chars": sum(len(f.text) for f in train), "held_out_chars": sum(len(f.text) for f in held),
            "held_out_paths": [f.rel_path for f in held]}
    for name, files in (("train", train), ("held_out", held)):
        ids = encode_files(tokenizer_dir, [f.text for f in files])
        np.save(os.path.join(out_dir, f"{name}.npy"), ids)
        info[f"{name}_tokens"] = int(ids.size)
    with open(os.path.join(out_dir, "data_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("tokenizer_dir")
    ap.add_argument("out_dir")
    args = ap.parse_args()
    info = prepare(args.tokenizer_dir, args.out_dir)
    print({k: v for k, v in info.items() if k != "held_out_paths"})


if __name__ == "__main__":
    main()
