"""Block-State Transformer for Hugging Face Transformers: importing this package registers ``model_type="bst"`` with
the four Auto classes, and ``save_pretrained`` writes the modeling code and an ``auto_map`` listing all four."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from .cache_bst import BSTCache
from .configuration_bst import BSTConfig
from .modeling_bst import BSTForCausalLM, BSTForSequenceClassification, BSTModel, BSTPreTrainedModel


__version__ = "0.1.0"

AutoConfig.register("bst", BSTConfig)
BSTConfig.register_for_auto_class()
for auto, model in zip(
    (AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification),
    (BSTModel, BSTForCausalLM, BSTForSequenceClassification),
):
    auto.register(BSTConfig, model)
    model.register_for_auto_class(auto.__name__)

__all__ = ["BSTCache", "BSTConfig", "BSTForCausalLM", "BSTForSequenceClassification", "BSTModel", "BSTPreTrainedModel"]
