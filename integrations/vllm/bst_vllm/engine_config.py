"""vLLM engine settings a BST model needs, applied by vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``)."""

from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig


logger = init_logger(__name__)


class BSTEngineConfig(VerifyAndUpdateConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        """One state slot per request, kept for the request's whole length (``mamba_block_size`` = the longest
        sequence); prefix caching off: the model does not implement vLLM's Mamba prefix caching (``align`` mode),
        which would have to store the states at block boundaries and restore them."""
        cache_config = vllm_config.cache_config
        if cache_config.enable_prefix_caching:
            logger.warning("BST serving: prefix caching is not supported; disabling it.")
            cache_config.enable_prefix_caching = False
        cache_config.mamba_cache_mode = "none"
        if cache_config.mamba_block_size is None:
            cache_config.mamba_block_size = vllm_config.model_config.max_model_len
