"""foxlm: the Forgetting Transformer (FoX) for Hugging Face transformers.

Importing foxlm registers model_type "fox" with the transformers Auto classes.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .configuration_fox import FoxConfig
from .kernels import forgetting_attention
from .cache_fox import FoxCacheLayer
from .modeling_fox import (
    FoxForCausalLM,
    FoxForSequenceClassification,
    FoxModel,
    FoxPreTrainedModel,
)
from .remote_code import write_remote_code
from .training import fox_lora_config, optimizer_param_groups

__version__ = "0.1.0"

AutoConfig.register("fox", FoxConfig, exist_ok=True)
AutoModel.register(FoxConfig, FoxModel, exist_ok=True)
AutoModelForCausalLM.register(FoxConfig, FoxForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(FoxConfig, FoxForSequenceClassification, exist_ok=True)
# The Trainer's label smoother shifts labels only for names in this mapping.
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("fox", "FoxForCausalLM")

__all__ = [
    "FoxCacheLayer",
    "FoxConfig",
    "FoxForCausalLM",
    "FoxForSequenceClassification",
    "FoxModel",
    "FoxPreTrainedModel",
    "forgetting_attention",
    "fox_lora_config",
    "optimizer_param_groups",
    "write_remote_code",
]
