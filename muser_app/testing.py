"""Tiny random-initialised checkpoints with a real tokenizer, built locally for tests.

Nothing comes from a model hub: a byte-level BPE is trained with `tokenizers` on a small
built-in text, and a Hugging Face causal LM of the requested architecture is initialised
from a seed and saved with `save_pretrained`. Weights are drawn with unit-scale variance
(not the library's 0.02) so logits spread over several nats and comparisons between
backends actually discriminate; biases and norm gains are randomised too, so a loader
that drops them is caught.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Literal

SPECIAL_TOKEN = "<|endoftext|>"
Arch = Literal["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "olmo2"]
ARCHES: tuple[Arch, ...] = ("llama", "qwen2", "qwen3", "mistral")
"""The Llama family: the torch backend's own forwards (lean, packed) take them."""
OTHER_ARCHES: tuple[Arch, ...] = ("gemma2", "gemma3", "phi3", "olmo2")
"""Other causal LMs transformers and mlx-lm both run: the torch backend runs them on
transformers' forward."""

_TEXT = """\
The river rises in the hills above the town and runs for forty miles before it reaches the
sea. In the spring the water is high and brown, and the fishermen wait on the bank for the
flood to pass. In the summer it is low and clear, and children wade across it at the ford
below the old mill. Nobody remembers who built the mill; the stones are older than the
church, and the wheel has not turned in a hundred years.

def read_config(path):
    with open(path) as f:
        return json.load(f)

for index, value in enumerate(values):
    if value is None:
        continue
    total += value * weights[index]

The committee met on Tuesday to consider the proposal. After a long discussion the members
agreed that the bridge should be repaired before the winter, that the cost should be shared
between the two parishes, and that the work should begin as soon as the weather allowed.
The secretary was asked to write to the county engineer and to report at the next meeting.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048 4096.
Punctuation: (a, b) [c; d] {e: f} "g" 'h' - i + j = k * l / m % n < o > p & q | r ^ s ~ t!
"""


def _train_tokenizer(vocab_size: int):
    """A byte-level BPE trained on `_TEXT`: deterministic, real merges, ≤ vocab_size ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TEXT.splitlines(keepends=True), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL_TOKEN, eos_token=SPECIAL_TOKEN
    )


def _config(arch: Arch, **common):
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Olmo2Config,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    heads = common.pop("num_attention_heads")
    head_dim = common["hidden_size"] // heads
    sliding_window = common.pop("sliding_window")
    kwargs = dict(common, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2))
    kwargs["head_dim"] = head_dim
    if arch == "llama":
        return LlamaConfig(**kwargs)
    if arch == "mistral":
        return MistralConfig(sliding_window=sliding_window, **kwargs)
    if arch == "qwen2":
        return Qwen2Config(**kwargs)
    if arch == "qwen3":
        return Qwen3Config(**kwargs)
    kwargs["pad_token_id"] = kwargs["eos_token_id"]  # (their defaults lie past a tiny vocab)
    if arch in ("gemma2", "gemma3"):  # Gemma ties its head to the embedding, as mlx-lm reads it
        kwargs["tie_word_embeddings"] = True
        return (Gemma2Config if arch == "gemma2" else Gemma3TextConfig)(**kwargs)
    if arch == "phi3":
        kwargs.pop("head_dim")
        return Phi3Config(**kwargs)
    if arch == "olmo2":
        kwargs.pop("head_dim")
        return Olmo2Config(**kwargs)
    raise ValueError(f"arch {arch!r} is not one of {ARCHES + OTHER_ARCHES}")


def _randomise(model, seed: int) -> None:
    """Unit-scale weights: N(0, 1/fan_in) matrices, N(0,1) embeddings, gains near 1."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                value = 1.0 + 0.1 * noise
            elif name.endswith("bias"):
                value = 0.1 * noise
            elif "embed" in name:
                value = noise
            else:
                value = noise / math.sqrt(param.shape[-1])
            param.copy_(value.to(param.dtype))


def make_tiny_checkpoint(
    out_dir: str | os.PathLike[str],
    *,
    arch: Arch = "llama",
    vocab_size: int = 320,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
    max_position_embeddings: int = 256,
    rope_theta: float = 10000.0,
    sliding_window: int | None = None,
    tokenizer_size: int | None = None,
) -> Path:
    """Write a tiny random `arch` checkpoint (config, safetensors, tokenizer) to `out_dir`.

    `sliding_window` only applies to mistral. The tokenizer is trained to `tokenizer_size`
    ids (default: `vocab_size`); a larger `vocab_size` pads the embedding past it, as many
    released models do. The same `tokenizer_size` always yields byte-identical tokenizer
    files, so two seeds make a draft/target pair that shares one.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if arch not in ARCHES + OTHER_ARCHES:
        raise ValueError(f"arch {arch!r} is not one of {ARCHES + OTHER_ARCHES}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(tokenizer_size or vocab_size)
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens; vocab_size {vocab_size} too small"
        )
    eos = tokenizer.convert_tokens_to_ids(SPECIAL_TOKEN)
    config = _config(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        sliding_window=sliding_window,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _patch_json(out / "config.json", rope_theta=rope_theta)
    # Loadable by transformers 4 as well as 5 (5 maps this name to its tokenizers backend).
    _patch_json(out / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast")
    return out


def _patch_json(path: Path, **values: object) -> None:
    """mlx-lm reads `rope_theta` at the top level; transformers 5 writes it nested only."""
    data = json.loads(path.read_text())
    data.update(values)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def resave_tokenizer(path: str | os.PathLike[str]) -> None:
    """Rewrite a checkpoint's tokenizer.json with the same content in other bytes (another
    indentation and key order), as a conversion or a `save_pretrained` elsewhere does."""
    file = Path(path) / "tokenizer.json"
    data = json.loads(file.read_text())
    file.write_text(json.dumps(data, indent=1, sort_keys=True, ensure_ascii=True))


def swap_tokens(path: str | os.PathLike[str], a: int, b: int) -> tuple[str, str]:
    """Make a checkpoint's tokenizer conflict with its own former self: ids `a` and `b`
    trade token strings. Returns the strings now at (a, b)."""
    file = Path(path) / "tokenizer.json"
    data = json.loads(file.read_text())
    vocab = data["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[a]], vocab[by_id[b]] = b, a
    file.write_text(json.dumps(data))
    return by_id[b], by_id[a]
