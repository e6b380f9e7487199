"""vLLM engine settings a BST model needs, applied by vLLM's per-architecture config hook (``MODELS_CONFIG_MAP``)."""

from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig


logger = init_logger(__name__)


def prefix_cache_block_size(requested: int | None, block_len: int) -> int:
    """The token block of BST's prefix cache: ``requested`` (a user's ``--mamba-block-size`` or ``--block-size``)
    rounded up to a multiple of the model's block length W, or W itself when none is given.

    The state is complete at any position, so any size would be correct; a multiple of W makes every cached state
    (and every prefill chunk end vLLM aligns to it) fall on a BST block boundary, where the current block's context
    part of the state is empty and a resumed prefill starts a fresh block. W itself is the finest reuse (a hit
    covers all whole BST blocks of the shared prefix) at no cost: vLLM keeps one state per prefill chunk, not per
    block."""
    if not requested:
        return block_len
    return -(-requested // block_len) * block_len


class BSTEngineConfig(VerifyAndUpdateConfig):
    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        """Prefix caching off: one state slot per request, kept for the request's whole length
        (``mamba_block_size`` = the longest sequence). Prefix caching on: vLLM's Mamba ``align`` mode, with vLLM's
        block size and the Mamba block size both [`prefix_cache_block_size`] (the scheduler aligns prefill chunk
        ends to ``block_size``, the state cache stores a state per ``mamba_block_size`` block: they must agree)."""
        cache_config = vllm_config.cache_config
        if not cache_config.enable_prefix_caching:
            cache_config.mamba_cache_mode = "none"
            if cache_config.mamba_block_size is None:
                cache_config.mamba_block_size = vllm_config.model_config.max_model_len
            return
        if not vllm_config.scheduler_config.enable_chunked_prefill:
            raise ValueError("BST serving: prefix caching (vLLM's Mamba align mode) needs chunked prefill.")
        block_len = vllm_config.model_config.hf_config.block_len
        requested = cache_config.mamba_block_size
        if requested is None and cache_config.user_specified_block_size:
            requested = cache_config.block_size
        size = prefix_cache_block_size(requested, block_len)
        if requested and size != requested:
            logger.warning(
                "BST serving: prefix-cache block size %d rounded up to %d, a multiple of block_len %d.",
                requested,
                size,
                block_len,
            )
        cache_config.mamba_cache_mode = "align"
        cache_config.mamba_block_size = size
        cache_config.block_size = size
        # Keep it through the platform's defaults (the CPU platform sets 128 unless the user gave a size).
        cache_config.user_specified_block_size = True
        if cache_config.prefix_cache_retention_interval == 0:
            # vLLM's default keeps a Mamba state only at each prompt's last whole block (a repeated or extended
            # prompt hits it, one sharing a shorter prefix does not). Keep every state vLLM stores instead (one
            # per prefill chunk end): kept states are evictable blocks, they take no memory from running requests.
            cache_config.prefix_cache_retention_interval = None
