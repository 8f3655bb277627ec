"""The official FoX checkpoint format (zhixuan-lin/forgetting-transformer), written from its documentation
(docs/design.md §2; docs/conversion.md, "The paper's checkpoints"), and a hand-written reference of the official
model's math on that state dict.

No official checkpoint can be downloaded here: `write_official_checkpoint` makes one with the documented config
fields, tensor names and shapes, and `official_logits` computes what the official model would output for it.
"""

import json
import math

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

OFFICIAL_CONFIG_DEFAULTS = dict(
    model_type="forgetting_transformer-project_fox", architectures=["ForgettingTransformerForCausalLM"],
    vocab_size=101, hidden_size=64, num_hidden_layers=2, num_heads=4, num_kv_heads=None, hidden_ratio=4,
    intermediate_size=None, hidden_act="swish", norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=None, use_rope=False, rope_base=500000.0, use_output_gate=False,
    ogate_act="sigmoid", use_output_norm=False, qk_norm=False, qk_norm_share_param_across_head=False,
    use_k_shift=False, use_v_shift=False, fgate_type="full", fgate_bias_init=False, decay_time_min=None,
    decay_time_max=None, log_pruning_tolerance=None, max_position_embeddings=None, window_size=None,
    elementwise_affine=True, attention_bias=False, fuse_norm=True, fuse_cross_entropy=True, use_cache=True,
)
PRO = dict(hidden_ratio=3.5, use_output_gate=True, use_output_norm=True, qk_norm=True, use_k_shift=True,
           use_v_shift=True)


def official_config(variant="pro", **overrides):
    """`variant`: "pro" (FoX Pro) or "llama" (FoX LLaMA), at a tiny size: hidden 64, 4 heads of 16, 2 layers."""
    return {**OFFICIAL_CONFIG_DEFAULTS, **(PRO if variant == "pro" else {}), **overrides}


def mlp_width(config):
    return 256 * math.ceil(int(config["hidden_size"] * config["hidden_ratio"] * 2 / 3) / 256)


def official_state_dict(config, seed=0):
    """Random tensors under the official names and shapes; scales large enough that every part matters."""
    generator = torch.Generator().manual_seed(seed)
    V, D, H = config["vocab_size"], config["hidden_size"], config["num_heads"]
    d, I = D // H, mlp_width(config)
    normal = lambda *shape, std=0.1: torch.randn(*shape, generator=generator) * std  # noqa: E731
    scale = lambda n: 1 + normal(n, std=0.3)  # noqa: E731
    state = {"model.embeddings.weight": normal(V, D, std=1.0), "model.norm.weight": scale(D)}
    if not config["tie_word_embeddings"]:
        state["lm_head.weight"] = normal(V, D, std=0.2)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state[p + "attn_norm.weight"], state[p + "mlp_norm.weight"] = scale(D), scale(D)
        state[p + "attn.q_proj.weight"], state[p + "attn.o_proj.weight"] = normal(D, D, std=0.3), normal(D, D)
        for name, shifted in (("k_proj", config["use_k_shift"]), ("v_proj", config["use_v_shift"])):
            if shifted:
                state[p + f"attn.{name}.linear.weight"] = normal(D, D, std=0.3)
                state[p + f"attn.{name}.shift_proj.weight"] = normal(H, D, std=0.5)
            else:
                state[p + f"attn.{name}.weight"] = normal(D, D, std=0.3)
        if config["fgate_type"] == "full":
            state[p + "attn.fgate_proj.weight"] = normal(H, D, std=0.3)
            state[p + "attn.fgate_proj.bias"] = normal(H, std=2.0) + 2
        elif config["fgate_type"] in ("bias_only", "fixed"):
            state[p + "attn.fgate_bias"] = normal(H, std=2.0) + 2
        if config["use_output_gate"]:
            state[p + "attn.ogate_proj.weight"] = normal(D, D, std=0.3)
        if config["use_output_norm"]:
            state[p + "attn.output_norm.weight"] = scale(D)
        if config["qk_norm"]:
            n = d if config["qk_norm_share_param_across_head"] else D
            state[p + "attn.q_norm.weight"], state[p + "attn.k_norm.weight"] = scale(n), scale(n)
        state[p + "mlp.gate_proj.weight"] = normal(2 * I, D)
        state[p + "mlp.down_proj.weight"] = normal(D, I)
    return state


def write_official_checkpoint(folder, config, seed=0):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    state = official_state_dict(config, seed)
    save_file(state, folder / "model.safetensors")
    return state


def rms_norm(x, weight, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def official_attention(config, state, p, x):
    """One official attention block on its RMS-normalised input x (B, T, D): docs/design.md §2, steps 1-6."""
    B, T, D = x.shape
    H = config["num_heads"]
    d = D // H
    heads = lambda t: t.view(B, T, H, d)  # noqa: E731
    q = heads(x @ state[p + "attn.q_proj.weight"].T)
    kv = {}
    for name, shifted in (("k", config["use_k_shift"]), ("v", config["use_v_shift"])):
        if not shifted:
            kv[name] = heads(x @ state[p + f"attn.{name}_proj.weight"].T)
            continue
        raw = heads(x @ state[p + f"attn.{name}_proj.linear.weight"].T)
        alpha = torch.sigmoid(x @ state[p + f"attn.{name}_proj.shift_proj.weight"].T)[..., None]  # (B, T, H, 1)
        previous = torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], dim=1)
        kv[name] = alpha * previous + (1 - alpha) * raw
    k, v = kv["k"], kv["v"]
    if config["qk_norm"]:
        q = rms_norm(q, state[p + "attn.q_norm.weight"].view(-1, d), 1e-5)  # (d,) shared or (H, d) per head
        k = rms_norm(k, state[p + "attn.k_norm.weight"].view(-1, d), 1e-5)
    if config["use_rope"]:
        inv_freq = 1.0 / config["rope_base"] ** (torch.arange(0, d, 2).float() / d)
        angles = torch.arange(T).float()[:, None] * inv_freq[None, :]
        cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    if config["fgate_type"] == "full":
        log_f = F.logsigmoid(x @ state[p + "attn.fgate_proj.weight"].T + state[p + "attn.fgate_proj.bias"])
    elif config["fgate_type"] in ("bias_only", "fixed"):
        log_f = F.logsigmoid(state[p + "attn.fgate_bias"]).expand(B, T, H)
    else:
        log_f = torch.zeros(B, T, H)
    c = log_f.cumsum(1).transpose(1, 2)  # (B, H, T)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d) + c[..., :, None] - c[..., None, :]
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v)
    if config["use_output_norm"]:
        o = rms_norm(o, state[p + "attn.output_norm.weight"].view(H, d), config["norm_eps"])
    o = o.reshape(B, T, D)
    if config["use_output_gate"]:
        o = o * torch.sigmoid(x @ state[p + "attn.ogate_proj.weight"].T)
    return o @ state[p + "attn.o_proj.weight"].T


@torch.no_grad()
def official_logits(config, state, input_ids):
    """Logits of the official model (fp32, no autocast): pre-norm blocks, fused swish MLP, final norm, lm_head."""
    eps, I = config["norm_eps"], mlp_width(config)
    x = state["model.embeddings.weight"][input_ids]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = x + official_attention(config, state, p, rms_norm(x, state[p + "attn_norm.weight"], eps))
        gate, up = (rms_norm(x, state[p + "mlp_norm.weight"], eps) @ state[p + "mlp.gate_proj.weight"].T).split(I, -1)
        x = x + (F.silu(gate) * up) @ state[p + "mlp.down_proj.weight"].T
    head = state["model.embeddings.weight"] if config["tie_word_embeddings"] else state["lm_head.weight"]
    return rms_norm(x, state["model.norm.weight"], eps) @ head.T
