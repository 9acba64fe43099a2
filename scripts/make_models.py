"""Build the local random-weight models the tests, demo and benches use.

No hub downloads: a BPE tokenizer is trained here on a deterministic synthetic
corpus, and Llama models are initialised from a fixed seed. ``initializer_range``
0.3 (not the default 0.02) gives varied greedy tokens and logprobs, so a wrong
KV byte changes the output.

    python scripts/make_models.py OUT_DIR      # builds OUT_DIR/tiny, OUT_DIR/realistic

Each model folder holds a ``sessionkv-model.json`` stamp; a folder whose stamp
matches the recipe below is left alone.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

RECIPES = {
    # Correctness only: fast to start and to run.
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    ),
    # Anything timed: prefill cost dominates load cost, as with real models.
    "realistic": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=12,
    ),
}
VOCAB_SIZE = 4096
MAX_POSITIONS = 8192
SEED = 0
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus(n_lines: int = 20000) -> list[str]:
    """Deterministic pseudo-text: syllable words, some code-like lines."""
    rng = random.Random(SEED)
    syll = [
        "ka",
        "lo",
        "mi",
        "ne",
        "tu",
        "ra",
        "si",
        "po",
        "de",
        "vu",
        "an",
        "or",
        "el",
        "is",
        "um",
        "ch",
        "th",
        "qu",
        "st",
        "pr",
    ]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    words += [
        "def",
        "return",
        "(",
        ")",
        ":",
        "=",
        "{",
        "}",
        "tool",
        "call",
        "user",
        "assistant",
        "system",
        "0",
        "1",
        "2",
        "3",
        "4",
        "5",
        "6",
        "7",
        "8",
        "9",
    ]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(n_lines)]


def build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def build_model(name: str, out: Path) -> None:
    stamp = out / "sessionkv-model.json"
    recipe = {
        "recipe": RECIPES[name],
        "vocab": VOCAB_SIZE,
        "seed": SEED,
        "max_positions": MAX_POSITIONS,
        "template": CHAT_TEMPLATE,
    }
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=0.3,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **RECIPES[name],
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(recipe))
    print(f"built {name} model in {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_models.py OUT_DIR")
    root = Path(sys.argv[1])
    for model_name in RECIPES:
        build_model(model_name, root / model_name)
