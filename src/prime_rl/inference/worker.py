"""Methods mixed into every vLLM worker (`--worker-extension-cls`), called with `collective_rpc`.

Names carry a `prime_` prefix: vLLM 0.32 workers already define `update_weights`/`reload_weights`.
"""

from loguru import logger


class WeightSwapExtension:
    def prime_load_weights(self, weight_dir: str) -> None:
        """Reload all weights in place, layer by layer, from a directory of HF safetensors."""
        self.reload_weights(weights_path=weight_dir, is_checkpoint_format=True)
        self._prime_refresh_tied_lm_head()

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
