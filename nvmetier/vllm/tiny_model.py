"""``python -m nvmetier.vllm.tiny_model OUT_DIR [--size tiny|bench|hybrid]``: a local test model.

Makes a random-weight Llama, or for ``hybrid`` a Gemma 3 (``transformers``),
and a byte-level BPE tokenizer trained offline (``tokenizers``) on a
generated corpus, in a folder ``vllm serve`` loads like any Hugging Face
model. Nothing is downloaded. The same ``--size`` and ``--seed`` give the
same files, byte for byte, on any machine with the same library versions.

Sizes:
    tiny: 2 layers, hidden 64, head size 32 (the smallest vLLM's CPU
        attention takes; ~0.1 M parameters): the serve test suite's model,
        loads and serves in seconds on 2 cores.
    bench: 12 layers, hidden 768 (~120 M parameters): prefill of a few
        thousand tokens costs seconds on a CPU, for the TTFT benchmark.
    hybrid: a Gemma 3 text model (``Gemma3ForCausalLM``) whose layers
        alternate a 64-token sliding window and full attention (as Gemma 2
        and gpt-oss do; Gemma 3 itself has 5 window layers per full one), 4
        layers, hidden 1024, 2 KV heads of size 64 (~61 M parameters):
        vLLM's hybrid KV cache manager gives it one sliding-window and one
        full-attention KV cache group. Prefilling 1000 tokens costs ~1 s on
        2 cores, ten times loading their KV (16 KiB per token): the serve
        suite's hybrid model.

Weights are float32 and drawn with a wider initializer than Llama's (0.2,
not 0.02), so greedy decoding sees clear margins between the top logits: a
near-tie could flip on the rounding differences between a full prefill and a
prefill that reuses cached KV, which would say nothing about the cache. The
serve suite still compares cache-served tokens with vLLM's own prefix-cache
pass (the docstring of tests/serve/test_serve.py).

Runs in the calling process; blocks while it writes (well under a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from typing import Any

SIZES = ("tiny", "bench", "hybrid")


@dataclass(frozen=True)
class ModelSize:
    """Shape of one model size."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    # Attention of each layer, "sliding_attention" or "full_attention"
    # (Hugging Face's layer_types); empty: a Llama, every layer full.
    layer_types: tuple[str, ...] = ()
    # Tokens a sliding-window layer attends to (layer_types only).
    sliding_window: int = 0
    head_dim: int = 0  # 0: hidden / heads


MODEL_SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(
        hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vocab=512, max_positions=4096
    ),
    "bench": ModelSize(
        hidden=768,
        layers=12,
        heads=12,
        kv_heads=4,
        intermediate=2048,
        vocab=8192,
        max_positions=8192,
    ),
    "hybrid": ModelSize(
        hidden=1024,
        layers=4,
        heads=16,
        kv_heads=2,
        intermediate=4096,
        vocab=512,
        max_positions=4096,
        layer_types=("sliding_attention", "full_attention") * 2,
        sliding_window=64,
        head_dim=64,
    ),
}

# Words of the generated corpus (and of the test prompts): pronounceable
# syllable strings, so BPE learns merges as it would on text.
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def corpus_words(seed: int, n_words: int) -> list[str]:
    """``n_words`` words drawn from a seeded vocabulary of ~2000 words."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(2000)]
    return [rng.choice(vocab) for _ in range(n_words)]


def prompt_text(seed: int, n_words: int) -> str:
    """A prompt of ``n_words`` corpus words, different for every ``seed``."""
    return " ".join(corpus_words(10_000 + seed, n_words))


def make_tokenizer(out_dir: str, vocab_size: int, seed: int) -> None:
    """Train a byte-level BPE tokenizer on a generated corpus; save it as a
    ``PreTrainedTokenizerFast`` in ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = corpus_words(seed, 200_000)
    lines = [" ".join(words[i : i + 50]) for i in range(0, len(words), 50)]
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", model_max_length=1 << 20
    )
    fast.save_pretrained(out_dir)


def make_model(out_dir: str, size: str = "tiny", seed: int = 0) -> str:
    """Write the model and tokenizer of ``size`` to ``out_dir``; returns ``out_dir``.

    Raises:
        ValueError: ``size`` is not one of ``SIZES``.
    """
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}: use one of {', '.join(SIZES)}")
    import torch

    shape = MODEL_SIZES[size]
    os.makedirs(out_dir, exist_ok=True)
    make_tokenizer(out_dir, shape.vocab, seed)
    torch.manual_seed(seed)
    model = _hybrid_model(shape) if shape.layer_types else _llama_model(shape)
    model.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "nvmetier-model.json"), "w", encoding="utf-8") as f:
        json.dump({"size": size, "seed": seed, "parameters": model.num_parameters()}, f)
    return out_dir


def _llama_model(shape: ModelSize) -> Any:
    """A random-weight ``LlamaForCausalLM`` of ``shape`` (every layer full attention)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        dtype="float32",
    )
    return LlamaForCausalLM(config).to(torch.float32)


def _hybrid_model(shape: ModelSize) -> Any:
    """A random-weight ``Gemma3ForCausalLM`` of ``shape``: sliding-window and
    full-attention layers as ``shape.layer_types`` says (vLLM reads the same
    ``layer_types`` and ``sliding_window`` from config.json)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    head_dim = shape.head_dim or shape.hidden // shape.heads
    config = Gemma3TextConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        layer_types=list(shape.layer_types),
        sliding_window=shape.sliding_window,
        max_position_embeddings=shape.max_positions,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.architectures = ["Gemma3ForCausalLM"]
    return Gemma3ForCausalLM(config).to(torch.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nvmetier.vllm.tiny_model",
        description="Make a random-weight model and its BPE tokenizer (no download).",
    )
    parser.add_argument("out_dir", help="folder to write (created)")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_model(args.out_dir, args.size, args.seed)
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
