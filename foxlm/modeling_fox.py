"""PyTorch Forgetting Transformer (FoX), after transformers' LLaMA: norm, MLP, forget gate, attention, decoder
layer, pretrained base, model and heads; the cache layer is in `cache_fox.py`.

The attention is LLaMA's with one addition, a forget gate per head: `log f_t = logsigmoid(w . x_t + b)` and
`o_i = sum_j softmax_j(q_i . k_j / sqrt(d) + c_i - c_j) v_j` with `c` the cumulative sum of `log f`. It needs no
position embedding. FoX (Pro) adds QK-norm, an output norm and gate, and a token shift of keys and values.
"""

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GenericForSequenceClassification, GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .cache_fox import FOX_CACHE_LAYERS, FoxStaticCacheLayer
from .compat import CACHE_ARG, accepts_legacy_cache_arg, cache_kwargs, check_forward_kwargs
from .configuration_fox import POSITION_MAPPED_SLOW_PAIRS, FoxConfig
from .context_parallel import ContextParallel
from .kernels.acp import DEFAULT_PRUNE_EPS, acp_threshold, cached_score_bound, qk_norm_score_bound
from .kernels.attention.attention import forgetting_attention, packed_sequence_lengths
from .kernels.decode.decode import MAX_DECODE_QUERIES, forgetting_decode
from .kernels.layer_ops.layer_ops import head_rms_norm, token_shift
from .remote_code import AUTO_MAP, write_remote_code


class FoxRMSNorm(nn.Module):
    """RMSNorm over the last dimension, as LLaMA's."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class FoxHeadRMSNorm(FoxRMSNorm):
    """RMSNorm of each head's vector (..., heads, head_dim), one scale per head and channel (QK-norm, output norm),
    times `sigmoid(gate_logits)` when given (the output gate): one fused kernel on the GPU. Returns the input's dtype.
    """

    def __init__(self, num_heads, head_dim, eps):
        super().__init__(num_heads * head_dim, eps)
        self.num_heads, self.head_dim = num_heads, head_dim

    def forward(self, hidden_states, gate_logits=None, backend="auto"):
        return head_rms_norm(hidden_states, self.weight, self.variance_epsilon, gate_logits, backend=backend)


class FoxMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def fgate_bias_init_values(config, num_heads):
    """Initial forget-gate bias per head.

    With a decay-time range, head h gets time constant `tau_h` log-spaced over [T_min, T_max] and
    `b_h = -log(expm1(1 / tau_h))`, so that `sigmoid(b_h) = exp(-1 / tau_h)`. Otherwise every head gets
    `fgate_bias_init` (0 by default, the paper's f = 0.5 at initialisation).
    """
    if config.decay_time_min is not None:
        tau = torch.logspace(
            math.log10(config.decay_time_min), math.log10(config.decay_time_max), num_heads, dtype=torch.float64
        )
        return (-torch.log(torch.expm1(1.0 / tau))).float()
    return torch.full((num_heads,), float(config.fgate_bias_init or 0.0))


class FoxForgetGateProj(nn.Linear):
    """Data-dependent forget gate logits `w . x + b`, one per query head.

    A class of its own so that `_init_weights` can give the bias its configured value: transformers skips
    initialisation branches on container modules of out-of-tree models.
    """


class FoxForgetGateBias(nn.Module):
    """Data-independent forget gate: one logit per head, learned (`trainable`) or a fixed, saved buffer."""

    def __init__(self, num_heads, trainable):
        super().__init__()
        if trainable:
            self.bias = nn.Parameter(torch.zeros(num_heads))
        else:
            self.register_buffer("bias", torch.zeros(num_heads))

    def forward(self, x):
        return self.bias.expand(*x.shape[:-1], -1)


class FoxShiftProj(nn.Linear):
    """Token-shift mixing logits `w . x` (`+ b` with `shift_bias`), one per key/value head (FoX Pro K/V shift)."""


@dataclass
class FoxAttentionLayout:
    """How tokens relate to each other in one forward, computed once per model forward and shared by all layers.

    Masked tokens (0 in a 2-D `attention_mask`, anywhere) contribute neither attention nor decay. The attention
    handles them by working on each row's tokens in an order where the chunk's masked tokens come first (`order`),
    which makes every row left-padded: the cache stores rows that way, and `seq_start` hides the masked keys.

    Attributes:
        seq_start: (B,) number of masked keys in each row: the cache's and the current chunk's, stored first.
        token_mask: (B, T) bool, False at the chunk's masked tokens, in working order (so a run of False, then True).
        order: (B, T) int64, the chunk's working order (a stable sort putting masked tokens first), or None when the
            chunk already has it (no mask, or left padding).
        cu_seqlens: (N + 1,) int32 boundaries of packed documents over the flattened (B * T) tokens.
        doc_start: (B, T) bool, True where a packed document begins (the token shift restarts there).
        context_parallel: with context parallelism, the group's `ContextParallel`: then T is this rank's slice,
            `doc_start` covers the slice and `cu_seqlens` the whole sequence (what the attention sees).
        query_scale: (B or 1, T) float32, in working order, the factor of each query (`config.logn_scaling_context`),
            or None.
    """

    seq_start: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None
    order: torch.Tensor | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    doc_start: torch.Tensor | None = None
    context_parallel: ContextParallel | None = None
    query_scale: torch.Tensor | None = None


def logn_query_scale(position_ids, context):
    """Log-n scaling's factor for the queries at `position_ids`: log(p + 1) / log(context), at least 1."""
    return (torch.log1p(position_ids.float()) / math.log(context)).clamp(min=1.0)


class FoxAttention(nn.Module):
    """Multi-head (GQA) Forgetting Attention with the optional FoX (Pro) parts."""

    def __init__(self, config: FoxConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        hidden, bias = config.hidden_size, config.attention_bias

        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)

        self.fgate_proj = self.fgate_bias = None
        if config.fgate_type == "data_dependent":
            self.fgate_proj = FoxForgetGateProj(hidden, self.num_heads, bias=True)
        elif config.fgate_type in ("data_independent", "fixed"):
            self.fgate_bias = FoxForgetGateBias(self.num_heads, trainable=config.fgate_type == "data_independent")

        self.k_shift_proj = self.v_shift_proj = None
        if config.use_k_shift:
            self.k_shift_proj = FoxShiftProj(hidden, self.num_kv_heads, bias=config.shift_bias)
        if config.use_v_shift:
            self.v_shift_proj = FoxShiftProj(hidden, self.num_kv_heads, bias=config.shift_bias)
        if config.qk_norm:
            self.q_norm = FoxHeadRMSNorm(self.num_heads, self.head_dim, config.qk_norm_eps)
            self.k_norm = FoxHeadRMSNorm(self.num_kv_heads, self.head_dim, config.qk_norm_eps)
        self.output_norm = (
            FoxHeadRMSNorm(self.num_heads, self.head_dim, config.rms_norm_eps) if config.use_output_norm else None
        )
        self.ogate_proj = (
            nn.Linear(hidden, self.num_heads * self.head_dim, bias=False) if config.use_output_gate else None
        )

    def log_fgate(self, hidden_states):
        """log f (B, T, heads) in fp32; zeros (no forgetting) without a gate."""
        if self.fgate_proj is not None:
            return F.logsigmoid(self.fgate_proj(hidden_states).float())
        if self.fgate_bias is not None:
            return F.logsigmoid(self.fgate_bias(hidden_states).float())
        return hidden_states.new_zeros(*hidden_states.shape[:-1], self.num_heads, dtype=torch.float32)

    def _token_shift(self, shift_proj, raw, name, hidden_states, cache_layer, layout):
        """`alpha_t * raw_{t-1} + (1 - alpha_t) * raw_t` with `alpha = sigmoid(shift_proj(x))`; the token before the
        chunk is the cache's shift state (zeros without a cache), and packed documents start from zero.

        Returns (shifted, raw): masked tokens take the previous token's raw value, so that the first real token of a
        row shifts in the token before the chunk, and the last raw value is the next chunk's shift state."""
        if cache_layer is not None:
            previous = cache_layer.shift_state(name, raw)
        elif layout.context_parallel is not None:  # the last token of the previous rank's slice
            previous = layout.context_parallel.previous_token(raw[:, -1:])
        else:
            previous = torch.zeros_like(raw[:, :1])
        if layout.token_mask is not None:
            raw = torch.where(layout.token_mask[:, :, None, None], raw, previous)
        shifted = token_shift(raw, shift_proj(hidden_states), previous, layout.doc_start,
                              backend=self.config.attention_backend)
        return shifted, raw

    def _acp_bound(self, q, cache_layer):
        """U >= |sm_scale q.k| per (batch, query head) (docs/acp.md, `kernels/acp.py`): from the QK-norm scales
        (then valid for future queries too), else from the largest norms of the new queries and of every cached key."""
        if self.config.qk_norm:
            return qk_norm_score_bound(q, self.q_norm.weight, self.k_norm.weight, self.scaling)
        return cached_score_bound(q, cache_layer.key_norm_max, self.scaling)

    def _cached_attention(self, q, k, v, log_fgate, raw_k, raw_v, cache_layer, layout):
        """Attention of the new tokens against the cache: the prefill kernel for a first or long chunk, the decode
        kernel for a few tokens (with ACP when `acp_eps` is set), then (with eviction) dropping what ACP proves
        negligible for good. A static cache is read up to its filled length, a device tensor (no host sync); there
        eviction is ACP in the decode kernel, which skips what eviction would drop."""
        T = q.shape[1]
        static = cache_layer.is_static
        past = cache_layer.get_seq_length()  # a tensor in a filled static cache
        # The static cache bounds the keys by its capacity: a larger count is a safe ACP bound, and needs no sync.
        n_keys = cache_layer.max_cache_len if static else past + T
        eps = self.config.acp_eps
        evict_delta = None
        if self.config.decode_kv_eviction:
            eps = eps or DEFAULT_PRUNE_EPS
        if self.config.decode_kv_eviction and not static:
            # log L over the longest sequence the model is meant for: the bound then holds for every later query.
            horizon = max(self.config.max_position_embeddings, past + T)
            evict_delta = acp_threshold(self._acp_bound(q, cache_layer), horizon, eps)
        cache_layer.update_fox(k.transpose(1, 2), v.transpose(1, 2), log_fgate.transpose(1, 2), raw_k, raw_v,
                               evict_delta=evict_delta, track_key_norm=eps is not None and not self.config.qk_norm,
                               token_mask=layout.token_mask, seq_start=layout.seq_start)
        kwargs = dict(sm_scale=self.scaling, backend=self.config.attention_backend)
        if isinstance(past, int) and past == 0:
            # A whole prompt: the kernel sums log f itself in float64, exact however long the prompt.
            return forgetting_attention(q, k, v, log_fgate, seq_start=layout.seq_start, **kwargs)
        decode = T <= MAX_DECODE_QUERIES
        acp_delta = None
        if decode and eps is not None:
            acp_delta = acp_threshold(self._acp_bound(q, cache_layer), n_keys, eps)
        if static:
            if decode:
                keys, values, fgate_cumsum, _ = cache_layer.kv_groups()[0]
                return forgetting_decode(q, keys.transpose(1, 2), values.transpose(1, 2), fgate_cumsum.transpose(1, 2),
                                         seq_start=layout.seq_start, acp_delta=acp_delta,
                                         kv_len=cache_layer.cumulative_length, **kwargs)
            keys, values, fgate_cumsum = cache_layer.filled_part()
            return forgetting_attention(q, keys.transpose(1, 2), values.transpose(1, 2),
                                        fgate_cumsum=fgate_cumsum.transpose(1, 2), seq_start=layout.seq_start,
                                        **kwargs)
        outs, first_head = [], 0
        for keys, values, fgate_cumsum, evicted in cache_layer.kv_groups():
            heads = slice(first_head, first_head + fgate_cumsum.shape[1])
            first_head = heads.stop
            seq_start = layout.seq_start
            if seq_start is not None and evicted:
                seq_start = (seq_start - evicted).clamp_min(0)
            args = (q[:, :, heads], keys.transpose(1, 2), values.transpose(1, 2))
            if decode:
                delta = None if acp_delta is None else acp_delta[:, heads]
                outs.append(forgetting_decode(*args, fgate_cumsum.transpose(1, 2), seq_start=seq_start,
                                              acp_delta=delta, **kwargs))
            else:
                outs.append(forgetting_attention(*args, fgate_cumsum=fgate_cumsum.transpose(1, 2),
                                                 seq_start=seq_start, **kwargs))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _pruning_kwargs(self, q):
        """Adaptive Computation Pruning in the prefill/training kernel when `acp_eps` is set: U from the QK-norm
        scales, else measured by the kernel wrapper from q and k."""
        if self.config.acp_eps is None:
            return {}
        return dict(prune_eps=self.config.acp_eps,
                    score_bound=self._acp_bound(q, None) if self.config.qk_norm else None)

    def _attention(self, q, k, v, log_fgate, layout, pruning):
        """Attention without a cache, over the whole sequence in q, k, v (B, T, heads, D) and log f (B, T, heads):
        packed documents as one row of B * T tokens."""
        kwargs = dict(sm_scale=self.scaling, backend=self.config.attention_backend, **pruning)
        if layout.cu_seqlens is None:
            return forgetting_attention(q, k, v, log_fgate, seq_start=layout.seq_start, **kwargs)
        flat = lambda t: t.reshape(1, -1, *t.shape[2:])  # noqa: E731
        if kwargs.get("score_bound") is not None:  # per (row, head): the one packed row takes the largest
            kwargs["score_bound"] = kwargs["score_bound"].amax(0, keepdim=True)
        return forgetting_attention(flat(q), flat(k), flat(v), flat(log_fgate), cu_seqlens=layout.cu_seqlens,
                                    max_seqlen=layout.max_seqlen, **kwargs).view(q.shape)

    def forward(
        self,
        hidden_states: torch.Tensor,
        layout: FoxAttentionLayout,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
    ) -> tuple[torch.Tensor, None]:
        B, T, _ = hidden_states.shape
        if layout.order is not None:
            hidden_states = _take_tokens(hidden_states, layout.order)
        q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(B, T, self.num_kv_heads, self.head_dim)
        log_fgate = self.log_fgate(hidden_states)
        if layout.token_mask is not None:
            # A masked token adds no decay to the gate's running sum.
            log_fgate = log_fgate * layout.token_mask[:, :, None]

        cache_layer = None
        if cache is not None:
            if self.layer_idx >= len(cache.layers) or not isinstance(cache.layers[self.layer_idx], FOX_CACHE_LAYERS):
                raise TypeError(
                    "FoX needs FoxCacheLayer cache layers: pass `DynamicCache(config=model.config)` (what generate() "
                    "builds) or `StaticCache(config=model.config, max_cache_len=...)`, not "
                    f"{type(cache).__name__} without the model config."
                )
            cache_layer = cache.layers[self.layer_idx]

        raw_k = raw_v = None
        if self.k_shift_proj is not None:
            k, raw_k = self._token_shift(self.k_shift_proj, k, "keys", hidden_states, cache_layer, layout)
        if self.v_shift_proj is not None:
            v, raw_v = self._token_shift(self.v_shift_proj, v, "values", hidden_states, cache_layer, layout)
        if (raw_k is None) != (raw_v is None):  # the cache keeps both shift states or none
            raw_k, raw_v = (k if raw_k is None else raw_k), (v if raw_v is None else raw_v)
        if layout.token_mask is not None:
            # Masked keys are never read (seq_start hides them); zeros keep them out of the cache's key-norm bound.
            keep = layout.token_mask[:, :, None, None]
            k, v = k * keep, v * keep

        backend = self.config.attention_backend
        if self.config.qk_norm:
            q, k = self.q_norm(q, backend=backend), self.k_norm(k, backend=backend)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        # Under autocast, fp32 RoPE tables promote q and k to fp32; v keeps the compute dtype.
        q, k = q.to(v.dtype), k.to(v.dtype)
        if layout.query_scale is not None:
            q = q * layout.query_scale[:, :, None, None].to(q.dtype)

        if cache_layer is not None:
            out = self._cached_attention(q, k, v, log_fgate, raw_k, raw_v, cache_layer, layout)
        elif layout.context_parallel is not None:
            cp = layout.context_parallel
            pruning = self._pruning_kwargs(q)  # U per head from the QK-norm scales: before the heads are split
            if pruning.get("score_bound") is not None:
                pruning["score_bound"] = cp.local_heads(pruning["score_bound"])
            out = cp.to_sequence(self._attention(*cp.attention_inputs(q, k, v, log_fgate), layout, pruning))
        else:
            out = self._attention(q, k, v, log_fgate, layout, self._pruning_kwargs(q))

        gate_logits = self.ogate_proj(hidden_states) if self.ogate_proj is not None else None
        if self.output_norm is not None:
            out = self.output_norm(out, gate_logits, backend=backend)  # the output gate fused into the norm
        elif gate_logits is not None:
            out = out * torch.sigmoid(gate_logits.view_as(out))
        out = out.reshape(B, T, self.num_heads * self.head_dim)
        if self.training and self.attention_dropout:
            out = F.dropout(out, p=self.attention_dropout)
        out = self.o_proj(out)
        if layout.token_mask is not None:
            out = out * layout.token_mask[:, :, None]  # masked tokens attend to nothing
        if layout.order is not None:
            out = torch.empty_like(out).scatter_(1, layout.order[:, :, None].expand_as(out), out)
        return out, None


def _take_tokens(x, order):
    """x (B, T, ...) with each row's tokens in `order` (B, T)."""
    return x.gather(1, order.view(*order.shape, *[1] * (x.dim() - 2)).expand_as(x))


class FoxDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: FoxConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = FoxAttention(config=config, layer_idx=layer_idx)
        self.mlp = FoxMLP(config)
        self.input_layernorm = FoxRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = FoxRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @accepts_legacy_cache_arg
    def forward(
        self,
        hidden_states: torch.Tensor,
        layout: FoxAttentionLayout,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states, layout=layout, position_embeddings=position_embeddings, cache=cache
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class FoxRotaryEmbedding(LlamaRotaryEmbedding):
    """LLaMA's RoPE, with `config.rope_max_wavelength` (partial RoPE): the channel pairs whose wavelength is that long
    or longer get frequency 0, so cos = 1 and sin = 0 leave them unrotated; with `config.rope_slow_pairs="clamp"` they
    keep their frequency and rotate with positions capped at `rope_max_wavelength` (or `rope_slow_pairs_start`)
    instead, with `"interpolate"` they turn `config.rope_slow_pairs_factor` times slower, with `"compress"` that many
    times slower past that position only."""

    def __init__(self, config):
        super().__init__(config)
        self.set_slow_pair_frequencies()

    def slow_pairs(self, frequencies):
        """The pairs whose wavelength is at least `rope_max_wavelength` (a dropped pair's frequency 0 counts too)."""
        return 2 * math.pi / frequencies >= self.config.rope_max_wavelength

    @torch.no_grad()
    def set_slow_pair_frequencies(self):
        """The slow pairs' frequencies, set from RoPE's own (so that setting them twice changes nothing)."""
        if self.config.rope_max_wavelength is None or self.config.rope_slow_pairs in POSITION_MAPPED_SLOW_PAIRS:
            return
        rope_init = ROPE_INIT_FUNCTIONS.get(self.rope_type, self.compute_default_rope_parameters)
        frequencies = rope_init(self.config)[0]
        slow = self.slow_pairs(frequencies)
        if self.config.rope_slow_pairs == "drop":
            frequencies = frequencies.masked_fill(slow, 0.0)
        else:
            frequencies = torch.where(slow, frequencies / self.config.rope_slow_pairs_factor, frequencies)
        self.inv_freq.copy_(frequencies)
        self.original_inv_freq.copy_(frequencies)

    @torch.no_grad()
    def forward(self, x, position_ids):
        if self.config.rope_max_wavelength is None or self.config.rope_slow_pairs not in POSITION_MAPPED_SLOW_PAIRS:
            return super().forward(x, position_ids)
        start = self.config.rope_slow_pairs_start or self.config.rope_max_wavelength
        positions = position_ids[:, :, None].float()  # (batch, tokens, 1) against (pairs,)
        slow_positions = positions.clamp(max=start)
        if self.config.rope_slow_pairs == "compress":
            slow_positions = slow_positions + (positions - start).clamp(min=0) / self.config.rope_slow_pairs_factor
        positions = torch.where(self.slow_pairs(self.inv_freq), slow_positions, positions)
        angles = positions * self.inv_freq.float()
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * self.attention_scaling).to(x.dtype), (angles.sin() * self.attention_scaling).to(x.dtype)


class FoxPreTrainedModel(PreTrainedModel):
    config: FoxConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["FoxDecoderLayer"]
    _skip_keys_device_placement = [CACHE_ARG]
    _supports_sdpa = False
    _supports_flash_attn = False
    _supports_flex_attn = False
    # The decode step with a static cache is one graph (tests/test_static_cache.py); the prefill stays eager.
    _can_compile_fullgraph = True
    _supports_attention_backend = False
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]
    _can_record_outputs = {"hidden_states": FoxDecoderLayer}

    def save_pretrained(self, save_directory, *args, save_remote_code=True, **kwargs):
        """`PreTrainedModel.save_pretrained` that also writes the model's code beside the weights (unless
        `save_remote_code=False`), so the folder loads with `trust_remote_code=True` where foxlm is not installed.
        `push_to_hub` saves through here, so Hub repositories carry the code too."""
        if not save_remote_code:
            # An auto_map from an earlier save, or from the folder the model was loaded from, would send
            # `trust_remote_code=True` to code this folder does not have.
            auto_map = self.config.__dict__.pop("auto_map", None)
            try:
                return super().save_pretrained(save_directory, *args, **kwargs)
            finally:
                if auto_map is not None:
                    self.config.auto_map = auto_map
        self.config.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_remote_code(save_directory)

    def enable_context_parallel(self, group):
        """Context (sequence) parallelism over the ranks of `group`, the Ulysses scheme (docs/context-parallel.md):
        from now on each rank's forward takes its slice of every sequence (`foxlm.context_parallel.shard_batch`
        makes it) and the attention layers exchange heads over the group. Each rank takes at least one query head;
        heads that the group size does not divide split unevenly (9 over 4: 3, 2, 2, 2). Sets
        `config.use_cache = False`: a context-parallel forward keeps no cache. Returns the model."""
        config = self.config
        self.base_model.context_parallel = ContextParallel(group, config.num_attention_heads,
                                                           config.num_key_value_heads)
        config.use_cache = False
        return self

    def disable_context_parallel(self):
        """Back to whole sequences on each process (`config.use_cache` stays as it is)."""
        self.base_model.context_parallel = None
        return self

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, FoxForgetGateProj):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            init.copy_(module.bias, fgate_bias_init_values(self.config, module.out_features))
        elif isinstance(module, FoxForgetGateBias):
            init.copy_(module.bias, fgate_bias_init_values(self.config, module.bias.numel()))
        elif isinstance(module, FoxRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, FoxRotaryEmbedding):  # transformers has just recomputed every frequency
            module.set_slow_pair_frequencies()


class FoxModel(FoxPreTrainedModel):
    def __init__(self, config: FoxConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [FoxDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = FoxRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # FoX needs no position embedding; RoPE is an option (and what a LLaMA kept with --keep-rope uses).
        self.rotary_emb = FoxRotaryEmbedding(config=config) if config.use_rope else None
        self.gradient_checkpointing = False
        self.context_parallel = None  # a ContextParallel once enable_context_parallel is called
        self.post_init()

    @accepts_legacy_cache_arg
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        check_forward_kwargs(type(self).__name__, kwargs)
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        static_layer = _filled_static_layer(cache)
        if self.context_parallel is not None:
            if cache is not None or use_cache:
                raise ValueError("A context-parallel FoX runs whole sequences without a cache: pass use_cache=False "
                                 "and no `cache` (enable_context_parallel sets config.use_cache=False).")
            layout, position_ids = context_parallel_layout(self.context_parallel, attention_mask, position_ids,
                                                           inputs_embeds, kwargs)
        elif static_layer is not None:
            past_length = static_layer.cumulative_length  # a tensor: a compiled step reads no length on the host
            layout = _static_cache_layout(attention_mask, static_layer, inputs_embeds.shape[:2])
        else:
            past_length = cache.get_seq_length() if cache is not None else 0
            # Only position ids from the caller can mark packed documents; skipping the check otherwise keeps the
            # plain forward free of host syncs (and of graph breaks under torch.compile).
            layout = attention_layout(attention_mask, position_ids, past_length, inputs_embeds.shape[:2], kwargs)
        if position_ids is None:  # context parallelism has given each rank its positions
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_length
            position_ids = position_ids.unsqueeze(0)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids) if self.rotary_emb is not None else None
        query_scale = None
        if self.config.logn_scaling_context is not None:
            query_scale = logn_query_scale(position_ids, self.config.logn_scaling_context)
        if layout.order is not None:  # the attention works on the tokens in this order: put them so once, not per layer
            B = inputs_embeds.shape[0]
            if position_embeddings is not None:
                position_embeddings = tuple(_take_tokens(t.expand(B, -1, -1), layout.order)
                                            for t in position_embeddings)
            if query_scale is not None:
                query_scale = _take_tokens(query_scale.expand(B, -1), layout.order)
        if query_scale is not None:
            layout = dataclasses.replace(layout, query_scale=query_scale)

        hidden_states = inputs_embeds
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                layout=layout,
                position_embeddings=position_embeddings,
                **cache_kwargs(cache),  # the installed name, which gradient checkpointing looks for
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **cache_kwargs(cache))


def _static_cache_prefill(cache, inputs):
    """Whether `inputs` (ids or embeddings) on `cache` are a static FoX cache's prefill or a chunk of it: anything but
    one token on a filled cache. The first layer decides, as in `_filled_static_layer`."""
    first = cache.layers[0] if cache is not None and cache.layers else None
    return isinstance(first, FoxStaticCacheLayer) and (inputs.shape[1] > 1 or not first.filled)


@torch.compiler.disable
def _eager_call(model, **kwargs):
    return model(**kwargs)


def _filled_static_layer(cache):
    """The first layer of a static FoX cache that holds tokens, else None."""
    if cache is None or not cache.layers:
        return None
    layer = cache.layers[0]
    return layer if isinstance(layer, FoxStaticCacheLayer) and layer.filled else None


def _static_cache_layout(attention_mask, static_layer, batch_and_length):
    """The layout of a chunk after the prompt in a static cache: each row's masked tokens are the prompt's, kept by
    the cache, so the step reads no mask (`FoxForCausalLM.create_masks_for_generate` gives it none). A mask given
    anyway is checked, outside torch.compile, to hide no new token: later chunks of a static cache take no masked
    tokens."""
    B, T = batch_and_length
    if attention_mask is not None and not torch.compiler.is_compiling():
        if attention_mask.dim() != 2 or attention_mask.shape[0] != B or not bool(attention_mask[:, -T:].all()):
            raise ValueError(
                "With a static FoX cache only the prompt may hold masked tokens: after it, give an `attention_mask` "
                f"(batch={B}, past + new tokens) whose last {T} columns are all 1s, or none; got one of shape "
                f"{tuple(attention_mask.shape)} that is not."
            )
    return FoxAttentionLayout(seq_start=static_layer.seq_start)


def attention_layout(attention_mask, position_ids, past_length, batch_and_length, kwargs):
    """Read masking and packing off the inputs once per forward (see `FoxAttentionLayout`).

    - A 2-D `attention_mask` (B, past + T) of 1s and 0s, with 0s anywhere (left or right padding, or holes): the
      masked tokens are removed from each sequence, exactly. Only the mask's shape is checked per decode step.
    - Packed documents (padding-free batches, as `DataCollatorWithFlattening` makes them) are recognised from
      `cu_seq_lens_q` (with or without a mask of 1s), or from `position_ids` restarting at 0 when there is no mask,
      and never with a cache.
    """
    B, T = batch_and_length
    cu_seqlens, cu_seqlens_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_seqlens is None:
        cu_seqlens = cu_seqlens_k
    elif cu_seqlens_k is not None and cu_seqlens_k is not cu_seqlens and not torch.equal(cu_seqlens_k, cu_seqlens):
        raise ValueError("`cu_seq_lens_k` must equal `cu_seq_lens_q`: FoX attention is causal self-attention.")
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape != (B, past_length + T):
            raise ValueError(
                "FoX takes a 2-D `attention_mask` of 1s and 0s of shape (batch, past + new tokens) = "
                f"{(B, past_length + T)}, got shape {tuple(attention_mask.shape)}."
            )
        mask = attention_mask.bool()
        chunk = mask[:, -T:]
        # One host sync: whether anything is masked, in the chunk, and whether the chunk's masked tokens already
        # come first in every row (left padding).
        all_real, chunk_all_real, chunk_left_padded = torch.stack(
            [mask.all(), chunk.all(), (chunk[:, 1:] >= chunk[:, :-1]).all()]
        ).tolist()
        if not all_real:
            if cu_seqlens is not None:
                raise ValueError("Give packed documents (`cu_seq_lens_q`) or an `attention_mask` with 0s, not both.")
            return _masked_layout(mask, chunk, chunk_all_real, chunk_left_padded)
        if cu_seqlens is None:  # a mask of 1s only: position ids restarting at 0 then pack nothing, as in LLaMA
            return FoxAttentionLayout()
    if past_length > 0 or (cu_seqlens is None and position_ids is None):
        return FoxAttentionLayout()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(dtype=torch.int32)
        lengths = packed_sequence_lengths(cu_seqlens, B * T)
        doc_start = torch.zeros(B * T, dtype=torch.bool, device=cu_seqlens.device)
        doc_start[cu_seqlens[:-1].long()] = True
        doc_start = doc_start.view(B, T)
    else:
        doc_start = (position_ids == 0).expand(B, T).clone()
        doc_start[:, 0] = True
        starts = doc_start.flatten().nonzero().flatten()
        if starts.numel() == B:  # one document per row: nothing is packed
            return FoxAttentionLayout()
        cu_seqlens = torch.cat([starts, starts.new_tensor([B * T])]).to(torch.int32)
        lengths = packed_sequence_lengths(cu_seqlens, B * T)
    # `packed_sequence_lengths` syncs once per forward; the layers' attention calls then find the boundaries checked.
    return FoxAttentionLayout(cu_seqlens=cu_seqlens, max_seqlen=max(lengths), doc_start=doc_start)


def context_parallel_layout(cp, attention_mask, position_ids, inputs_embeds, kwargs):
    """The layout of the whole sequence for a rank that holds a slice (B, T / P) of it (`ContextParallel` cp), and
    the slice's position ids: the slices' masks and position ids are gathered, `cu_seq_lens_*` describe the whole
    sequence already. The attention reads the whole sequence's documents, the token shift the slice's starts."""
    B, T_local = inputs_embeds.shape[:2]
    whole_mask = None if attention_mask is None else cp.gather_sequence(attention_mask)
    whole_positions = None if position_ids is None else cp.gather_sequence(position_ids.expand(B, -1))
    layout = attention_layout(whole_mask, whole_positions, 0, (B, T_local * cp.size), kwargs)
    if layout.seq_start is not None:
        raise ValueError("Context parallelism takes no padding mask (an `attention_mask` with 0s): pack documents "
                         "(`position_ids` restarting at 0, as DataCollatorWithFlattening makes them) and give padding "
                         "the label -100 instead (foxlm.context_parallel.shard_batch pads that way).")
    if position_ids is None:
        position_ids = torch.arange(T_local, device=inputs_embeds.device) + cp.rank * T_local
        position_ids = position_ids.unsqueeze(0)
    doc_start = None if layout.doc_start is None else cp.local_tokens(layout.doc_start)
    return dataclasses.replace(layout, doc_start=doc_start, context_parallel=cp), position_ids


def _masked_layout(mask, chunk, chunk_all_real, chunk_left_padded):
    """The layout of a mask with 0s: (B, past + T) and its last T columns, `chunk`."""
    seq_start = (~mask).sum(-1)
    if chunk_all_real:
        return FoxAttentionLayout(seq_start=seq_start)
    order = None if chunk_left_padded else torch.argsort(chunk.to(torch.int8), dim=-1, stable=True)
    token_mask = chunk if order is None else chunk.gather(1, order)
    return FoxAttentionLayout(seq_start=seq_start, token_mask=token_mask, order=order)


class FoxForCausalLM(FoxPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: FoxConfig):
        super().__init__(config)
        self.model = FoxModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def create_masks_for_generate(self, config=None, inputs_embeds=None, attention_mask=None, **kwargs):
        """What generate() calls, with a static cache, instead of building LLaMA's 4-D mask: FoX reads the 2-D mask
        of the prompt and none afterwards (the static cache keeps each row's padding), so that every decode step
        has the same input shapes, as CUDA graphs need (a 2-D mask grows by a column per step)."""
        cache = kwargs.get(CACHE_ARG)
        if _filled_static_layer(cache) is None:
            return attention_mask
        # A later chunk of a chunked prefill (`prefill_chunk_size`): checked here, eagerly, since generate() may run
        # the forward compiled. Decode steps (one token) are not checked: they add no padding.
        chunk = inputs_embeds.shape[1] if inputs_embeds is not None else 1
        if chunk > 1 and attention_mask is not None and not bool(attention_mask[:, -chunk:].all()):
            padding = int((attention_mask == 0).sum(-1).max())
            raise ValueError(
                "A static FoX cache takes padding (0s in `attention_mask`) in the first chunk of the prompt only; "
                f"this prompt has up to {padding} padding tokens in a row: give `prefill_chunk_size` at least "
                f"{padding}, or use the dynamic cache."
            )
        return None

    @accepts_legacy_cache_arg
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Token ids for the language-modeling loss (shifted inside, -100 ignored); with `num_items_in_batch`
            (given by `Trainer`) the loss is a sum divided by that count, right under gradient accumulation.
            `shift_labels` (a keyword, already shifted: a context-parallel slice from `shard_batch`) replace them.
        logits_to_keep (`int` or `torch.Tensor`):
            Compute logits only for the last `logits_to_keep` positions (an int; 0 keeps all) or for the given
            sequence indices (a 1-D tensor).
        """
        check_forward_kwargs(type(self).__name__, kwargs)
        inputs = input_ids if input_ids is not None else inputs_embeds
        if torch.compiler.is_compiling() and _static_cache_prefill(cache, inputs):
            # generate() runs the chunks of a chunked prefill through its compiled forward too; they run eagerly
            # (what CUDA graphs store in the cache, the next replay would overwrite) and the graph stays the
            # one-token decode step's.
            return _eager_call(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               cache=cache, inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                               logits_to_keep=logits_to_keep, **kwargs)
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])

        loss = None
        if labels is not None or kwargs.get("shift_labels") is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **cache_kwargs(getattr(outputs, CACHE_ARG)),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class FoxForSequenceClassification(GenericForSequenceClassification, FoxPreTrainedModel):
    def __init__(self, config: FoxConfig):
        # The generic head builds its body with AutoModel, which Hub remote code cannot resolve: build it here.
        FoxPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = FoxModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()

    def enable_context_parallel(self, group):
        raise ValueError("FoxForSequenceClassification pools each row's last token, which only the last rank of a "
                         "context-parallel group holds: context parallelism is for FoxForCausalLM and FoxModel.")


__all__ = [
    "FoxForCausalLM",
    "FoxForSequenceClassification",
    "FoxModel",
    "FoxPreTrainedModel",
]
