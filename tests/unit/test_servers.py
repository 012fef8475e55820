"""The orchestrator's admin view of its servers, against a real closed port (no server needed)."""

import asyncio

from prime_rl.orchestrator.servers import InferenceServers
from prime_rl.utils.net import free_port


def test_a_swap_that_hits_a_dead_server_takes_it_out_of_rotation_instead_of_ending_the_run(tmp_path):
    """The server died while the orchestrator waited for new weights: the swap's connection fails. The run goes on
    (no exception), the version moves, and the server is paused until recovery can give it that version. (The
    orchestrator used to exit with `ConnectError: All connection attempts failed`.) Recovery bringing a restarted
    server to the current policy is the multi-host test's."""
    dead = f"http://127.0.0.1:{free_port()}/v1"

    async def swap() -> tuple[list[str], int, bool]:
        servers = InferenceServers([dead], "NO_SUCH_KEY_VAR", timeout=5, output_dir=tmp_path)
        try:
            await servers.load_policy(3)
            return servers.healthy(), servers.version, dead in servers.recovering
        finally:
            await servers.close()

    healthy, version, recovering = asyncio.run(swap())
    assert healthy == [] and version == 3 and recovering
