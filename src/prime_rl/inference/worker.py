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
        try:
            self.reload_weights(weights_path=weight_dir, is_checkpoint_format=True)
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
