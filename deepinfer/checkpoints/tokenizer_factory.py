"""A small, deterministic DeepSeek-style tokenizer for random-weight test checkpoints.

Why train one instead of shipping a file: test checkpoints must be self-contained and
reproducible offline, and their tokenizer must exercise the same paths as DeepSeek's real one
(byte-level BPE, so multi-byte UTF-8 characters can be split across tokens; the DeepSeek special
tokens; a chat template in tokenizer_config.json). Training on a corpus generated in code takes
well under a second and gives identical files on every machine.
"""

from __future__ import annotations

import json
import os

from deepinfer.errors import ConfigError

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
# Order fixes the ids: bos 0, eos 1, as DeepSeek's own tokenizers have them.
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, PAD_TOKEN]
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the special tokens

# DeepSeek-V3's template, less the tool-call branches: system prompts joined at the front,
# then <｜User｜>... / <｜Assistant｜>...<｜end▁of▁sentence｜> turns.
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + (message['content'] or '') + '<｜end▁of▁sentence｜>' }}"
    "{%- elif message['role'] != 'system' %}{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{%- endif %}{%- endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

_EN_SUBJECTS = ["The model", "A small cat", "My friend", "The engine", "This program", "Every student",
                "The old library", "Our team", "The weather", "A quick brown fox", "The server", "She", "He",
                "They", "We", "The GPU", "The scheduler", "A token"]
_EN_VERBS = ["reads", "writes", "jumps over", "computes", "generates", "loves", "builds", "answers",
             "sends", "finds", "explains", "stores", "returns", "samples", "decodes", "counts"]
_EN_OBJECTS = ["the lazy dog", "a long story", "the next token", "many numbers", "a simple question",
               "the cache", "every request", "beautiful music", "the answer", "some data", "a new idea",
               "the whole world", "three apples", "hello world"]
_EN_TAILS = ["today.", "again and again.", "very quickly!", "in the morning.", "without errors.",
             "for everyone?", "with great care.", "on the CPU.", "before dinner.", "at 10:30 am."]
_MULTILINGUAL = [
    "你好，世界！今天天气很好。", "我们正在测试一个推理引擎。", "深度求索的模型可以回答问题。",
    "中文分词和字节级编码需要正确处理。", "人工智能改变了我们的生活。", "请告诉我一个故事。",
    "北京是中国的首都，上海是一个大城市。", "这个模型生成下一个词。", "学习编程很有意思。",
    "こんにちは、世界。今日はいい天気です。", "日本語のテキストも少し入れます。",
    "안녕하세요, 세계! 반갑습니다.", "Привет, мир! Как дела?", "Модель генерирует следующий токен.",
    "Bonjour le monde, ça va très bien.", "Grüße aus München, schöne Straße.", "¡Hola! ¿Qué tal, señor?",
    "مرحبا بالعالم", "Γειά σου κόσμε", "नमस्ते दुनिया",
    "Emoji test: 😀 😃 😄 😁 🚀 🌍 🎉 👍 ❤️ 🔥", "Cats 🐱 and dogs 🐶 are friends 🤝.",
    "Family: 👨‍👩‍👧‍👦 flags: 🇨🇳 🇺🇸 🇫🇷", "Math: ∑ ∫ √ π ≈ 3.14159, ∞ ≠ 0", "Currency: € £ ¥ ₹ $",
]
_CODE = [
    "def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
    "import torch\nx = torch.zeros(4, 8)\n", "if x > 0 and y < 5:\n    z = x * y\n",
    '{"name": "deepinfer", "version": 1, "tokens": [1, 2, 3]}', "SELECT * FROM users WHERE id = 42;",
    "<html><body><p>Hello</p></body></html>", "x = [i ** 2 for i in range(100)]",
]


def _corpus() -> list[str]:
    """A deterministic English + multilingual + code corpus (no randomness, no files)."""
    lines: list[str] = []
    k = 0
    for s in _EN_SUBJECTS:
        for v in _EN_VERBS:
            o = _EN_OBJECTS[k % len(_EN_OBJECTS)]
            t = _EN_TAILS[(k * 7) % len(_EN_TAILS)]
            lines.append(f"{s} {v} {o} {t}")
            k += 1
    for i in range(200):
        lines.append(f"Number {i} plus {i * 3 + 1} equals {i * 4 + 1}, and {i}% of 1000 is {i * 10}.")
    for i, text in enumerate(_MULTILINGUAL):
        lines.extend([text] * (3 + i % 4))
        lines.append(f"{_EN_SUBJECTS[i % len(_EN_SUBJECTS)]} says: {text}")
    for code in _CODE:
        lines.extend([code] * 4)
    return lines


def _train(vocab_size: int):
    return train_byte_level_bpe(_corpus(), vocab_size)


def train_byte_level_bpe(texts, vocab_size: int, min_frequency: int = 2):
    """DeepSeek-style byte-level BPE over `texts` (an iterable of str): the special tokens first (bos 0,
    eos 1), the 256-byte alphabet, merges up to `vocab_size`, BOS prepended by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # BOS is prepended by the post-processor (as in DeepSeek's tokenizer.json), so Hugging Face
    # loads the same behaviour from the file alone.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, 0)]
    )
    return tok


def _fill_vocab(tok_json: dict, vocab_size: int) -> None:
    """Pad the BPE vocab up to vocab_size with decodable filler tokens (two learned tokens joined).

    A random-weight model samples ids over its whole vocab; without filler, ids above what the
    corpus yields would decode to nothing. Fillers have no merge rule, so encoding never
    produces them and round-trips of real text are unchanged.
    """
    vocab: dict[str, int] = tok_json["model"]["vocab"]
    base = sorted((t for t in vocab if t not in SPECIAL_TOKENS), key=lambda t: vocab[t])
    words = [t for t in base if len(t) > 1] or base
    next_id = max(max(vocab.values()), max(a["id"] for a in tok_json["added_tokens"])) + 1
    total = len(vocab) + sum(1 for a in tok_json["added_tokens"] if a["content"] not in vocab)
    i = 0
    while total < vocab_size:
        a = words[i % len(words)]
        b = words[(i // len(words) * 7 + i * 13 + 1) % len(words)]
        cand = a + b if i < len(words) ** 2 else f"{a}{b}{i}"
        i += 1
        if cand in vocab:
            continue
        vocab[cand] = next_id
        next_id += 1
        total += 1


def write_tokenizer(out_dir: str, vocab_size: int) -> None:
    """Write tokenizer.json + tokenizer_config.json with at most `vocab_size` tokens (bos 0, eos 1)."""
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"vocab_size must be an integer >= {MIN_VOCAB_SIZE} (256 byte tokens + "
            f"{len(SPECIAL_TOKENS)} special tokens) for the byte-level tokenizer (got {vocab_size!r})"
        )
    os.makedirs(out_dir, exist_ok=True)
    tok = _train(vocab_size)
    tok_json = json.loads(tok.to_str())
    _fill_vocab(tok_json, vocab_size)
    ids = {a["content"]: a["id"] for a in tok_json["added_tokens"]}
    assert ids[BOS_TOKEN] == 0 and ids[EOS_TOKEN] == 1, ids
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok_json, f, ensure_ascii=False)
    write_tokenizer_config(out_dir)


def write_tokenizer_config(out_dir: str, model_max_length: int = 16384) -> None:
    """tokenizer_config.json as DeepSeek ships it: fast tokenizer, BOS added, EOS as pad, the chat template."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": {"__type": "AddedToken", "content": BOS_TOKEN, "lstrip": False, "normalized": True,
                      "rstrip": False, "single_word": False},
        "eos_token": {"__type": "AddedToken", "content": EOS_TOKEN, "lstrip": False, "normalized": True,
                      "rstrip": False, "single_word": False},
        "pad_token": {"__type": "AddedToken", "content": EOS_TOKEN, "lstrip": False, "normalized": True,
                      "rstrip": False, "single_word": False},
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
