"""Build a tiny, randomly initialised Hugging Face causal LM directory on local disk.

Tests and demos of prime-rl need a real model directory that vLLM can serve and the FSDP2
trainer can load, but no model hub is reachable at run time. This module produces one from
nothing: a byte-level BPE tokenizer trained on a procedurally generated corpus, the family's
special tokens and chat template (matching the Qwen3 / Llama-3 wire formats),
a `Qwen3Config` or `LlamaConfig`, a `generation_config.json` and seeded random weights in
`model.safetensors`. The same config always yields byte-identical files. The tokenizer and its
templates are built in `tiny_tokenizer`; the model config, weights and CLI here.

`perturb_weights` copies such a directory and adds seeded noise to its weights, which gives
tests a "new policy" checkpoint with the same tensor names, shapes and dtypes.
"""

import shutil
from pathlib import Path
from typing import Literal

from pydantic import Field

from prime_rl.config import BaseConfig
from prime_rl.models.tiny_tokenizer import DEFAULT_ALPHABET, build_tokenizer
from prime_rl.utils.fs import atomic_dir


class TinyModelConfig(BaseConfig):
    """A tiny random-init causal LM to build locally (tokenizer, chat template, config, weights)."""

    output: Path
    """Directory to write the model into; replaced as a whole if it already exists."""

    family: Literal["qwen3", "llama"] = "qwen3"
    """Architecture, special tokens and chat template to imitate: Qwen3 (ChatML) or Llama-3."""

    alphabet: str = DEFAULT_ALPHABET
    """Characters the training corpus is drawn from; byte-level BPE still encodes any other text."""

    hidden_size: int = 128
    """Width of the residual stream."""

    num_layers: int = 2
    """Number of decoder layers."""

    num_heads: int = 2
    """Number of query attention heads."""

    num_kv_heads: int = 1
    """Number of key/value heads (grouped-query attention); must divide `num_heads`."""

    head_dim: int = 64
    """Per-head dimension; vLLM's CPU attention backend rejects 16, 64 works."""

    intermediate_size: int = 256
    """Hidden width of the SwiGLU MLP."""

    vocab_size: int = 512
    """Target vocabulary size including the special tokens (the BPE may stop short on a tiny corpus)."""

    pad_vocab_to: int | None = Field(None, ge=1)
    """Embedding (and LM-head) rows to allocate beyond the tokenizer's, as real models pad theirs (Qwen3: 151,669
    tokens in 151,936 rows), so a model of a real one's shape costs what it costs in memory and FLOPs."""

    max_position_embeddings: int = 4096
    """Longest sequence the model config (and the tokenizer's `model_max_length`) allows."""

    tie_word_embeddings: bool = True
    """Share the input embedding with the LM head (then no `lm_head.weight` is stored)."""

    seed: int = 0
    """Seed of the tokenizer corpus and of the weight initialisation."""

    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the stored weights and of the config's `dtype`."""


def _build_model_config(config: TinyModelConfig, tokenizer):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=max(len(tokenizer), config.pad_vocab_to or 0),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype=config.dtype,
    )
    if config.family == "qwen3":
        return Qwen3Config(**common)
    return LlamaConfig(**common)


def _build_generation_config(config: TinyModelConfig, tokenizer):
    """Stop tokens only: no temperature/top_p/top_k, so servers use each request's sampling."""
    from transformers import GenerationConfig

    if config.family == "qwen3":
        stops = ["<|im_end|>", "<|endoftext|>"]
    else:
        stops = ["<|eot_id|>", "<|end_of_text|>"]
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in stops],
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_model(config: TinyModelConfig) -> Path:
    """Write tokenizer, chat template, config, generation config and random weights to `config.output`.

    Everything is written into a temporary sibling directory that is renamed into place at the
    end, so a crash never leaves a half-written model directory. Returns `config.output`.
    """
    import torch
    from transformers import AutoModelForCausalLM

    output = Path(config.output)
    with atomic_dir(output) as tmp:
        tokenizer = build_tokenizer(
            family=config.family,
            vocab_size=config.vocab_size,
            alphabet=config.alphabet,
            seed=config.seed,
            max_length=config.max_position_embeddings,
        )
        tokenizer.save_pretrained(tmp)

        model_config = _build_model_config(config, tokenizer)
        torch.manual_seed(config.seed)
        # Initialise in float32 (same numbers whatever the target dtype), then cast.
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
        model = model.to(getattr(torch, config.dtype))
        model.generation_config = _build_generation_config(config, tokenizer)
        model.save_pretrained(tmp, safe_serialization=True)
    return output


def perturb_weights(src: Path, dst: Path, scale: float = 0.5, seed: int = 1) -> Path:
    """Copy the model directory `src` to `dst`, adding seeded Gaussian noise to every float tensor.

    The noise of a tensor has standard deviation `scale * tensor.std()` (`scale * 0.02` when the
    tensor is constant, e.g. norm weights). Names, shapes, dtypes and all non-weight files are kept.
    `dst` is replaced as a whole if it exists. Returns `dst`.
    """
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    with atomic_dir(dst) as work:
        shutil.copytree(src, work, dirs_exist_ok=True)
        generator = torch.Generator().manual_seed(seed)
        for file in sorted(work.glob("*.safetensors")):
            tensors = load_file(str(file))
            for name in sorted(tensors):
                tensor = tensors[name]
                if not tensor.is_floating_point():
                    continue
                values = tensor.float()
                std = values.std().item() if values.numel() > 1 else 0.0
                noise = torch.randn(values.shape, generator=generator) * (scale * (std if std > 0 else 0.02))
                tensors[name] = (values + noise).to(tensor.dtype).contiguous()
            save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


__all__ = ["TinyModelConfig", "build_tiny_model", "perturb_weights"]


def main(argv: list[str] | None = None) -> None:
    """`uv run tiny-model --output DIR [--family llama] [--no-tie-word-embeddings] [--hidden-size 256] ...`"""
    from prime_rl.config.loader import load_config

    config, _ = load_config(TinyModelConfig, "tiny-model", argv)
    path = build_tiny_model(config)
    print(f"wrote {config.family} model ({'tied' if config.tie_word_embeddings else 'untied'} embeddings) to {path}")
