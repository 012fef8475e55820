"""Qwen3's renderer with the tool list cut to one line, for tool tests on the shared test server.

The shared server's context is 512 tokens. Qwen3's own tools block (a ~290-token preamble plus each tool's JSON
schema, ~120 tokens for a tool without arguments, with the tiny tokenizer) leaves no room for a tool call and its
result. This renderer states the tools as one line appended to the system message (`Tools: t_bump(), t_add(a, b)`)
and is Qwen3's renderer in every other respect: the same ChatML, the same tool calls as JSON in `<tool_call>`
tokens parsed by Qwen3's parser, tool results as `<tool_response>` user turns, the same bridging between turns.
Use with `model.renderer = {name = "custom", import_path = "compact_tools_renderer.CompactToolsQwen3Renderer",
enable_thinking = false}`; tasks need a system prompt (the line joins it, so message indices are unchanged).
"""

from renderers.configs import Qwen3RendererConfig
from renderers.qwen3 import Qwen3Renderer


def tools_line(tools: list[dict]) -> str:
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
