"""What the token-exactness tests (test_orchestrator, test_smollm2) share: a record of every generation call the
train client makes, and the sampled spans of a sample."""

import json


def spy_generations(monkeypatch) -> list[tuple[list[int], dict]]:
    """From now on (until the test ends), every call of renderers' `generate` (verifiers' train client makes one per
    model turn) appends (the prompt ids sent, the raw response vLLM returned) to the returned list."""
    import renderers.client as rc

    calls: list[tuple[list[int], dict]] = []
    parsed: list[dict] = []
    parse, generate = rc.parse_generate_response, rc.generate

    def spy_parse(raw):
        parsed.append(json.loads(raw))
        return parse(raw)

    async def spy_generate(*args, **kwargs):
        result = await generate(*args, **kwargs)
        calls.append((list(result["prompt_ids"]), parsed[-1]))  # no await between parse and return
        return result

    monkeypatch.setattr(rc, "parse_generate_response", spy_parse)
    monkeypatch.setattr(rc, "generate", spy_generate)
    return calls


def responses_by_prompt(calls: list[tuple[list[int], dict]]) -> dict[tuple[int, ...], list[tuple[list, list]]]:
    """The recorded responses (token ids, logprobs) to each prompt (a group's rollouts share their first prompt)."""
    by_prompt: dict[tuple[int, ...], list[tuple[list, list]]] = {}
    for prompt_ids, response in calls:
        choice = response["choices"][0]
        tokens = (choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]])
        by_prompt.setdefault(tuple(prompt_ids), []).append(tokens)
    return by_prompt


def masked_runs(mask: list[bool]) -> list[tuple[int, int]]:
    """The [start, end) runs of True in a loss mask: one per sampled model turn."""
    runs, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs
