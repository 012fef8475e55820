"""Methods mixed into every vLLM worker (`--worker-extension-cls`), called with `collective_rpc`.

Names carry a `prime_` prefix: vLLM 0.32 workers already define `update_weights`/`reload_weights`.
"""

import os

from loguru import logger


class WeightSwapExtension:
    def prime_load_weights(self, weight_dir: str) -> None:
        """Reload all weights in place, layer by layer, from a directory of HF safetensors."""
        if not os.path.isdir(weight_dir):
            # vLLM would take a path that is not a directory for a hub id and go looking for it online.
            raise FileNotFoundError(f"weight directory {weight_dir} does not exist")
        self._prime_reload(weights_path=weight_dir)

    def prime_receive_weights(self, spec: dict, expected: dict) -> dict:
        """Join the trainer's broadcast group `spec` describes (or reuse it) and reload every weight in place from it,
        layer by layer as the buffers arrive. Returns {"step": n}; {"refused": why} when the header does not fit the
        served model (every member then stops, before any weight changed); {"not_started": why} when joining or the
        header failed (no weight changed either)."""
        from prime_rl.inference.weights import header_problem
        from prime_rl.weight_broadcast import agree, buffer_device, receive_header, receive_tensors

        device = buffer_device(spec["backend"], self.device)
        try:
            group = self._prime_group(spec)
            header = receive_header(group, device)
            problem = header_problem(header, expected)
            if not agree(group, problem is None, device):
                return {"refused": problem or "another member of the group refused the weights"}
        except Exception as e:
            self.__dict__.get("_prime_groups", {}).clear()  # a broken group is never used again
            logger.warning(f"weight broadcast failed before any weight changed: {e}")
            return {"not_started": f"{type(e).__name__}: {e}"}
        try:
            self._prime_reload(weights_iterator=receive_tensors(group, header, device))
        except BaseException:
            self._prime_groups.clear()
            raise
        return {"step": header.step}

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

    def _prime_group(self, spec: dict):
        """The group of `spec`'s session and generation: joined once, kept while the membership stays the same."""
        from prime_rl.weight_broadcast import connect_store, join_group

        key = (spec["host"], spec["port"], spec["session"], spec["generation"])
        groups = self.__dict__.setdefault("_prime_groups", {})
        if key not in groups:
            groups.clear()  # an older generation's peers may be gone
            store = connect_store(spec["host"], spec["port"], spec["timeout"])
            parallel = self.vllm_config.parallel_config
            index = parallel.data_parallel_rank * parallel.world_size + self.rank
            rank = spec["rank"] + index
            group = join_group(
                store, spec["session"], spec["generation"], rank, spec["world_size"], spec["backend"], spec["timeout"]
            )
            groups[key] = (store, group)  # the store stays open as long as its group
            logger.info(f"joined weight broadcast generation {spec['generation']} as rank {rank}/{spec['world_size']}")
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
