"""Give a checkpoint the special tokens DeepSeek's tool-calling and R1 reasoning formats need.

    python -m tools.stdlib_coder.add_special_tokens MODEL_DIR [--out OUT_DIR]

The `<think>` / `</think>` and tool-call tokens (deepinfer/entrypoints/openai/tool_parser.py) that
tokenizer.json lacks are appended as new ids vocab_size, vocab_size + 1, ... (added tokens, not
special, as DeepSeek's tokenizers have them: they stay in decoded text, where the server's parsers
find them). config.json's vocab_size grows by as many; every embedding matrix (`*embed_tokens.weight`)
gets rows equal to the mean embedding, every output head (`lm_head.weight`, an MTP module's
`shared_head.head.weight`) zero rows. So on ordinary text the model computes what it did before,
except that each new token has logit 0 (it enters the softmax denominator; greedy decoding picks
it only where every old logit is below 0). The model was never trained on these tokens: it writes
them under a grammar (tool_choice required, a structured output after reasoning), rarely on its own.

tokenizer_config.json's chat template becomes TOOLS_CHAT_TEMPLATE: DeepSeek-V3's format for
`tools` (listed in the system prompt), assistant `tool_calls` and `tool` messages.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

TOOL_TOKENS = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
               "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
               "<｜tool▁output▁end｜>"]
THINK_TOKENS = ["<think>", "</think>"]
NEW_TOKENS = THINK_TOKENS + TOOL_TOKENS

# DeepSeek-V3's conversation format (system prompts first, <｜User｜> / <｜Assistant｜> turns) with its
# tool-call branches: tools described in the system prompt, an assistant's calls written as
# <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>...,
# consecutive tool results grouped in <｜tool▁outputs▁begin｜>...<｜tool▁outputs▁end｜>; an earlier
# assistant turn keeps only what follows its </think> (as R1's template does).
TOOLS_CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='', is_first_sp=true, in_tool=false) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if tools %}{% set ns.system_prompt = ns.system_prompt + ('\\n\\n' if ns.system_prompt else '')"
    " + '## Tools\\nYou have access to the following functions:\\n' %}"
    "{%- for tool in tools %}{% set ns.system_prompt = ns.system_prompt + '\\n### ' + tool['function']['name']"
    " + '\\nDescription: ' + (tool['function']['description'] or '') + '\\nParameters: '"
    " + (tool['function']['parameters'] | tojson) + '\\n' %}{%- endfor %}"
    "{% set ns.system_prompt = ns.system_prompt + '\\nTo call functions, write <｜tool▁calls▁begin｜>, then for each"
    " call <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGUMENTS\\n```<｜tool▁call▁end｜>, then"
    " <｜tool▁calls▁end｜>.' %}{%- endif %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] != 'tool' and ns.in_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% set ns.in_tool = false %}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{% set content = message['content'] or '' %}"
    "{%- if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content }}"
    "{%- if message['tool_calls'] %}{{ '<｜tool▁calls▁begin｜>' }}"
    "{%- for call in message['tool_calls'] %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + call['function']['name'] + '\\n```json\\n'"
    " + call['function']['arguments'] + '\\n```<｜tool▁call▁end｜>' }}{%- endfor %}"
    "{{ '<｜tool▁calls▁end｜>' }}{%- endif %}{{ '<｜end▁of▁sentence｜>' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if not ns.in_tool %}{{ '<｜tool▁outputs▁begin｜>' }}{% set ns.in_tool = true %}{% endif %}"
    "{{ '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
    "{%- elif message['role'] != 'system' %}{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{%- endif %}{%- endfor %}"
    "{% if ns.in_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


def _is_embedding(name: str) -> bool:
    return name.endswith("embed_tokens.weight")


def _is_head(name: str) -> bool:
    return name == "lm_head.weight" or name.endswith("shared_head.head.weight")


def add_special_tokens(model_dir: str, out_dir: str | None = None, template: str | None = TOOLS_CHAT_TEMPLATE) -> list[int]:
    """Append the missing NEW_TOKENS to the checkpoint in model_dir (written to out_dir, default in
    place); returns their new ids. Refuses (ValueError) a checkpoint whose tokenizer does not fill
    config.json's vocab_size exactly, or whose embedding / head is quantized."""
    import torch
    from safetensors.torch import load_file, save_file

    out_dir = out_dir or model_dir
    if os.path.abspath(out_dir) != os.path.abspath(model_dir):
        shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    vocab = config["vocab_size"]
    known = set(tok["model"]["vocab"]) | {a["content"] for a in tok["added_tokens"]}
    ids = list(tok["model"]["vocab"].values()) + [a["id"] for a in tok["added_tokens"]]
    if max(ids) + 1 != vocab:
        raise ValueError(f"{model_dir}: the tokenizer's ids end at {max(ids)}, config vocab_size is {vocab}: "
                         "new ids would not follow the model's rows")
    missing = [t for t in NEW_TOKENS if t not in known]
    new_ids = list(range(vocab, vocab + len(missing)))
    if not missing:
        return []
    for tid, content in zip(new_ids, missing):
        tok["added_tokens"].append({"id": tid, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": False})
    # every safetensors file holding an embedding or a head gets its rows
    for fname in sorted(os.listdir(out_dir)):
        if not fname.endswith(".safetensors"):
            continue
        path = os.path.join(out_dir, fname)
        tensors = load_file(path)
        changed = False
        for name in list(tensors):
            if not (_is_embedding(name) or _is_head(name)):
                continue
            w = tensors[name]
            if w.shape[0] != vocab:
                raise ValueError(f"{path}: {name} has {w.shape[0]} rows, config vocab_size is {vocab}")
            if name[: -len("weight")] + "weight_scale_inv" in tensors or w.dtype == torch.float8_e4m3fn:
                raise ValueError(f"{path}: {name} is quantized; rows cannot be appended to it here")
            if _is_embedding(name):
                rows = w.float().mean(dim=0, keepdim=True).expand(len(missing), -1).to(w.dtype)
            else:
                rows = torch.zeros(len(missing), w.shape[1], dtype=w.dtype)
            tensors[name] = torch.cat([w, rows]).contiguous()
            changed = True
        if changed:
            mode = os.stat(path).st_mode & 0o777
            save_file(tensors, path, metadata={"format": "pt"})
            os.chmod(path, mode)  # safetensors writes 0600; keep the file's own permissions
    config["vocab_size"] = vocab + len(missing)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    if template is not None:
        cfg_path = os.path.join(out_dir, "tokenizer_config.json")
        with open(cfg_path, encoding="utf-8") as f:
            tok_config = json.load(f)
        tok_config["chat_template"] = template
        with open(cfg_path, "w", encoding="utf-8") as f:
            json.dump(tok_config, f, ensure_ascii=False, indent=2)
    return new_ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--out", default=None, help="write the result here (default: in place)")
    args = parser.parse_args(argv)
    ids = add_special_tokens(args.model_dir, args.out)
    print(f"added {len(ids)} tokens: ids {ids[0]}..{ids[-1]}" if ids else "nothing to add")


if __name__ == "__main__":
    main()
