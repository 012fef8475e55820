"""Renderers for the tiny models: Qwen3's, with the tool list stated in one line.

Qwen3's tools block is a ~290-token preamble plus each tool's JSON schema (~570 tokens for one tool with one
argument, with the tiny byte-level tokenizer): most of a tool-using conversation, and more context than a 2-layer
model learns to look across. `CompactToolsQwen3Renderer` appends one line to the system message instead
(`Tools: lookup(key)`) and is Qwen3's renderer in every other respect: the same ChatML, tool calls as JSON in
`<tool_call>` tokens (parsed by Qwen3's parser), tool results as `<tool_response>` user turns, the same bridging
between turns. A model trained with it must be trained and sampled with it: SFT renders through it with
`[data] renderer = ...`, RL and eval with `model.renderer = ...`, both

    {name = "custom", import_path = "prime_rl.models.renderers.CompactToolsQwen3Renderer", enable_thinking = false}

The chat template of such a model still states tools the long way; tasks need a system prompt (the line joins it,
so message indices are unchanged).
"""

from renderers.configs import Qwen3RendererConfig
from renderers.qwen3 import Qwen3Renderer


def tools_line(tools: list[dict]) -> str:
    """`Tools: name(arg, ...), ...` from OpenAI function specs (or bare function dicts)."""
    names = []
    for tool in tools:
        function = tool.get("function") or tool
        params = ", ".join((function.get("parameters") or {}).get("properties") or {})
        names.append(f"{function['name']}({params})")
    return "Tools: " + ", ".join(names)


class CompactToolsQwen3Renderer(Qwen3Renderer):
    config_class = Qwen3RendererConfig

    def render(self, messages, *, tools=None, add_generation_prompt=False):
        if tools:
            if not messages or messages[0].get("role") != "system":
                raise ValueError("CompactToolsQwen3Renderer needs a system message to state the tools in")
            system = dict(messages[0])
            system["content"] = f"{self._content_text(system.get('content'))}\n{tools_line(tools)}"
            messages = [system, *messages[1:]]
        return super().render(messages, tools=None, add_generation_prompt=add_generation_prompt)

    def bridge_to_next_turn(self, previous_prompt_ids, previous_completion_ids, new_messages, *, tools=None):
        # Only the new messages are rendered: the tools line is already in the previous prompt.
        return super().bridge_to_next_turn(previous_prompt_ids, previous_completion_ids, new_messages, tools=None)
