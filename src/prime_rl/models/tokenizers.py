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


def tokenizer_mismatch(policy: str, other: str) -> str | None:
    """Why two local model directories do not share a tokenizer (their `tokenizer.json` differ: other token ids for
    the same text), or None. Hub ids and directories without that file are not judged here: a teacher's tokenizer is
    also checked on its server when the orchestrator starts (`orchestrator/teacher.py`)."""
    files = [Path(name).expanduser() / "tokenizer.json" for name in (policy, other)]
    if not all(f.is_file() for f in files):
        return None
    if files[0].read_bytes() == files[1].read_bytes():
        return None
    return f"the tokenizer of {other} ({files[1]}) differs from the policy's ({files[0]})"
