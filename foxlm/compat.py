"""What differs between the transformers releases foxlm supports, in one place.

transformers 5.24 renamed the cache argument of every model forward from `past_key_values` to `cache` (and the
field of the model outputs with it). Its own LLaMA takes `cache`, and `past_key_values` as a deprecated alias;
5.17's takes `past_key_values` only. foxlm's forwards take `cache` and accept `past_key_values` on every version
(with transformers' deprecation notice where transformers deprecates it), and hand the cache to transformers' own
code (outputs, gradient-checkpointing layers) under the installed name, `CACHE_ARG`.

transformers 5.23 renamed gradient checkpointing to activation checkpointing: `enable_activation_checkpointing`
below for models, `foxlm.training.CHECKPOINTING_ARGUMENT` for `TrainingArguments` (kept beside the training code, so
that the model does not import the trainer).
"""

import dataclasses
import functools

from transformers.modeling_outputs import BaseModelOutputWithPast

CACHE_ARG = "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"
LEGACY_CACHE_ARG = "past_key_values"

if CACHE_ARG == "cache":
    from transformers.utils.deprecation import deprecate_kwarg

    # The decorator (and version) transformers' LlamaModel.forward uses.
    accepts_legacy_cache_arg = deprecate_kwarg(LEGACY_CACHE_ARG, "5.40.0", new_name="cache")
else:

    def accepts_legacy_cache_arg(forward):
        """Let `forward`, whose cache parameter is `cache`, take it as `past_key_values` (this release's name)."""

        @functools.wraps(forward)
        def wrapper(*args, **kwargs):
            if LEGACY_CACHE_ARG in kwargs:
                if kwargs.get("cache") is not None:
                    raise TypeError("pass the cache once, as `cache` or as `past_key_values`, not both")
                kwargs["cache"] = kwargs.pop(LEGACY_CACHE_ARG)
            return forward(*args, **kwargs)

        return wrapper


def enable_activation_checkpointing(model, checkpoint_kwargs=None):
    """Activation (gradient) checkpointing of `model`'s layers, `checkpoint_kwargs` going to
    `torch.utils.checkpoint`: transformers 5.23 renamed `gradient_checkpointing_enable(gradient_checkpointing_kwargs)`
    to `activation_checkpointing_enable(activation_checkpointing_kwargs)`, warning on the old name."""
    if hasattr(model, "activation_checkpointing_enable"):
        return model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    return model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def cache_kwargs(cache):
    """`{name: cache}` under the installed transformers' name, for its outputs and layers."""
    return {CACHE_ARG: cache}


# Keyword arguments that transformers passes to a decoder-only model's forward beyond the named parameters, and
# what FoX does with each. Any other keyword is a TypeError: a renamed argument must fail, not be dropped.
PASSTHROUGH_KWARGS = {
    "num_items_in_batch": "Trainer's token count of the accumulated batch; divides the summed loss",
    "shift_labels": "labels already shifted (context-parallel slices, foxlm.context_parallel.shard_batch); the loss "
                    "reads them instead of shifting `labels`",
    "output_hidden_states": "read by transformers' output capturing",
    "output_attentions": "read by transformers' output capturing; FoX computes no attention weights (True raises)",
    "cu_seq_lens_q": "packed-document boundaries (DataCollatorWithFlattening)",
    "cu_seq_lens_k": "packed-document boundaries; must equal cu_seq_lens_q (causal self-attention)",
    "max_length_q": "longest packed document (DataCollatorWithFlattening); FoX derives it from the boundaries",
    "max_length_k": "longest packed document (DataCollatorWithFlattening); FoX derives it from the boundaries",
    "seq_idx": "document index per packed token (DataCollatorWithFlattening); FoX reads the boundaries instead",
    "is_causal": "FoX attention is causal; False raises",
}


def check_forward_kwargs(owner, kwargs):
    """Raise a TypeError naming every keyword argument of `owner`'s forward that FoX would not use."""
    unknown = sorted(set(kwargs) - set(PASSTHROUGH_KWARGS))
    if unknown:
        raise TypeError(
            f"{owner}.forward() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; it takes the "
            f"named parameters and these from transformers: {', '.join(PASSTHROUGH_KWARGS)}."
        )
    if kwargs.get("output_attentions"):
        raise ValueError(
            "FoX does not return attention weights (`output_attentions=True`): its attention runs as one fused "
            "kernel that never forms the attention matrix."
        )
    if kwargs.get("is_causal") is False:
        raise ValueError("FoX attention is causal only: `is_causal=False` is not supported.")
