"""The offline chat demo's assets: a small seeded chat corpus and a byte-level BPE tokenizer trained on it.

``python recipes/finetune.py +cp=blockdiag data=chat_demo`` trains on them without any download
(``conf/data/chat_demo.yaml``). Both are committed under ``nemo_automodel/assets/chat_demo/`` and rebuilt,
byte for byte, by::

    python -m nemo_automodel.components.datasets.chat_demo            # rewrites the committed assets
    python -m nemo_automodel.components.datasets.chat_demo --out DIR  # or writes them elsewhere

The corpus is made of short question/answer templates over small fact tables (capitals, opposites,
colours, single-digit sums), some with a system turn and some with two or three exchanges, so a ~3M
parameter model learns to answer in a couple of hundred steps. The tokenizer is byte-level (any text
encodes, nothing maps to an unknown token) with a chat template of role headers and ``<|end|>`` (its EOS)
closing every turn, so a fine-tuned model learns to stop.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "chat_demo"
CHATS_FILE = "chats.jsonl"
TOKENIZER_DIR = "tokenizer"
NUM_CHATS = 3000
VOCAB_SIZE = 1024
SEED = 2026

SPECIAL_TOKENS = ("<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
# Every turn: role header, content, <|end|> (the EOS, so the end of an answer is a target), newline.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "Canada": "Ottawa",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Norway": "Oslo",
    "Greece": "Athens",
    "Poland": "Warsaw",
    "Chile": "Santiago",
    "Cuba": "Havana",
    "Ireland": "Dublin",
    "Austria": "Vienna",
}
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "fast": "slow",
    "up": "down",
    "light": "dark",
    "old": "new",
    "happy": "sad",
    "early": "late",
    "open": "closed",
    "full": "empty",
    "loud": "quiet",
    "hard": "soft",
}
COLOURS = {
    "the sky": "blue",
    "grass": "green",
    "snow": "white",
    "a banana": "yellow",
    "coal": "black",
    "a tomato": "red",
    "an orange": "orange",
    "a plum": "purple",
}
SYSTEM_PROMPTS = ("You are a helpful assistant.", "Answer in one short sentence.")
GREETINGS = (("Hello!", "Hello! How can I help you today?"), ("Thanks!", "You are welcome."))


def _exchange(rng: random.Random) -> tuple[str, str]:
    """One question and its answer, from a fact table picked at random."""
    kind = rng.randrange(5)
    if kind == 0:
        country = rng.choice(sorted(CAPITALS))
        question = rng.choice(("What is the capital of {}?", "Which city is the capital of {}?"))
        return question.format(country), f"The capital of {country} is {CAPITALS[country]}."
    if kind == 1:
        word = rng.choice(sorted(OPPOSITES))
        return f"What is the opposite of {word}?", f"The opposite of {word} is {OPPOSITES[word]}."
    if kind == 2:
        thing = rng.choice(sorted(COLOURS))
        return f"What color is {thing}?", f"{thing[0].upper()}{thing[1:]} is {COLOURS[thing]}."
    if kind == 3:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    return rng.choice(GREETINGS)


def conversations(count: int = NUM_CHATS, seed: int = SEED) -> list[dict[str, Any]]:
    """``count`` seeded conversations in ``data=chat``'s format: an optional system turn, then 1-3 exchanges."""
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.25 else []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            question, answer = _exchange(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        chats.append({"messages": messages})
    return chats


def build_tokenizer(chats: list[dict[str, Any]], vocab_size: int = VOCAB_SIZE) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` of ``vocab_size`` ids trained on the chats' text.

    Training is deterministic for the same text and ``tokenizers`` release (merges are ranked by count,
    ties by the pair itself).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [m["content"] for chat in chats for m in chat["messages"]]
    core.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|pad|>",
        eos_token="<|end|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:4]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_assets(out: Path = ASSETS, count: int = NUM_CHATS, seed: int = SEED) -> Path:
    """Write ``chats.jsonl`` and ``tokenizer/`` into ``out``; return ``out``."""
    chats = conversations(count, seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / CHATS_FILE).write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    build_tokenizer(chats).save_pretrained(str(out / TOKENIZER_DIR))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ASSETS, help=f"output directory (default: {ASSETS})")
    args = parser.parse_args(argv)
    print(f"chat demo assets written to {write_assets(args.out)}")


if __name__ == "__main__":
    main()
