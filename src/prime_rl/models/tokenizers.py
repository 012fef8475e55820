"""Loading a tokenizer in a process that never runs a model (the orchestrator, its rollout workers, eval).

`AutoTokenizer` lives beside transformers' auto model classes, and importing it brings their modeling stack
(torch._dynamo, sympy, DTensor): ~120 MiB of memory in a process that only renders and parses text. A model saved by
transformers 5 (every model built here, and every checkpoint the trainer writes from one) names its tokenizer
`TokenizersBackend` in `tokenizer_config.json`, which is the generic class built from `tokenizer.json` that
`AutoTokenizer` itself resolves that name to: such a directory is loaded by that class directly. Anything else (a hub
id, a model-specific class, remote code) goes through `AutoTokenizer` as before.
"""

from __future__ import annotations

import json
from pathlib import Path

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""The `tokenizer_class` names of transformers' generic tokenizer from `tokenizer.json` (5.x and 4.x names)."""


def load_tokenizer(name: str, fallback=None, **kwargs):
    """The tokenizer `AutoTokenizer.from_pretrained(name, **kwargs)` gives, without its imports where it can;
    `fallback(name, **kwargs)` loads the others (default: `AutoTokenizer.from_pretrained`)."""
    if is_generic_tokenizer_dir(name):
        from transformers import PreTrainedTokenizerFast

        kwargs.pop("trust_remote_code", None)  # a local generic tokenizer runs no code
        return PreTrainedTokenizerFast.from_pretrained(name, **kwargs)
    if fallback is None:
        from transformers import AutoTokenizer

        fallback = AutoTokenizer.from_pretrained
    return fallback(name, **kwargs)


def is_generic_tokenizer_dir(name: str) -> bool:
    """A local directory with a `tokenizer.json` whose `tokenizer_config.json` names the generic class and no remote
    code."""
    directory = Path(name)
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(config, dict)
        and config.get("tokenizer_class") in GENERIC_CLASSES
        and "auto_map" not in config
        and (directory / "tokenizer.json").is_file()
    )
