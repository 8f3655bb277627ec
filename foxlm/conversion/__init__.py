"""Converters into foxlm: LLaMA-family checkpoints (forget gates retrofitted, optionally followed by attention
transfer) and the paper's official checkpoints."""

from .llama import convert_llama_to_fox, fox_from_llama
from .official import convert_official_to_fox, fox_from_official
from .output import ConversionError
from .transfer import TransferRecord, token_batches, transfer_attention

__all__ = ["ConversionError", "TransferRecord", "convert_llama_to_fox", "convert_official_to_fox", "fox_from_llama",
           "fox_from_official", "token_batches", "transfer_attention"]
