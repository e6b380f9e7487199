"""Block-State Transformer for Hugging Face Transformers.

Importing this package registers ``model_type="bst"`` with ``AutoConfig``, ``AutoModel``, ``AutoModelForCausalLM``
and ``AutoModelForSequenceClassification``, and makes every ``save_pretrained`` write the modeling code and an
``auto_map`` listing all four (``configuration_bst.AUTO_MAP``), so that a checkpoint loads with any of these Auto
classes and ``trust_remote_code=True`` where this package is not installed.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from .cache_bst import BSTCache
from .configuration_bst import BSTConfig
from .modeling_bst import (
    BSTForCausalLM,
    BSTForSequenceClassification,
    BSTModel,
    BSTPreTrainedModel,
)


__version__ = "0.1.0"

AutoConfig.register("bst", BSTConfig)
AutoModel.register(BSTConfig, BSTModel)
AutoModelForCausalLM.register(BSTConfig, BSTForCausalLM)
AutoModelForSequenceClassification.register(BSTConfig, BSTForSequenceClassification)

BSTConfig.register_for_auto_class()
BSTModel.register_for_auto_class("AutoModel")
BSTForCausalLM.register_for_auto_class("AutoModelForCausalLM")
BSTForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")

__all__ = [
    "BSTCache",
    "BSTConfig",
    "BSTForCausalLM",
    "BSTForSequenceClassification",
    "BSTModel",
    "BSTPreTrainedModel",
]
