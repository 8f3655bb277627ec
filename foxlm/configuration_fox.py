"""FoX model configuration."""

import math

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from .compat import CACHE_ARG
from .kernels.acp import DEFAULT_PRUNE_EPS

FGATE_TYPES = ("data_dependent", "data_independent", "fixed", "none")
ATTENTION_BACKENDS = ("auto", "triton", "reference")
# What partial RoPE does with the pairs slower than its cut (`rope_slow_pairs`); the last two turn slower, by
# `rope_slow_pairs_factor`.
SLOW_PAIRS = ("drop", "clamp", "interpolate", "compress")
SLOWER_SLOW_PAIRS = ("interpolate", "compress")
# The slow-pair settings that keep RoPE's frequencies and move the slow pairs' positions instead.
POSITION_MAPPED_SLOW_PAIRS = ("clamp", "compress")


@strict
class FoxConfig(PreTrainedConfig):
    r"""
    Configuration of a Forgetting Transformer (FoX): a LLaMA-style decoder whose softmax attention carries a forget
    gate, `O = softmax(QK^T / sqrt(d) + D) V` with `D_ij = sum_{l=j+1..i} log f_l` (arXiv 2503.02130). FoX needs no
    positional embedding; RoPE is available but off by default.

    The LLaMA fields (`vocab_size` ... `head_dim`) mean what they mean in `LlamaConfig`, so LLaMA checkpoints load
    into FoX by name. The FoX fields:

    Args:
        fgate_type (`str`, defaults to `"data_dependent"`):
            Forget gate of each head. `"data_dependent"`: `f_t = sigmoid(w . x_t + b)` (the paper's FoX);
            `"data_independent"`: a learned per-head constant `sigmoid(b)`; `"fixed"`: a constant `sigmoid(b)` that is
            not trained (an ALiBi-like recency bias); `"none"`: `f = 1`, plain softmax attention.
        fgate_bias_init (`float`, *optional*):
            Initial gate bias of every head (default 0.0, i.e. f = 0.5 at start as in the paper). Larger values keep
            gates open at start (5.0 gives f = 0.993), which suits retrofitting pretrained models.
        decay_time_min (`float`, *optional*), decay_time_max (`float`, *optional*):
            Initialise the gate biases so that head h forgets with time constant `tau_h`, log-spaced from
            `decay_time_min` (head 0) to `decay_time_max` (last head): `sigmoid(b_h) = exp(-1 / tau_h)`. Needs a gate
            with a bias (not `"none"`); required by `"fixed"` unless `fgate_bias_init` is given.
        use_rope (`bool`, defaults to `False`):
            Rotary position embeddings on q and k (after QK-norm), with LLaMA's `rope_parameters`.
        rope_parameters (`dict`, *optional*):
            As in `LlamaConfig`; only read when `use_rope` is set. Default `rope_theta` 500000.
        rope_max_wavelength (`float`, *optional*):
            Partial RoPE: with `use_rope`, only the channel pairs whose wavelength (`2 pi / frequency`, in tokens) is
            shorter than this are rotated; the slower pairs are left position-free, as without RoPE. A retrofit sets
            it to its source's context (`foxlm convert llama --partial-rope`): the pairs kept have turned through
            every angle within that context, the ones dropped are those whose angles beyond it were never trained.
        rope_slow_pairs (`str`, defaults to `"drop"`):
            What partial RoPE does with the slower pairs: `"drop"` leaves them unrotated; `"clamp"` rotates them
            with positions capped at `rope_max_wavelength`, so up to that position they turn as in the original
            and beyond it they stop, never reaching an angle (a distance up to `rope_max_wavelength`) the original
            did not see; `"interpolate"` divides their frequencies by `rope_slow_pairs_factor`, so that over
            `factor` times the cut they turn as far as the original did over the cut (YaRN's "NTK-by-parts" with a
            hard boundary and no temperature: the faster pairs keep their rotation exactly); `"compress"` rotates
            them as the original up to `rope_max_wavelength` and `rope_slow_pairs_factor` times slower past it, so
            that positions past the cut keep angles of their own (clamped, they all share the cut's) while within
            it the model computes what the original does. `foxlm convert llama` writes `"clamp"` unless asked
            otherwise, `foxlm finetune` `"compress"` when its context reaches past the cut; the default stays
            `"drop"`, what configs saved before this setting existed (without the key) computed.
        rope_slow_pairs_factor (`float`, *optional*):
            With `rope_slow_pairs="interpolate"` or `"compress"`, how many times slower the slow pairs turn (above
            1; with `"compress"` past `rope_max_wavelength` only): the context the model is meant for over
            `rope_max_wavelength` (or `rope_slow_pairs_start`).
        rope_slow_pairs_start (`float`, *optional*):
            With `rope_slow_pairs="clamp"` or `"compress"`, the position up to which the slow pairs turn as in the
            original (then stop or turn slower), when it is not `rope_max_wavelength`: with a cut below the source's
            context and this at the context, the pairs whose wavelength lies between (SmolLM2's 5.8k for a 4k cut
            of 8k) join the slow pairs past the context only, and within it the model computes what the original
            does.
        logn_scaling_context (`int`, *optional*):
            Log-n attention scaling past this many tokens (Qwen's `use_logn_attn`): the query at position p (from 0,
            within its document) is multiplied by `max(1, log(p + 1) / log(logn_scaling_context))`, so that its
            scores over the keys grow as slowly as the number of keys dilutes them (1.08 at twice the context, 1.15
            at four times for an 8k context). Within the context the model computes what it does without it.
            `foxlm convert llama --logn-scaling` sets the source's context. Needs `acp_eps=None`: ACP's bound on
            `q.k` does not cover scaled queries.
        qk_norm (`bool`, defaults to `False`):
            Per-head RMSNorm of q and k (FoX Pro), with `qk_norm_eps`.
        use_output_gate (`bool`, defaults to `False`):
            Multiply the attention output by `sigmoid(W_g x)` before `o_proj` (FoX Pro).
        use_output_norm (`bool`, defaults to `False`):
            Per-head RMSNorm of the attention output before the gate and `o_proj` (FoX Pro).
        use_k_shift (`bool`, defaults to `False`), use_v_shift (`bool`, defaults to `False`):
            Token shift of keys / values (FoX Pro): `k_t <- a_t k_{t-1} + (1 - a_t) k_t`, `a_t = sigmoid(w . x_t)`
            per head.
        shift_bias (`bool`, defaults to `False`):
            Give the shift projections a bias. A retrofit starts them near no shift (`a = sigmoid(bias)` close to 0)
            so that the converted model computes what the original did.
        acp_eps (`float`, *optional*, defaults to `"auto"`):
            Adaptive Computation Pruning tolerance (pruned attention mass per query <= eps, so each attention output
            moves by at most `2 eps max|v|`). Tiles of the training/prefill kernel (forward and both backward passes)
            and keys at decode time whose decay `c_q - c_k` is below `delta = -2U - log L + log eps` are skipped and
            never read (docs/acp.md). `"auto"` means e^-10 with `qk_norm` (U then comes from the QK-norm
            scales) and None (off) otherwise; set a float to force it on (U measured from q and k) or None to turn
            it off.
        decode_kv_eviction (`bool`, defaults to `False`):
            Drop cached keys/values that ACP proves negligible for every future query (tolerance `acp_eps`, e^-10
            if unset), per KV head: heads that forget fast then keep a bounded cache. Needs `qk_norm`, whose scales
            bound `|q.k|` for queries not seen yet. Exact up to eps for sequences up to `max_position_embeddings`.
            With a static cache (fixed buffers) nothing is freed: the decode kernel skips those keys through ACP.
        attention_backend (`str`, defaults to `"auto"`):
            `"auto"` runs the Triton kernel on CUDA and the PyTorch reference elsewhere; `"triton"` or `"reference"`
            force one.
        layer_types (`list[str]`, *optional*):
            Not a stored field: always one `"fox_attention"` per layer (see the `layer_types` property). Accepted,
            and checked, for config.json files that still carry it.

    Presets for the paper's two variants: `FoxConfig.fox_llama(...)` and `FoxConfig.fox_pro(...)`.

    ```python
    >>> from foxlm import FoxConfig, FoxForCausalLM
    >>> config = FoxConfig.fox_pro(hidden_size=768, num_hidden_layers=12, num_attention_heads=12)
    >>> model = FoxForCausalLM(config)
    ```"""

    model_type = "fox"
    keys_to_ignore_at_inference = [CACHE_ARG]  # the output field Trainer's evaluation leaves out
    default_theta = 500000.0
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    # LLaMA-compatible fields. The default size is the paper's 760M model.
    vocab_size: int = 32000
    hidden_size: int = 1536
    intermediate_size: int = 4096
    num_hidden_layers: int = 24
    num_attention_heads: int = 24
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 16384
    initializer_range: int | float = 0.02
    rms_norm_eps: int | float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_dropout: int | float | None = 0.0
    mlp_bias: bool = False
    # FoX fields.
    fgate_type: str = "data_dependent"
    fgate_bias_init: int | float | None = None
    decay_time_min: int | float | None = None
    decay_time_max: int | float | None = None
    use_rope: bool = False
    rope_parameters: RopeParameters | dict | None = None
    rope_max_wavelength: int | float | None = None
    rope_slow_pairs: str = "drop"
    rope_slow_pairs_factor: int | float | None = None
    rope_slow_pairs_start: int | float | None = None
    logn_scaling_context: int | None = None
    qk_norm: bool = False
    qk_norm_eps: int | float = 1e-5
    use_output_gate: bool = False
    use_output_norm: bool = False
    use_k_shift: bool = False
    use_v_shift: bool = False
    shift_bias: bool = False
    acp_eps: int | float | str | None = "auto"
    decode_kv_eviction: bool = False
    attention_backend: str = "auto"

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.acp_eps == "auto":
            self.acp_eps = DEFAULT_PRUNE_EPS if self.qk_norm else None
        super().__post_init__(**kwargs)

    @classmethod
    def fox_llama(cls, **kwargs):
        """FoX (LLaMA): the LLaMA architecture without RoPE, plus a data-dependent forget gate."""
        return cls(**kwargs)

    @classmethod
    def fox_pro(cls, **kwargs):
        """FoX (Pro): adds QK-norm, output gate, output norm and K/V shift; MLP width `hidden * 3.5 * 2/3`."""
        pro_parts = dict(qk_norm=True, use_output_gate=True, use_output_norm=True, use_k_shift=True, use_v_shift=True)
        hidden_size = kwargs.get("hidden_size", cls.hidden_size)
        # The paper's MLP width for hidden_ratio 3.5, rounded up to a multiple of 256 (3584 at hidden 1536).
        pro_parts["intermediate_size"] = 256 * math.ceil(int(hidden_size * 3.5 * 2 / 3) / 256)
        return cls(**{**pro_parts, **kwargs})

    def validate_architecture(self):
        """Part of `@strict` validation: the FoX configuration is consistent."""
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of `num_key_value_heads` "
                f"({self.num_key_value_heads})."
            )
        if self.fgate_type not in FGATE_TYPES:
            raise ValueError(f"`fgate_type` must be one of {FGATE_TYPES}, got {self.fgate_type!r}.")
        has_decay_range = self.decay_time_min is not None or self.decay_time_max is not None
        if has_decay_range:
            if self.decay_time_min is None or self.decay_time_max is None:
                raise ValueError("set both `decay_time_min` and `decay_time_max`, or neither.")
            if not 0 < self.decay_time_min <= self.decay_time_max:
                raise ValueError(
                    f"need 0 < decay_time_min <= decay_time_max, got {self.decay_time_min}, {self.decay_time_max}."
                )
            if self.fgate_bias_init is not None:
                raise ValueError("`fgate_bias_init` and the decay-time range both set the gate bias; give one.")
        if self.fgate_type == "none" and (has_decay_range or self.fgate_bias_init is not None):
            raise ValueError("`fgate_type='none'` has no gate bias: unset `fgate_bias_init` / `decay_time_min/max`.")
        if self.fgate_type == "fixed" and not has_decay_range and self.fgate_bias_init is None:
            raise ValueError("`fgate_type='fixed'` needs its constant: set `decay_time_min/max` or `fgate_bias_init`.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"`attention_backend` must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}."
            )
        if self.acp_eps is not None and (isinstance(self.acp_eps, str) or not 0 < self.acp_eps < 1):
            raise ValueError(f"`acp_eps` must be in (0, 1), 'auto' or None, got {self.acp_eps!r}.")
        if self.logn_scaling_context is not None:
            if isinstance(self.logn_scaling_context, bool) or not self.logn_scaling_context >= 2:
                raise ValueError(f"`logn_scaling_context` must be a number of tokens of at least 2 (the context past "
                                 f"which queries are scaled), got {self.logn_scaling_context!r}.")
            if self.acp_eps is not None:
                raise ValueError("`logn_scaling_context` needs `acp_eps=None`: ACP bounds q.k by the unscaled "
                                 "queries, which the scaling exceeds past the context.")
        if self.decode_kv_eviction and not self.qk_norm:
            raise ValueError("`decode_kv_eviction` needs `qk_norm=True`: only QK-norm bounds |q.k| for future queries.")
        rope_type = (self.rope_parameters or {}).get("rope_type", "default")
        if not self.use_rope and rope_type != "default":
            raise ValueError(
                f"`rope_parameters` scale RoPE (rope_type {rope_type!r}) but `use_rope=False`: FoX without RoPE has "
                "no positions to scale. Set `use_rope=True`, or drop the scaling (a converted model drops RoPE "
                "unless `--keep-rope`)."
            )
        if self.rope_max_wavelength is not None:
            if not self.use_rope:
                raise ValueError("`rope_max_wavelength` selects which RoPE channel pairs rotate: it needs "
                                 "`use_rope=True`.")
            if isinstance(self.rope_max_wavelength, bool) or not 0 < self.rope_max_wavelength < math.inf:
                raise ValueError(f"`rope_max_wavelength` must be a positive number of tokens, got "
                                 f"{self.rope_max_wavelength!r}.")
            if "dynamic" in rope_type or rope_type == "longrope":
                raise ValueError(f"`rope_max_wavelength` needs fixed RoPE frequencies; rope_type {rope_type!r} "
                                 "recomputes them with the sequence length.")
        if self.rope_slow_pairs not in SLOW_PAIRS:
            raise ValueError(f"`rope_slow_pairs` must be one of {', '.join(map(repr, SLOW_PAIRS))}, got "
                             f"{self.rope_slow_pairs!r}.")
        factor = self.rope_slow_pairs_factor
        if self.rope_slow_pairs in SLOWER_SLOW_PAIRS and (isinstance(factor, bool) or not (
                isinstance(factor, (int, float)) and 1 < factor < math.inf)):
            raise ValueError(f"`rope_slow_pairs={self.rope_slow_pairs!r}` needs `rope_slow_pairs_factor`, a number "
                             f"above 1 (how many times slower the slow pairs turn), got {factor!r}.")
        if self.rope_slow_pairs not in SLOWER_SLOW_PAIRS and factor is not None:
            raise ValueError(f"`rope_slow_pairs_factor` is for `rope_slow_pairs='interpolate'` or 'compress', not "
                             f"{self.rope_slow_pairs!r}.")
        start = self.rope_slow_pairs_start
        if start is not None and self.rope_slow_pairs not in POSITION_MAPPED_SLOW_PAIRS:
            raise ValueError(f"`rope_slow_pairs_start` is for `rope_slow_pairs='clamp'` or 'compress', not "
                             f"{self.rope_slow_pairs!r}.")
        if start is not None and (isinstance(start, bool) or not (
                isinstance(start, (int, float)) and 0 < start < math.inf)):
            raise ValueError(f"`rope_slow_pairs_start` must be a positive number of tokens, got {start!r}.")
        if self.rope_slow_pairs != "drop" and self.rope_max_wavelength is None:
            raise ValueError("`rope_slow_pairs` says what partial RoPE does with the pairs slower than "
                             "`rope_max_wavelength`: it needs `rope_max_wavelength`.")
        if self.hidden_act not in ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu"):
            raise ValueError(f"`hidden_act` {self.hidden_act!r} is not a supported gated-MLP activation.")

    @property
    def layer_types(self):
        """One `"fox_attention"` per layer: derived from `num_hidden_layers`, never written to config.json.

        transformers builds one cache layer per entry (`DynamicCache(config=...)`, which `generate()` calls), and
        `FoxCacheLayer` is registered under `"fox_attention"`, so every layer gets FoX's cache. It is a property
        rather than a field (as in transformers' Mamba configs) because `PreTrainedConfig` rejects layer types it
        does not know, and a FoX folder's config.json is also read through that base class: by `Trainer` when it
        resumes from a checkpoint (`PreTrainedConfig.from_json_file`), and by `AutoTokenizer` where foxlm is not
        imported (`PreTrainedConfig.from_pretrained`). FoX has no other kind of layer, so nothing is lost.
        """
        return ["fox_attention"] * self.num_hidden_layers

    @layer_types.setter
    def layer_types(self, value):
        # Folders saved before `layer_types` was derived carry it in config.json, and `from_pretrained` passes it on
        # through `setattr`: check it and keep nothing, since the property gives the same list.
        if value is None:
            return
        if any(layer_type != "fox_attention" for layer_type in value):
            raise ValueError(f"`layer_types` entries must all be 'fox_attention', got {value}.")
        if len(value) != self.num_hidden_layers:
            raise ValueError(f"`layer_types` has {len(value)} entries for {self.num_hidden_layers} layers.")

    def validate_layer_type(self):
        """Part of `@strict` validation, in place of `PreTrainedConfig`'s check, which rejects `"fox_attention"` (not
        one of transformers' layer types); the derived `layer_types` is right by construction."""


__all__ = ["FoxConfig"]
