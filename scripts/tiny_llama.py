"""A tiny Llama with random weights, in Hugging Face layout, made without any model hub.

Run by ``scripts/llama_server.py`` with the tools venv's Python (torch, transformers,
sentencepiece), then converted to GGUF. The tokenizer is a SentencePiece BPE trained
here on generated text, with byte fallback (llama.cpp needs it: any UTF-8 prompt must
tokenize) and ChatML's ``<|im_start|>``/``<|im_end|>`` as single tokens; the chat
template is ChatML. The model answers gibberish, usually up to ``max_tokens``.

    tools/bin/python scripts/tiny_llama.py OUT_DIR
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TEXT = (
    "the a of to and in is it that for on with as was by at be this from or an are not"
    " question answer lease queue server prompt model token river stone cloud field light"
    " shadow signal alpha beta gamma delta number value write read time data turn run"
)
WORDS = _TEXT.split()
VOCAB = 1024
SEED = 1234


def corpus(path: Path, lines: int = 4000) -> None:
    """Sentences of common words, numbers and punctuation: enough for merges that make
    ordinary English prompts a few tokens a word."""
    rng = random.Random(SEED)
    with open(path, "w", encoding="utf-8") as fh:
        for _ in range(lines):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
            if rng.random() < 0.3:
                words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
            sentence = " ".join(words)
            fh.write(sentence[0].upper() + sentence[1:] + rng.choice(".?!:,") + "\n")


def tokenizer(out: Path) -> int:
    import sentencepiece as spm

    text = out / "corpus.txt"
    corpus(text)
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(out / "tokenizer"),
        model_type="bpe",
        vocab_size=VOCAB,
        byte_fallback=True,
        character_coverage=1.0,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=2,
        minloglevel=2,
    )
    text.unlink()
    processor = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    end = processor.piece_to_id("<|im_end|>")
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 32768,
        "chat_template": CHATML,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    special = {"bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return end


def model(out: Path, eos: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        bos_token_id=1,
        eos_token_id=eos,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    model(out, tokenizer(out))
    print(f"tiny llama written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
