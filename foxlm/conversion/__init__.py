"""Converters into foxlm: LLaMA-family checkpoints (forget gates retrofitted) and the paper's official checkpoints."""

from .llama import convert_llama_to_fox, fox_from_llama
from .official import convert_official_to_fox, fox_from_official
from .output import ConversionError

__all__ = ["ConversionError", "convert_llama_to_fox", "convert_official_to_fox", "fox_from_llama", "fox_from_official"]
