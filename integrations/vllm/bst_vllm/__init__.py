"""vLLM plugin serving Block-State Transformer checkpoints saved by ``modeling_bst``.

Installed as its own distribution (``integrations/vllm``), it registers through the ``vllm.general_plugins``
entry point: [`register`] makes ``model_type: "bst"`` readable by transformers' ``AutoConfig`` and registers the
``BSTForCausalLM`` architecture with vLLM's ``ModelRegistry`` and its engine settings (``engine_config.py``).
"""

ARCHITECTURE = "BSTForCausalLM"


def register() -> None:
    """Entry point of ``vllm.general_plugins``: runs in every vLLM process before a model loads."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from .config import BSTServingConfig
    from .engine_config import BSTEngineConfig

    try:
        AutoConfig.register("bst", BSTServingConfig)
    except ValueError:  # registered already (the plugin loads once per process, but tests may call it again)
        pass
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "bst_vllm.model:BSTForCausalLM")
    MODELS_CONFIG_MAP[ARCHITECTURE] = BSTEngineConfig
