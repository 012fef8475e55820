"""Test environments for loading every verifiers v1 environment shape.

`vf-seats-env`: a multi-agent env whose config has no `agent` field: an unpinned `player` seat, a `referee` seat
that pins its own harness, runtime and token cap, and an env-level option (`rounds`). The player answers, the
referee never acts; the player's reward is 1 for any reply.
"""

import verifiers.v1 as vf


class SeatsTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def replied(self, trace: vf.Trace) -> float:
        return float(bool(trace.last_reply))


class SeatsTaskset(vf.Taskset[SeatsTask, vf.TasksetConfig]):
    def load(self):
        for i in range(4):
            yield SeatsTask(vf.TaskData(prompt=f"Say {i}."), self.config.task)


class SeatsEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    referee: vf.AgentConfig = vf.AgentConfig(
        harness={"id": "null"}, runtime={"type": "subprocess"}, max_total_tokens=32
    )
    rounds: int = 1
    """How many times the player is asked."""


class SeatsEnv(vf.Env[SeatsEnvConfig]):
    async def setup(self, agents):
        agents.referee.trainable = False

    async def run(self, task, agents):
        for _ in range(self.config.rounds):
            await agents.player.run(task)


__all__ = ["SeatsTaskset", "SeatsEnv"]
