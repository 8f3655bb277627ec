"""Fine-tuning helpers: the recommended LoRA setup for FoX models and optimizer parameter groups."""

from peft import LoraConfig
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

# LLaMA's projections: LoRA adapts these. Registered for model_type "fox", so that
# `get_peft_model(model, LoraConfig(...))` without `target_modules` picks the same projections.
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.setdefault("fox", LORA_TARGET_MODULES)
# FoX's own modules: small, and new after a conversion, so they train in full (PEFT `modules_to_save`).
FOX_MODULES = ["fgate_proj", "fgate_bias", "k_shift_proj", "v_shift_proj", "q_norm", "k_norm", "output_norm",
               "ogate_proj"]


def fox_lora_config(model, r=16, lora_alpha=32, lora_dropout=0.0, **kwargs):
    """`LoraConfig` for a FoX model: LoRA on the attention and MLP projections, forget gates (and any other FoX
    modules the model has) fully trainable and saved with the adapter."""
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=LORA_TARGET_MODULES,
        modules_to_save=[name for name in FOX_MODULES if name in present],
        **kwargs,
    )


def optimizer_param_groups(model, weight_decay=0.1):
    """Two AdamW groups: weight decay on matrices and embeddings; none on biases, norm scales and gate biases.

    Pass the result to `torch.optim.AdamW`, or to `Trainer(optimizers=(AdamW(groups, ...), None))`.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or "norm" in name or name.endswith("fgate_bias.bias"):
            no_decay.append(param)
        else:
            decay.append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
