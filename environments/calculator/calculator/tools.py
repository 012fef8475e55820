"""The calculator's MCP tool server: one `calculate(expression)` tool (verifiers starts it as
`python -m calculator.tools`, its config in VF_CONFIG)."""

import verifiers.v1 as vf

from calculator import calculate


class CalculatorTools(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the tool is offered as `calculate`, not `<server>_calculate`

    @vf.tool
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression: numbers, + - * / and parentheses, e.g. (1200 + 345) * 12."""
        return calculate(expression)


if __name__ == "__main__":
    CalculatorTools.run()
