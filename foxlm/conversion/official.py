"""Import the paper's released FoX checkpoints (zhixuan-lin/forgetting-transformer, model_type
`forgetting_transformer-project_fox`) into foxlm: `convert_official_to_fox` behind `foxlm convert official`.

The official model computes what `FoxForCausalLM` computes; only names and a few layouts differ (see
`OFFICIAL_RENAMES`): the MLP's `gate_proj` holds gate and up projections stacked, the K/V token shift lives inside
`k_proj` / `v_proj`, and the released checkpoints share one QK-norm scale vector across heads, which foxlm tiles.
"""

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tqdm.auto import tqdm
from transformers import GenerationConfig

from ..configuration_fox import FoxConfig
from ..model_card import conversion_card
from ..modeling_fox import FoxForCausalLM
from ..outputs import check_target, staged_folder
from .output import ConversionError, check_shard_size, torch_dtype

OFFICIAL_MODEL_TYPE = "forgetting_transformer-project_fox"
FGATE_TYPES = {"full": "data_dependent", "bias_only": "data_independent", "fixed": "fixed", "none": "none"}
# Official name (regex) -> foxlm name. `mlp.gate_proj` and the QK-norm scales also change shape, see below.
OFFICIAL_RENAMES = (
    (r"^model\.embeddings\.", "model.embed_tokens."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.mlp_norm\.", ".post_attention_layernorm."),
    (r"\.attn\.", ".self_attn."),
    (r"\.([kv])_proj\.linear\.", r".\1_proj."),
    (r"\.([kv])_proj\.shift_proj\.", r".\1_shift_proj."),
    (r"\.self_attn\.fgate_bias$", ".self_attn.fgate_bias.bias"),
)
TOKENIZER_FILES = ("tokenizer*", "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json")
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_heads")  # the official config's sizes without defaults


def official_mlp_width(config):
    """The official `intermediate_size`: given, or `256 * ceil(int(hidden * hidden_ratio * 2/3) / 256)`."""
    if config.get("intermediate_size"):
        return config["intermediate_size"]
    return 256 * math.ceil(int(config["hidden_size"] * config.get("hidden_ratio", 4) * 2 / 3) / 256)


def fox_config_from_official(config):
    """A FoxConfig from an official config.json dict; unsupported options raise ConversionError."""
    if config.get("model_type") != OFFICIAL_MODEL_TYPE:
        raise ConversionError(f"model_type is {config.get('model_type')!r}, not {OFFICIAL_MODEL_TYPE!r}: not an "
                              "official FoX checkpoint (LLaMA-family models go through `foxlm convert llama`).")
    missing = [name for name in REQUIRED_FIELDS if not isinstance(config.get(name), int) or config[name] < 1]
    if missing:
        raise ConversionError(f"the config has no valid {', '.join(missing)} (positive integers that every official "
                              "FoX config.json holds): is it complete?")
    if config["hidden_size"] % config["num_heads"]:
        raise ConversionError(f"hidden_size {config['hidden_size']} is not a multiple of num_heads "
                              f"{config['num_heads']}.")
    if config.get("num_kv_heads") is not None:
        raise ConversionError("official checkpoints have no `num_kv_heads` (the official layer rejects it).")
    if config.get("hidden_act", "swish") != "swish":
        raise ConversionError(f"hidden_act {config['hidden_act']!r} is not supported; official FoX uses 'swish'.")
    if config.get("use_output_gate") and config.get("ogate_act", "sigmoid") != "sigmoid":
        raise ConversionError(f"ogate_act {config['ogate_act']!r} is not supported; foxlm's output gate is a sigmoid.")
    fgate_type = config.get("fgate_type", "full")
    if fgate_type not in FGATE_TYPES:
        raise ConversionError(f"unknown fgate_type {fgate_type!r}; expected one of {list(FGATE_TYPES)}.")
    decay = {}
    if config.get("fgate_bias_init"):
        decay = dict(decay_time_min=config["decay_time_min"], decay_time_max=config["decay_time_max"])
    tolerance = config.get("log_pruning_tolerance")
    rope = {}
    if config.get("use_rope"):
        theta = config.get("rope_base", 500000.0)
        rope = dict(use_rope=True, rope_parameters={"rope_type": "default", "rope_theta": theta})
    return FoxConfig(
        vocab_size=config.get("vocab_size", 32000),
        hidden_size=config["hidden_size"],
        intermediate_size=official_mlp_width(config),
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_heads"],
        num_key_value_heads=config["num_heads"],
        head_dim=config["hidden_size"] // config["num_heads"],
        hidden_act="silu",
        rms_norm_eps=config.get("norm_eps", 1e-6),
        qk_norm_eps=1e-5,
        initializer_range=config.get("initializer_range", 0.02),
        max_position_embeddings=config.get("max_position_embeddings") or 16384,
        bos_token_id=config.get("bos_token_id", 1),
        eos_token_id=config.get("eos_token_id", 2),
        pad_token_id=config.get("pad_token_id"),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        fgate_type=FGATE_TYPES[fgate_type],
        qk_norm=config.get("qk_norm", False),
        use_output_gate=config.get("use_output_gate", False),
        use_output_norm=config.get("use_output_norm", False),
        use_k_shift=config.get("use_k_shift", False),
        use_v_shift=config.get("use_v_shift", False),
        acp_eps=math.exp(tolerance) if tolerance is not None else None,
        **decay,
        **rope,
    )


def fox_state_dict_from_official(state_dict, config):
    """Rename an official state dict to foxlm names, split the fused MLP and tile shared QK-norm scales."""
    converted = {}
    for name, tensor in state_dict.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        new_name = name
        for pattern, replacement in OFFICIAL_RENAMES:
            new_name = re.sub(pattern, replacement, new_name)
        if new_name.endswith("mlp.gate_proj.weight"):
            gate, up = tensor.split(config.intermediate_size, dim=0)
            converted[new_name] = gate
            converted[new_name.replace("gate_proj", "up_proj")] = up
        elif new_name.endswith(("q_norm.weight", "k_norm.weight")) and tensor.numel() == config.head_dim:
            # Released checkpoints share one scale vector across heads (qk_norm_share_param_across_head): tile it.
            converted[new_name] = tensor.repeat(config.num_attention_heads)
        else:
            converted[new_name] = tensor
    if config.tie_word_embeddings:
        converted.setdefault("lm_head.weight", converted.get("model.embed_tokens.weight"))
    return converted


def load_official_checkpoint(source):
    """(config dict, state dict) from an official checkpoint folder or Hub id (safetensors or .bin weights)."""
    folder = Path(source)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.bin", "*.txt", "*.model"]
        try:
            folder = Path(snapshot_download(str(source), allow_patterns=patterns))
        except Exception as error:  # noqa: BLE001 - hub errors have many types; all mean "not found"
            message = f"{source} is neither a folder nor a reachable (or cached) Hub id: {error}"
            raise ConversionError(message) from error
    config_file = folder / "config.json"
    if not config_file.exists():
        raise ConversionError(f"{folder} has no config.json.")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as error:
        raise ConversionError(f"{config_file} is not valid JSON ({error}): download the checkpoint again.") from error
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ConversionError(f"{folder} has no *.safetensors or pytorch_model*.bin weights.")
    state_dict = {}
    for file in tqdm(files, desc="reading weights", disable=len(files) < 2):
        try:
            state_dict.update(load_file(file) if file.suffix == ".safetensors" else torch.load(file, weights_only=True))
        except (SafetensorError, RuntimeError, OSError, ValueError) as error:
            raise ConversionError(f"could not read {file.name} of {source}: {' '.join(str(error).split())}. The file "
                                  "is truncated or corrupt: download the checkpoint again.") from error
    return folder, config, state_dict


def fox_from_official(config, state_dict, dtype=None):
    """Build the FoxForCausalLM an official config and state dict describe (logits preserved)."""
    fox_config = fox_config_from_official(config)
    converted = fox_state_dict_from_official(state_dict, fox_config)
    fox = FoxForCausalLM(fox_config)
    expected, given = set(fox.state_dict()), set(converted)
    if expected != given:
        raise ConversionError(f"checkpoint does not match its config: missing {sorted(expected - given)[:5]}, "
                              f"unexpected {sorted(given - expected)[:5]}")
    wrong = [f"{name} {tuple(converted[name].shape)}, not {tuple(tensor.shape)}" for name, tensor in
             fox.state_dict().items() if converted[name].shape != tensor.shape]
    if wrong:
        raise ConversionError(f"checkpoint does not match its config: {'; '.join(wrong[:3])}")
    fox.load_state_dict(converted)
    if dtype is not None:
        fox.to(dtype)
    return fox.eval()


def convert_official_to_fox(source, output_dir, *, dtype="auto", max_shard_size="5GB", force=False):
    """Convert an official FoX checkpoint (folder or Hub id) into a foxlm model folder; returns it as a Path."""
    check_target(output_dir, force=force, sources=[source])
    max_shard_size = check_shard_size(max_shard_size)
    folder, config, state_dict = load_official_checkpoint(source)
    source_dtype = next(iter(state_dict.values())).dtype
    target_dtype = torch_dtype(dtype, source_dtype)
    fox = fox_from_official(config, state_dict, target_dtype)
    verified = [f"The checkpoint's {len(state_dict)} tensors and this model's {len(fox.state_dict())} match one to one "
                "after the renames above, by name and shape (none missing, none left over)."]
    with staged_folder(output_dir, force=force, sources=[source], holds="converted model") as staging:
        fox.save_pretrained(staging, max_shard_size=max_shard_size)
        tokenizer_files = [f for pattern in TOKENIZER_FILES for f in folder.glob(pattern)]
        for file in tokenizer_files:
            shutil.copy(file, staging / file.name)
        generation = folder / "generation_config.json"
        if generation.exists():
            shutil.copy(generation, staging / generation.name)
        else:
            GenerationConfig.from_model_config(fox.config).save_pretrained(staging)
        card = conversion_card(name=Path(output_dir).name, kind="official", source=source, config=fox.config,
                               dtype=target_dtype, tokenizer_saved=bool(tokenizer_files), verified=verified)
        (staging / "README.md").write_text(card)
    return Path(output_dir)
