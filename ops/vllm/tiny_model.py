"""Build a tiny random Llama model and a locally trained tokenizer that vLLM can load.

Nothing is downloaded: the weights are random (fixed seed) and the 512-token byte-level BPE is
trained here on generated text. The shapes are the smallest that vLLM's CPU backend accepts:
head_dim 64 (its attention rejects 16), one KV head, two layers.

Run with the vLLM environment's python (transformers, tokenizers and torch come with vLLM):

    .venv-vllm/bin/python ops/vllm/tiny_model.py /tmp/tiny-llama

The same seed gives byte-identical tokenizer files and identical weights, so a fixture recorded
against one build matches another.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 512
BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, UNK, PAD]  # ids 0..3 in this order

# The words the generated corpus draws from: a KV-cache flavoured vocabulary so that prompts
# written with these words tokenize into few, stable tokens.
WORDS = (
    "the a of and to in is that for on with as by at from block cache key value page layer "
    "head token prefix hash store load evict pin lease engine worker ledger event sequence "
    "request prompt model attention batch tensor memory tier host device offload reload "
    "namespace generation parent child chain commit abort audit replay snapshot projector "
    "system user assistant question answer story river mountain city night morning light "
    "one two three four five six seven eight nine ten red green blue quick lazy fox dog"
).split()

# The prompts probe.py and prove.py send: a shared prefix of ~140 tokens (several 32-token
# blocks) written with WORDS, so it tokenizes compactly and deterministically, then distinct tails.
PROMPT_PREFIX = (
    "The system keeps every block of the cache in a ledger. The engine stores a key and a value "
    "for each token of the prompt, and the worker moves each page from the device to the host "
    "tier when the memory is low. The ledger records the hash of the parent block, the "
    "namespace and the generation of each block, so that an audit can replay the sequence of "
    "events. One request can pin a block with a lease, and the projector takes a snapshot of "
    "the chain after each commit. "
)
PROMPT_TAILS = [
    "Question: which block was evicted first?",
    "Question: which worker stored the red block?",
    "The quick red fox and the lazy dog asked the model one question about the river.",
    "Seven blue mountains stand by the city at night.",
]


def corpus(rng: random.Random, lines: int = 4000) -> list[str]:
    """Sentences of random words with punctuation and digits, enough for 508 merges."""
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 999)))
        sentence = " ".join(words)
        out.append(sentence[0].upper() + sentence[1:] + rng.choice(".?!,;:"))
    return out


def build_tokenizer(directory: Path, rng: random.Random) -> None:
    """Train a byte-level BPE and save it as a PreTrainedTokenizerFast (tokenizer.json + config)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(rng), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    # vLLM (like HF) adds BOS through the post-processor when add_special_tokens=True.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        model_max_length=2048,
    )
    fast.save_pretrained(directory)


SLIDING_WINDOW = 64
"""Tokens a hybrid model's sliding-window layer attends to (two blocks of 32)."""


def build_model(directory: Path, hybrid: bool = False, kv_heads: int = 1) -> None:
    """A random LlamaForCausalLM with the smallest shapes vLLM's CPU backend takes. Hybrid: its
    first layer sliding-window attention (SLIDING_WINDOW tokens), its second full attention, so
    that vLLM makes two KV-cache groups (vLLM's llama reads `layer_types`). `kv_heads` 2 gives
    each of two tensor-parallel ranks a KV head of its own (one head is replicated on both)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
        head_dim=64,
        max_position_embeddings=2048,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        tie_word_embeddings=False,
        # Wider than the default 0.02 so that the logits are peaked: greedy choices then do not
        # hinge on near-ties, which float reordering between a cached and an uncached run could
        # flip.
        initializer_range=0.2,
        torch_dtype="float32",
    )
    if hybrid:
        config.layer_types = ["sliding_attention", "full_attention"]
        config.sliding_window = SLIDING_WINDOW
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(directory, safe_serialization=True)


def build(directory: Path, hybrid: bool = False, kv_heads: int = 1) -> Path:
    """Write the tokenizer and the model into ``directory`` (created if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory, random.Random(SEED))
    build_model(directory, hybrid, kv_heads)
    (directory / "kvledger_tiny_model.json").write_text(
        json.dumps(
            {"seed": SEED, "vocab_size": VOCAB_SIZE, "hybrid": hybrid, "kv_heads": kv_heads, "builder": "ops/vllm/tiny_model.py"}
        )
    )
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where to write the model (created)")
    parser.add_argument("--hybrid", action="store_true", help="a sliding-window layer and a full-attention one")
    args = parser.parse_args()
    print(f"tiny model written to {build(args.directory, args.hybrid)}")


if __name__ == "__main__":
    main()
