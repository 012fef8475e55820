"""Server-side pieces that need no engine: weight-dir checks, the generate-route rewrite, vLLM args."""

import json
import logging
import os
import warnings

import pytest
import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.testclient import TestClient
from safetensors.torch import save_file

from prime_rl.inference.config import InferenceConfig
from prime_rl.inference.plugin import GENERATE_PATH, GenerateLogprobTokens, rewrite_sse
from prime_rl.inference.weights import WeightDirError, check_weight_dir, safetensors_shapes

EXPECTED = {"embed.weight": (10, 4), "norm.weight": (4,)}


def make_dir(path, tensors):
    path.mkdir(parents=True)
    save_file({k: torch.zeros(v) for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def status_of(weight_dir, roots) -> int:
    with pytest.raises(WeightDirError) as e:
        check_weight_dir(str(weight_dir), roots, EXPECTED)
    assert e.value.message
    return e.value.status


def test_weight_dir_checks(tmp_path):
    root = tmp_path / "run"
    good = make_dir(root / "good", EXPECTED)
    assert check_weight_dir(str(good), [root], EXPECTED) == good.resolve()
    assert safetensors_shapes(good) == EXPECTED
    outside = make_dir(tmp_path / "outside", EXPECTED)
    assert status_of(outside, [root]) == 403
    assert status_of(root / "good" / ".." / ".." / "outside", [root]) == 403  # no escaping via ..
    (root / "link").symlink_to(outside)
    assert status_of(root / "link", [root]) == 403  # nor via a symlink
    assert status_of(root / "missing", [root]) == 404
    assert status_of(good / "model.safetensors", [root]) == 400
    assert status_of("relative/dir", [root]) == 400
    assert status_of(make_dir(root / "shape", {**EXPECTED, "norm.weight": (5,)}), [root]) == 422
    assert status_of(make_dir(root / "extra", {**EXPECTED, "other": (1,)}), [root]) == 422
    assert status_of(make_dir(root / "fewer", {"embed.weight": (10, 4)}), [root]) == 422
    (root / "empty").mkdir()
    assert status_of(root / "empty", [root]) == 422
    (root / "corrupt").mkdir()
    (root / "corrupt" / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    assert status_of(root / "corrupt", [root]) == 422


GENERATE_BODY = {
    "choices": [
        {
            "token_ids": [7, 9],
            "weight_versions": [{"version": "base", "start": 0, "end": 2}],
            "logprobs": {
                "content": [
                    {"token_id": 7, "logprob": -0.5, "top_logprobs": [{"token_id": 7, "logprob": -0.5}]},
                    {"token_id": 9, "logprob": -1.5, "top_logprobs": []},
                ]
            },
        }
    ]
}


def expected_entries():
    return [
        {"token_id": 7, "logprob": -0.5, "token": "token_id:7", "top_logprobs": [
            {"token_id": 7, "logprob": -0.5, "token": "token_id:7"}]},
        {"token_id": 9, "logprob": -1.5, "token": "token_id:9", "top_logprobs": []},
    ]  # fmt: skip


def app_with(response_factory) -> TestClient:
    app = FastAPI()
    app.add_api_route(GENERATE_PATH, response_factory, methods=["POST"])
    app.add_api_route("/other", response_factory, methods=["POST"])
    app.add_middleware(GenerateLogprobTokens)
    return TestClient(app)


def test_generate_json_response_gets_token_strings():
    client = app_with(lambda: JSONResponse(GENERATE_BODY))
    data = client.post(GENERATE_PATH).json()
    assert data["choices"][0]["logprobs"]["content"] == expected_entries()
    assert data["choices"][0]["weight_versions"] == GENERATE_BODY["choices"][0]["weight_versions"]
    assert client.post("/other").json() == GENERATE_BODY  # other routes untouched


def test_generate_sse_response_gets_token_strings_across_chunk_boundaries():
    event = b"data: " + json.dumps(GENERATE_BODY).encode() + b"\n\n"
    stream = event + event + b"data: [DONE]\n\n"
    chunks = [stream[i : i + 17] for i in range(0, len(stream), 17)]  # events split mid-JSON

    def respond():
        return StreamingResponse(iter(chunks), media_type="text/event-stream")

    text = app_with(respond).post(GENERATE_PATH).text
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 3
    for e in events[:2]:
        assert json.loads(e[6:])["choices"][0]["logprobs"]["content"] == expected_entries()


def test_rewrite_sse_keeps_incomplete_tail():
    done, rest = rewrite_sse(b'data: {"choices": []}\n\ndata: {"cho')
    assert done == b'data: {"choices": []}\n\n' and rest == b'data: {"cho'


def test_vllm_args_carry_our_fields_and_the_rl_essentials(tmp_path):
    cfg = InferenceConfig(
        model={"name": "m", "max_model_len": 256, "enforce_eager": True},
        server={"port": 1234, "api_key": "k"},
        parallel={"tp": 2},
        lora={},
        output_dir=tmp_path,
    )
    args = cfg.vllm_args()
    pairs = dict(zip(args, args[1:], strict=False))
    assert pairs["--model"] == "m" and pairs["--served-model-name"] == "m" and pairs["--port"] == "1234"
    assert pairs["--max-model-len"] == "256" and pairs["--tensor-parallel-size"] == "2" and pairs["--api-key"] == "k"
    assert pairs["--logprobs-mode"] == "processed_logprobs" and "--enable-scale-out" in args
    assert pairs["--worker-extension-cls"] == "prime_rl.inference.worker.WeightSwapExtension"
    assert "--enforce-eager" in args and "--enable-lora" in args and pairs["--max-lora-rank"] == "16"
    assert cfg.weight_roots == [tmp_path]


def test_logging_writes_each_library_line_once(tmp_path, capfd):
    from loguru import logger

    from prime_rl.utils.logging import setup_logging

    lib = logging.getLogger("vllm.fake")
    logging.getLogger("vllm").addHandler(logging.StreamHandler())  # what vLLM does at import
    log_file = setup_logging("unit", "info", tmp_path / "logs")
    lib.warning("library says hi")
    logger.info("we say hi")
    warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)
    logger.debug("not shown at info")
    text = log_file.read_text()
    assert text.count("library says hi") == 1 and text.count("we say hi") == 1
    assert "deprecated thing" in text and "not shown at info" not in text
    assert capfd.readouterr().err.count("library says hi") == 1
    assert log_file == tmp_path / "logs" / "unit.log" and os.path.getsize(log_file) > 0
