"""The lookup MCP tool server: one `lookup(key)` tool (verifiers starts it as `python -m lookup.tools`, its config
in VF_CONFIG)."""

import verifiers.v1 as vf

from lookup import lookup


class LookupTools(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # offered as `lookup`, not `<server>_lookup`

    @vf.tool
    def lookup(self, key: str) -> str:
        """return the code stored under a key"""
        return lookup(key)


if __name__ == "__main__":
    LookupTools.run()
