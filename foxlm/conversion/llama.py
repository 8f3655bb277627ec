"""Retrofit forget gates onto a LLaMA-family checkpoint: `convert_llama_to_fox` behind `foxlm convert llama`.

FoX keeps LLaMA's module names, so every pretrained tensor moves over unchanged. The converter adds one forget gate
per query head and layer (`self_attn.fgate_proj`: zero weights and a bias from `gate_init`), drops RoPE unless
asked to keep it whole or in part (`partial_rope`: on the channel pairs faster than a wavelength), and copies the
tokenizer and generation config. No q/k permutation is needed: FoX applies RoPE in LLaMA's layout, and without it
`q . k` does not depend on the order of channels within a head. With `transfer_steps`, the converted attention is then
trained to reproduce the source's (`transfer.py`).
"""

import logging
import math
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedConfig

from ..configuration_fox import POSITION_MAPPED_SLOW_PAIRS, SLOW_PAIRS, SLOWER_SLOW_PAIRS, FoxConfig
from ..model_card import conversion_card
from ..modeling_fox import FoxForCausalLM, fgate_bias_init_values
from ..outputs import check_target, staged_folder
from .output import ConversionError, check_shard_size, torch_dtype
from .transfer import DEFAULT_LR as DEFAULT_TRANSFER_LR
from .transfer import transfer_attention

logger = logging.getLogger(__name__)

# model_type -> the architecture foxlm converts; each is LLaMA's block with at most q/k/v biases.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Llama 2 / 3 / 3.x, SmolLM2, TinyLlama, ...
    "mistral": "MistralForCausalLM",  # the sliding window is dropped: FoX attends to the whole context
    "qwen2": "Qwen2ForCausalLM",  # q/k/v projections with biases
}
SUPPORTED_TEXT = "LlamaForCausalLM (Llama 2/3, SmolLM2), MistralForCausalLM, Qwen2ForCausalLM"

# Fields that mean the same in FoxConfig as in the source config.
COPIED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "rms_norm_eps", "initializer_range", "max_position_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "attention_dropout",
)

# Forget-gate initialisations for a retrofit (all start with zero gate weights, so every gate starts data-independent):
# "open": every head gets bias `gate_bias` (5 gives f = 0.993, a decay time of ~150 tokens);
# "decay-spread": head h of each layer gets decay time tau_h, log-spaced over [decay_time_min, decay_time_max].
# decay-spread over 2..512 tokens is the default: on SmolLM2-135M (RoPE dropped, no fine-tuning, 10k-token stdlib
# sources) its mean loss is 5.40 nats, against 5.56 for decay-spread over 16..16384 and 5.60 for open (bias 5), and it
# stays flat past the 8k training context (5.33 at 8k-10k, open: 5.80); benchmarks/gate_init_smollm2.py reproduces it.
GATE_INITS = ("open", "decay-spread")
DEFAULT_GATE_INIT = "decay-spread"
DEFAULT_GATE_BIAS = 5.0
DEFAULT_DECAY_TIMES = (2.0, 512.0)
# With `token_shift`, the shift projections start with zero weights and this bias: a = sigmoid(-6) = 0.0025 of the
# previous token mixed in, close enough to none that the converted model still computes what the source did.
SHIFT_BIAS_INIT = -6.0
# The tensors a FoX model has and a LLaMA-family source does not: what the converter sets itself.
NEW_TENSORS = re.compile(r"\.self_attn\.((fgate|[kv]_shift)_proj\.(weight|bias)|ogate_proj\.weight|o_proj\.bias)$")
# What the Hub accepts as a model id: a name, or a namespace and a name.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def resolve_source(source):
    """A local folder, a local GGUF file or a Hub id -> (name_or_path, extra from_pretrained kwargs)."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConversionError(f"{source} is a file but not a .gguf file; give a folder, a Hub id or a GGUF file.")
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConversionError(f"{source} has no config.json: give a transformers model folder (config.json and "
                                  "weights), a Hub id or a .gguf file.")
        return str(path), {}
    if str(source).endswith(".gguf") or not HUB_ID.match(str(source)):
        raise ConversionError(f"{source} does not exist (and is not a Hub model id); check the path.")
    return str(source), {}  # a Hub id, resolved through the Hugging Face cache (works offline once cached)


def check_gate_options(gate_init, gate_bias, decay_times):
    """The forget-gate options of a conversion, checked before any work."""
    if gate_init not in GATE_INITS:
        raise ConversionError(f"gate_init must be one of {GATE_INITS}, got {gate_init!r}.")
    if not math.isfinite(gate_bias):
        raise ConversionError(f"gate bias must be a finite number (5 gives f = 0.993), got {gate_bias}.")
    low, high = decay_times
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low <= high):
        raise ConversionError(f"decay times must be finite numbers of tokens with 0 < MIN <= MAX, got {low} {high}.")


def load_source_config(source):
    """The source's transformers config, checked to be a supported architecture (reads no weights)."""
    name_or_path, kwargs = resolve_source(source)
    try:
        # The raw dict first: an unsupported model_type may be one transformers cannot even parse.
        raw, _ = PreTrainedConfig.get_config_dict(name_or_path, **kwargs)
    except (OSError, ValueError, KeyError) as error:
        hub = ("" if Path(name_or_path).is_dir() else
               " (no local folder or file, nor a model on the Hub or in its cache)")
        message = " ".join(str(error).split())  # transformers' messages span lines; ours is one
        raise ConversionError(f"could not read a model config from {source}{hub}: {message}") from error
    model_type, architectures = raw.get("model_type"), raw.get("architectures") or []
    if model_type is None:
        raise ConversionError(f"the config of {source} names no model_type: not a transformers model; foxlm convert "
                              f"llama supports {SUPPORTED_TEXT}.")
    expected = SUPPORTED_ARCHITECTURES.get(model_type)
    if expected is None or any(name != expected for name in architectures):
        found = ", ".join(architectures) or "no architectures listed"
        official = "forgetting" in str(model_type)
        hint = " For the paper's FoX checkpoints use `foxlm convert official`." if official else ""
        raise ConversionError(
            f"{source} is a {found} (model_type {model_type!r}); foxlm convert llama supports {SUPPORTED_TEXT}.{hint}"
        )
    return AutoConfig.from_pretrained(name_or_path, **kwargs)


def partial_rope_cut(config, partial_rope):
    """The wavelength, in tokens, below which partial RoPE keeps a channel pair's rotation: `partial_rope` when it is
    a number, the source's context (`max_position_embeddings` of its `config`) when it is True."""
    return float(config.max_position_embeddings if partial_rope is True else partial_rope)


def fox_config_from_llama(config, *, keep_rope=False, partial_rope=False, slow_pairs=None, interpolate_to=None,
                          slow_pairs_start=None, gate_init=DEFAULT_GATE_INIT, gate_bias=DEFAULT_GATE_BIAS,
                          decay_times=DEFAULT_DECAY_TIMES, token_shift=False, output_gate=False, logn_scaling=False):
    """A FoxConfig with the source's sizes, a data-dependent forget gate, with `keep_rope` its RoPE, with
    `partial_rope` its RoPE on the channel pairs whose wavelength is shorter than `partial_rope` tokens only (True: the
    source's context, `max_position_embeddings`; the slower pairs rotated up to that position only, or with
    `slow_pairs="drop"` unrotated, or with `slow_pairs="interpolate"` turning slower, as far over `interpolate_to`
    tokens as they did over the cut, or with `slow_pairs="compress"` that many times slower past the cut only:
    `FoxConfig.rope_slow_pairs`; clamped or compressed from `slow_pairs_start` instead of the cut when given,
    `FoxConfig.rope_slow_pairs_start`), with `token_shift` a key and value token shift (FoX
    Pro's) that starts near no shift, with `output_gate` FoX Pro's output gate (`fox_from_llama` makes it start as
    no gate), and with `logn_scaling` log-n attention scaling past the source's context
    (`FoxConfig.logn_scaling_context`)."""
    check_gate_options(gate_init, gate_bias, decay_times)
    if keep_rope and partial_rope:
        raise ConversionError("keep_rope keeps all of RoPE and partial_rope part of it: give one.")
    if partial_rope is not True and partial_rope is not False and not (
            isinstance(partial_rope, (int, float)) and 0 < partial_rope < math.inf):
        raise ConversionError(f"partial_rope must be True (the source's context) or a wavelength in tokens, got "
                              f"{partial_rope!r}.")
    if slow_pairs is not None and slow_pairs not in SLOW_PAIRS:
        raise ConversionError(f"slow_pairs must be one of {', '.join(map(repr, SLOW_PAIRS))}, got {slow_pairs!r}.")
    if slow_pairs is not None and not partial_rope:
        raise ConversionError("slow_pairs says what partial RoPE does with the pairs slower than its cut: it needs "
                              "partial_rope.")
    cut = partial_rope_cut(config, partial_rope)
    if slow_pairs_start is not None and (not partial_rope or slow_pairs not in (None, *POSITION_MAPPED_SLOW_PAIRS)):
        raise ConversionError("slow_pairs_start is where partial RoPE's clamped or compressed slow pairs leave the "
                              f"source's angles: it needs partial_rope and slow_pairs 'clamp' or 'compress', got "
                              f"partial_rope={partial_rope!r}, slow_pairs={slow_pairs!r}.")
    if slow_pairs_start is not None and (isinstance(slow_pairs_start, bool) or not (
            isinstance(slow_pairs_start, (int, float)) and 0 < slow_pairs_start < math.inf)):
        raise ConversionError(f"slow_pairs_start must be a positive number of tokens, got {slow_pairs_start!r}.")
    start = cut if slow_pairs_start is None else float(slow_pairs_start)
    if (slow_pairs in SLOWER_SLOW_PAIRS) != (interpolate_to is not None):
        raise ConversionError("slow_pairs='interpolate' or 'compress' and interpolate_to, the context to stretch the "
                              "slow pairs' rotation over, go together (on the command line: --slow-pairs interpolate "
                              "or compress and --interpolate-to CONTEXT go together); got "
                              f"slow_pairs={slow_pairs!r}, interpolate_to={interpolate_to!r}.")
    if interpolate_to is not None and (isinstance(interpolate_to, bool) or not (
            isinstance(interpolate_to, (int, float)) and start < interpolate_to < math.inf)):
        where = "partial RoPE's cut" if start == cut else "slow_pairs_start"
        raise ConversionError(f"interpolate_to, the context the model is meant for (`foxlm finetune`: "
                              f"--interpolate-to, by default --context, twice it when compressed), "
                              f"must be a number of tokens above {where} ({start:g}), got {interpolate_to!r}.")
    fields = {name: getattr(config, name) for name in COPIED_FIELDS if getattr(config, name, None) is not None}
    fields["head_dim"] = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # Qwen2 always has q/k/v biases (its config has no flag); FoX's flag also gives o_proj a bias, which starts at 0.
    fields["attention_bias"] = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
    fields["mlp_bias"] = getattr(config, "mlp_bias", False)
    if gate_init == "open":
        fields["fgate_bias_init"] = float(gate_bias)
    else:
        fields["decay_time_min"], fields["decay_time_max"] = map(float, decay_times)
    if token_shift:
        fields.update(use_k_shift=True, use_v_shift=True, shift_bias=True)
    if output_gate:
        fields["use_output_gate"] = True
    if logn_scaling:
        fields["logn_scaling_context"] = int(config.max_position_embeddings)
    if keep_rope or partial_rope:
        fields.update(use_rope=True, rope_parameters=dict(config.rope_parameters))
    if partial_rope:
        fields["rope_max_wavelength"] = cut
        fields["rope_slow_pairs"] = slow_pairs or "clamp"
        if interpolate_to is not None:
            fields["rope_slow_pairs_factor"] = interpolate_to / start
        if slow_pairs_start is not None:
            fields["rope_slow_pairs_start"] = start
    return FoxConfig(fgate_type="data_dependent", **fields)


@torch.no_grad()
def fox_from_llama(model, **options):
    """Convert a loaded LLaMA-family model to a FoxForCausalLM that shares its tensors.

    `options` are `fox_config_from_llama`'s. Every new parameter is set here: the forget gates get zero weights and
    their initial bias, a Qwen2 `o_proj` gets a zero bias. An output gate gets zero weights, so it scales every
    head's output by sigmoid(0) = 1/2, and `o_proj`'s weight is doubled (new storage: the source keeps its own) so
    that the converted attention's output is the plain conversion's; training the gate lets a head scale its output
    by the token, as softmax attention does by parking weight on a sink token, which a forget gate lets decay.
    """
    config = fox_config_from_llama(model.config, **options)
    state_dict = model.state_dict()
    first = next(iter(state_dict.values()))
    dtype, device = first.dtype, first.device  # the new tensors go where the source is (a GPU, for a transfer)
    with torch.device("meta"):
        fox = FoxForCausalLM(config)
    missing, unexpected = fox.load_state_dict(state_dict, strict=False, assign=True)
    unexpected = [key for key in unexpected if not key.endswith("rotary_emb.inv_freq")]
    if unexpected:
        raise ConversionError(f"the source has tensors FoX has no place for: {unexpected[:5]}")
    for name in missing:
        module_name, _, param_name = name.rpartition(".")
        module = fox.get_submodule(module_name)
        if name.endswith("fgate_proj.bias"):
            value = fgate_bias_init_values(config, module.out_features).to(device, dtype)
        elif name.endswith("shift_proj.bias"):
            value = torch.full(module.bias.shape, SHIFT_BIAS_INIT, dtype=dtype, device=device)
        elif name.endswith(("fgate_proj.weight", "o_proj.bias", "shift_proj.weight", "ogate_proj.weight")):
            value = torch.zeros(getattr(module, param_name).shape, dtype=dtype, device=device)
        else:
            raise ConversionError(f"the source checkpoint has no tensor for {name}")
        setattr(module, param_name, torch.nn.Parameter(value))
    if config.use_output_gate:
        for layer in fox.model.layers:
            layer.self_attn.o_proj.weight = torch.nn.Parameter(layer.self_attn.o_proj.weight * 2)
    if config.use_rope:  # a non-persistent buffer, still on the meta device
        fox.model.rotary_emb = type(fox.model.rotary_emb)(config=config).to(device)
    still_meta = [name for name, tensor in [*fox.named_parameters(), *fox.named_buffers()] if tensor.is_meta]
    if still_meta:
        raise ConversionError(f"no value for {still_meta[:5]}: the converter does not know these FoX tensors yet")
    if config.tie_word_embeddings:
        fox.lm_head.weight = fox.model.embed_tokens.weight
    fox.generation_config = model.generation_config
    fox.config.dtype = dtype
    return fox.eval()


def convert_llama_to_fox(source, output_dir, *, keep_rope=False, partial_rope=False, slow_pairs=None,
                         interpolate_to=None, slow_pairs_start=None, dtype="auto",
                         max_shard_size="5GB", force=False, gate_init=DEFAULT_GATE_INIT, gate_bias=DEFAULT_GATE_BIAS,
                         decay_times=DEFAULT_DECAY_TIMES, token_shift=False, output_gate=False, logn_scaling=False,
                         transfer_steps=0,
                         transfer_data=None, transfer_lr=DEFAULT_TRANSFER_LR, transfer_qk_rank=0, transfer_seed=0,
                         transfer_device=None):
    """Convert a LLaMA-family checkpoint (`source`: folder, Hub id or .gguf file) into a FoX model folder.

    RoPE is dropped, kept with `keep_rope`, or kept with `partial_rope` on the channel pairs whose wavelength is
    shorter than `partial_rope` tokens only (True: the source's context; docs/retrofit.md, "Partial RoPE"), the
    slower pairs rotated with positions capped at the cut (`slow_pairs="clamp"`, the default), unrotated
    (`slow_pairs="drop"`), turning `interpolate_to` / cut times slower (`slow_pairs="interpolate"`) or that many
    times slower past the cut only (`slow_pairs="compress"`); clamped or compressed from `slow_pairs_start` instead
    of the cut when it is given.
    With `token_shift` the FoX model gets FoX Pro's key and value token shift, starting near no shift; it gives back
    some of the position information RoPE carried (the previous token's key and value), and the transfer trains it.
    With `output_gate` it gets FoX Pro's output gate, starting as no gate (`fox_from_llama`), also trained by the
    transfer: a head can then scale its output token by token, as the source did by parking attention on a sink.
    With `logn_scaling` each query past the source's context is scaled by log(position) / log(context)
    (`FoxConfig.logn_scaling_context`), so that its attention is not diluted by the keys the source never had.
    With `transfer_steps` > 0 the converted model's attention is first trained to reproduce the source's
    (`transfer_attention`: the forget gates, and rank-`transfer_qk_rank` q/k updates merged into the weights, their
    initialisation seeded by `transfer_seed`) on `transfer_data`, an iterable of (batch, seq_len) input-id tensors
    (`token_batches` makes them from texts), on `transfer_device` (default: CUDA when available, else the CPU).
    Nothing is written when the source is unsupported or `output_dir` is not empty and `force` is False; the output
    appears complete or not at all. Returns the output folder as a Path.
    """
    check_target(output_dir, force=force, sources=[source])
    max_shard_size = check_shard_size(max_shard_size)
    if isinstance(transfer_steps, bool) or not isinstance(transfer_steps, int) or transfer_steps < 0:
        raise ConversionError(f"transfer_steps must be a non-negative integer, got {transfer_steps!r}.")
    if (transfer_steps > 0) != (transfer_data is not None):
        raise ConversionError("attention transfer needs both transfer_steps > 0 and transfer_data (input-id batches); "
                              f"got transfer_steps={transfer_steps} and transfer_data={type(transfer_data).__name__}.")
    source_config = load_source_config(source)
    options = dict(keep_rope=keep_rope, partial_rope=partial_rope, slow_pairs=slow_pairs,
                   interpolate_to=interpolate_to, slow_pairs_start=slow_pairs_start, gate_init=gate_init,
                   gate_bias=gate_bias, decay_times=decay_times, token_shift=token_shift, output_gate=output_gate,
                   logn_scaling=logn_scaling)
    fox_config_from_llama(source_config, **options)  # validate the options before loading any weights
    source_dtype = getattr(source_config, "dtype", None)
    source_dtype = getattr(torch, source_dtype) if isinstance(source_dtype, str) else source_dtype
    target_dtype = torch_dtype(dtype, source_dtype)
    name_or_path, kwargs = resolve_source(source)

    steps = tqdm(total=5 if transfer_steps else 4, desc="foxlm convert llama", unit="step")
    steps.set_postfix_str("loading the source model")
    model = load_source_model(source, name_or_path, kwargs, target_dtype)
    if transfer_steps:  # before converting, so that the source and the FoX model share their tensors there too
        model.to(transfer_device or ("cuda" if torch.cuda.is_available() else "cpu"))
    steps.update()
    steps.set_postfix_str("adding forget gates")
    fox = fox_from_llama(model, **options)
    verified = check_tensors_from_source(fox, model, gguf="gguf_file" in kwargs)
    notes = conversion_notes(source_config)
    for note in notes:
        logger.warning(note)
    steps.update()
    if transfer_steps:
        steps.set_postfix_str("attention transfer")
        record = transfer_attention(model, fox, transfer_data, steps=transfer_steps, lr=transfer_lr,
                                    qk_rank=transfer_qk_rank, seed=transfer_seed)
        notes.append(transfer_note(record, transfer_lr))
        steps.update()
    del model
    with staged_folder(output_dir, force=force, sources=[source], holds="converted model") as staging:
        steps.set_postfix_str("saving the model")
        fox.save_pretrained(staging, max_shard_size=max_shard_size)
        steps.update()
        steps.set_postfix_str("saving the tokenizer and model card")
        tokenizer_saved = save_tokenizer(name_or_path, kwargs, staging)
        if not (staging / "generation_config.json").exists():
            GenerationConfig.from_model_config(fox.config).save_pretrained(staging)
        card = conversion_card(name=Path(output_dir).name, kind="llama", source=source, source_config=source_config,
                               config=fox.config, options={**options, "shift_bias": SHIFT_BIAS_INIT},
                               dtype=target_dtype, verified=verified,
                               tokenizer_saved=tokenizer_saved, notes=notes)
        (staging / "README.md").write_text(card)
        steps.update()
    steps.close()
    return Path(output_dir)


def load_source_model(source, name_or_path, kwargs, dtype):
    """The source model, refused when its checkpoint lacks a tensor its config calls for (transformers would fill it
    with random values), holds one the model has no place for (it would be dropped), or has one of another shape."""
    try:
        model, report = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, output_loading_info=True,
                                                             **kwargs)
    except (OSError, ValueError, SafetensorError) as error:
        message = " ".join(str(error).split())
        raise ConversionError(f"could not load the weights of {source}: {message}. A truncated or corrupt weights "
                              "file is the usual cause: download or save the checkpoint again.") from error
    problems = {
        "lacks {} tensors its config calls for": sorted(report["missing_keys"]),
        "has {} tensors its config has no place for": sorted(key for key in report["unexpected_keys"]
                                                          if not key.endswith("rotary_emb.inv_freq")),
        "has {} tensors of another shape than its config gives": sorted(map(str, report["mismatched_keys"])),
    }
    found = [f"{what.format(len(keys))} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
             for what, keys in problems.items() if keys]
    if found:
        raise ConversionError(f"the checkpoint {source} does not match its config: it {'; it '.join(found)}. "
                              "Nothing was written: fix the checkpoint or its config.json (num_hidden_layers, sizes).")
    return model


def check_tensors_from_source(fox, source_model, gguf=False):
    """Check, by name and shape, that every tensor of `fox` came from `source_model` except the new FoX ones
    (`NEW_TENSORS`); returns what was checked, as lines for the model card."""
    source = {name: tuple(tensor.shape) for name, tensor in source_model.state_dict().items()}
    target = {name: tuple(tensor.shape) for name, tensor in fox.state_dict().items()}
    new = [name for name in target if name not in source]
    wrong = [name for name in new if not NEW_TENSORS.search(name)]
    wrong += [name for name in target if name in source and target[name] != source[name]]
    if wrong:
        raise ConversionError(f"the converted model has tensors that did not come from the source: {wrong[:5]}")
    left_out = [name for name in source if name not in target and not name.endswith("rotary_emb.inv_freq")]
    if left_out:
        raise ConversionError(f"tensors of the source have no place in the converted model: {left_out[:5]}")
    read = " (dequantized from the GGUF file by transformers)" if gguf else ""
    kinds = sorted({NEW_TENSORS.search(name)[1] for name in new})
    return [
        f"All {len(target) - len(new)} tensors of the converted model other than the new ones below came from the "
        f"source checkpoint{read}, matched by name and shape. transformers' loading report showed none missing from "
        "the checkpoint, none of another shape and none left over: no tensor was initialised at random.",
        f"New, set by the converter: {len(new)} tensors ({', '.join(f'`{kind}`' for kind in kinds)} in each layer).",
    ]


def conversion_notes(config):
    """What else changes for this source, beyond the gates and RoPE (for the log and the model card)."""
    notes = []
    if config.model_type == "qwen2":
        notes.append("`o_proj` has a bias (FoX's `attention_bias` covers all four projections), set to zero.")
    window = getattr(config, "sliding_window", None)
    if window and (config.model_type == "mistral" or getattr(config, "use_sliding_window", False)):
        notes.append(f"The sliding window ({window} tokens) is dropped: FoX attends to the whole context.")
    return notes


def transfer_note(record, lr):
    """The model card's line on an attention transfer."""
    trained = "the forget gates (with the token shift and output gate where added)" + (
        f" and rank-{record.qk_rank} q/k updates (merged)" if record.qk_rank else "")
    mean = lambda errors: sum(errors) / len(errors)  # noqa: E731
    return (f"Attention transfer: {record.steps} steps (Adam, lr {lr:g}) trained {trained} so that every layer's "
            "attention reproduces the source's attention output on the source's hidden states; mean layer error "
            f"(MSE over the source output's mean square, first batch) {mean(record.error_before):.3f} before, "
            f"{mean(record.error_after):.3f} after.")


def save_tokenizer(name_or_path, kwargs, output_dir):
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("no tokenizer saved: could not load one from the source (%s).", error)
        return False
    tokenizer.save_pretrained(output_dir)
    return True
