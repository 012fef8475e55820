"""Methods mixed into every vLLM worker (`--worker-extension-cls`), called with `collective_rpc`.

Names carry a `prime_` prefix: vLLM 0.32 workers already define `update_weights`/`reload_weights`.
"""

import os
import threading
from concurrent.futures import Future

from loguru import logger

from prime_rl.inference.finite_kv import guard_kv_cache

guard_kv_cache()  # in the process that runs the model, before it runs: no NaN/inf reaches the KV cache


class WeightSwapExtension:
    def prime_load_weights(self, weight_dir: str) -> None:
        """Reload all weights in place, layer by layer, from a directory of HF safetensors."""
        if not os.path.isdir(weight_dir):
            # vLLM would take a path that is not a directory for a hub id and go looking for it online.
            raise FileNotFoundError(f"weight directory {weight_dir} does not exist")
        self._prime_reload(weights_path=weight_dir)

    def prime_broadcast_join(self, settings: dict, spec: dict, expected: dict) -> None:
        """First half of receiving a broadcast: start joining the trainer's group `spec` names (or reusing it),
        receiving the header and saying in the group's all-reduce whether it fits the served model, in a thread, and
        return at once. An RPC blocks the engine's loop, so a trainer slow to send its header would stall generation;
        in a thread it does not. `prime_broadcast_joined` collects the outcome.

        `settings`: the server's own `weight_broadcast` config (the store's address comes from there, never from a
        request); `expected`: the served model's tensors."""
        stale = self.__dict__.pop("_prime_joining", None), self.__dict__.pop("_prime_pending", None)
        if any(x is not None for x in stale):
            self._prime_drop_group("an earlier transfer was joined but never loaded")
        joining = self._prime_joining = Future()
        threading.Thread(
            target=self._prime_join, args=(settings, spec, expected, joining), name="prime-broadcast-join", daemon=True
        ).start()

    def prime_broadcast_joined(self) -> dict | None:
        """The join's outcome, once it is done (None while it runs): {"step": n} when every member accepted the header
        (the weights follow: `prime_broadcast_load`); {"refused": why} when the header does not fit or is malformed
        (every member stopped before any weight changed); {"not_started": why} when joining or the header failed."""
        joining = self.__dict__.get("_prime_joining")
        if joining is None:
            return {"not_started": "no transfer is being joined"}
        if not joining.done():
            return None
        del self._prime_joining
        return joining.result()

    def _prime_join(self, settings: dict, spec: dict, expected: dict, joining: Future) -> None:
        from prime_rl.inference.weights import header_problem
        from prime_rl.weight_broadcast.protocol import HeaderError, max_header_bytes
        from prime_rl.weight_broadcast.transfer import agree, buffer_device, receive_header

        device = buffer_device(settings["type"], self.device)
        timeout = settings["timeout"]
        try:
            if device.type == "cuda":
                import torch

                torch.cuda.set_device(device)  # this thread's collectives run on the worker's GPU
            group = self._prime_group(settings, spec)
            header = receive_header(group, device, max_header_bytes(expected), timeout)
            problem = header_problem(header, expected)
            accepted = agree(group, problem is None, device, timeout)
        except HeaderError as e:  # out of step with the group now: nothing more can be received on it
            self._prime_drop_group(str(e))
            joining.set_result({"refused": str(e)})
            return
        except Exception as e:
            self._prime_drop_group(f"{type(e).__name__}: {e}")
            joining.set_result({"not_started": f"{type(e).__name__}: {e}"})
            return
        if not accepted:
            joining.set_result({"refused": problem or "another member of the group refused the weights"})
            return
        self._prime_pending = (group, header, device, timeout)
        joining.set_result({"step": header.step})

    def prime_broadcast_load(self) -> None:
        """Second half, with generation paused: reload every weight in place from the group, layer by layer as the
        buffers arrive."""
        from prime_rl.weight_broadcast.transfer import receive_tensors

        group, header, device, timeout = self.__dict__.pop("_prime_pending")
        try:
            self._prime_reload(weights_iterator=receive_tensors(group, header, device, timeout))
        except BaseException:
            self._prime_drop_group("the transfer failed midway")
            raise

    def _prime_drop_group(self, why: str) -> None:
        """A group that failed (or a member out of step with it) is never used again."""
        if self.__dict__.get("_prime_groups"):
            logger.warning(f"left the weight-broadcast group: {why}")
        self.__dict__.get("_prime_groups", {}).clear()

    def prime_lora_modules(self) -> list[str] | None:
        """Layer names (last path component, e.g. `q_proj`) vLLM applies LoRA to in the served model, as its adapter
        loader expects them (packed layers such as `qkv_proj` expanded); None without LoRA."""
        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            return None
        adapters = manager._adapter_manager
        expected = set()
        for module in adapters.supported_lora_modules:
            expected.update(adapters.packed_modules_mapping.get(module, [module]))
        return sorted(expected)

    def _prime_group(self, settings: dict, spec: dict):
        """The group `spec` names: joined once through the trainer's store (authenticated with the run secret), kept
        while the membership stays the same. The store must name the session the orchestrator saw: a group of an
        earlier trainer is never joined."""
        from prime_rl.weight_broadcast.client import StoreClient
        from prime_rl.weight_broadcast.protocol import read_session
        from prime_rl.weight_broadcast.transfer import join_group

        groups = self.__dict__.setdefault("_prime_groups", {})
        key = (spec["session"], spec["group"])
        if key not in groups:
            groups.clear()  # an older group's peers may be gone
            store = StoreClient(settings["host"], settings["port"], bytes.fromhex(settings["key"]), settings["timeout"])
            try:
                if read_session(store, settings["timeout"])["id"] != spec["session"]:
                    raise RuntimeError("the trainer's store names another session: that trainer is gone")
                parallel = self.vllm_config.parallel_config
                rank = spec["rank"] + parallel.data_parallel_rank * parallel.world_size + self.rank
                group = join_group(
                    store, spec["group"], rank, spec["world_size"], settings["type"], settings["timeout"]
                )
            except BaseException:
                store.close()
                raise
            groups[key] = (store, group)  # the store stays open as long as its group
            logger.info(f"joined weight-broadcast group {spec['group']} as rank {rank}/{spec['world_size']}")
        return groups[key][1]

    def _prime_reload(self, **source) -> None:
        try:
            self.reload_weights(is_checkpoint_format=True, **source)
        except BaseException:
            self._prime_end_failed_reload()
            raise
        self._prime_refresh_tied_lm_head()

    def _prime_end_failed_reload(self) -> None:
        """Finish vLLM's layerwise reload after an exception, as its normal end would.

        Otherwise layers not yet loaded stay on the meta device with their half-buffered weights, and the
        next reload (the restore) skips re-initializing them, mixing the stale buffers into its load.
        """
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        try:
            finalize_layerwise_reload(self.model_runner.get_model(), self.model_runner.model_config)
        except Exception:
            logger.exception("could not finish the failed weight reload")

    def _prime_refresh_tied_lm_head(self) -> None:
        """vLLM CPU bug: with tied embeddings the LM head keeps a pre-packed copy of the old embedding.

        Re-pack it from the (now updated) shared weight; untied heads were repacked by the reload.
        """
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        model = self.model_runner.get_model()
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if lm_head is None or embed is None or lm_head.weight is not embed.weight:
            return
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
        logger.debug("re-packed tied lm_head after weight reload")
