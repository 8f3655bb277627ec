"""The FoX cache: what decoding needs of each layer (keys, values, the forget gate's running sum, the token-shift
state), built by transformers' `DynamicCache` from the config's layer types."""

import torch
from transformers.cache_utils import DynamicLayer, StaticLayer


class FoxCacheLayer(DynamicLayer):
    """KV cache of one FoX layer: keys and values, the forget gate's running sum, and the token-shift state.

    - `keys` / `values` (B, kv_heads, T, head_dim), after shift and QK-norm, as any `DynamicLayer`.
    - `fgate_cumsum` (B, heads, T) fp32: `c`, the inclusive cumulative sum of log f. A new chunk appends
      `last + cumsum(log f_new)`, so a decode step costs O(1) gate work instead of a sum over the whole cache.
      Only differences `c_q - c_k` matter, so when |c| grows past `rebase_at` every row is shifted by its newest
      value (exact; computed in float64 before rounding): fp32 then keeps the recent, relevant differences precise
      at any length (|c| ~ 1e5 at 128k tokens of strong decay would leave ~0.01 of error in every bias).
    - `key_norm_max` (B, kv_heads) fp32: the largest cached key norm, kept for decode-time ACP without QK-norm.
    - `shift_keys` / `shift_values` (B, 1, kv_heads, head_dim), only for models with a K/V shift: the raw (pre-shift)
      projections of the last token, the previous token of the next chunk's token shift. Once
      `activate_past_recording()` was called (assisted decoding), the raw projections are kept for every later token
      so that `crop` can roll the shift state back.

    With KV eviction (`FoxConfig.decode_kv_eviction`) the cache is stored per KV head instead: `head_keys[h]` /
    `head_values[h]` (B, 1, T_h, head_dim) and `head_fgate_cumsum[h]` (B, group, T_h) hold the last T_h tokens, the
    first `evicted[h]` having been dropped because ACP proves them negligible for every future query of every
    sequence and query head of the group. Heads that forget fast so keep a bounded cache while slow heads keep
    everything, and the memory is really freed (one tensor per KV head; a dense (B, kv_heads, T) tensor would be as
    long as its slowest head).
    """

    _layer_type = "fox_attention"
    is_static = False
    # Host-side checks (rebase, eviction) run at most every `check_interval` tokens: they need a device sync.
    check_interval = 64
    rebase_at = 1024.0
    # Eviction keeps at least the newest `eviction_min_keep` tokens of every head, so `crop` (assisted decoding)
    # can still roll back that many.
    eviction_min_keep = 32

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fgate_cumsum = self.key_norm_max = None
        self.head_keys = self.head_values = self.head_fgate_cumsum = self.evicted = None
        self.tokens_since_check = 0
        self.shift_keys = self.shift_values = None
        self.record_past = False
        self.raw_history = None  # {"keys": (B, n, kv_heads, D), "values": ...} raw projections of positions start..
        self.raw_history_start = 0

    def activate_past_recording(self):
        self.record_past = True

    def get_seq_length(self):
        if self.head_keys is not None:
            return self.evicted[0] + self.head_keys[0].shape[-2]
        return super().get_seq_length()

    def num_stored_tokens(self):
        """Tokens held per sequence, summed over KV heads (kv_heads * T without eviction)."""
        if self.head_keys is not None:
            return sum(keys.shape[-2] for keys in self.head_keys)
        return self.keys.shape[1] * self.keys.shape[-2] if self.get_seq_length() else 0

    def kv_groups(self):
        """(keys, values, fgate_cumsum, evicted) of each independently stored group of KV heads: one group of all
        heads, or one per KV head with eviction. keys/values (B, kv_heads, T, D), fgate_cumsum (B, heads, T)."""
        if self.head_keys is None:
            return [(self.keys, self.values, self.fgate_cumsum, 0)]
        return list(zip(self.head_keys, self.head_values, self.head_fgate_cumsum, self.evicted))

    def shift_state(self, name, like):
        """Raw projection (B, 1, kv_heads, D) of the token before the next chunk; zeros for an empty cache."""
        state = self.shift_keys if name == "keys" else self.shift_values
        return state if state is not None and self.get_seq_length() > 0 else torch.zeros_like(like[:, :1])

    def _append_cumsum(self, cumsum, log_fgate, check):
        """`cumsum` (B, H, T) fp32 or None, extended by the running sum of `log_fgate` (B, H, n); rebased if due."""
        if cumsum is not None and log_fgate.shape[-1] == 1 and not check:
            # One token: an fp32 add is the correctly rounded exact sum, as the float64 path would give.
            return torch.cat([cumsum, cumsum[..., -1:] + log_fgate], dim=-1)
        chunk = log_fgate.double().cumsum(-1)
        if cumsum is not None:
            chunk = chunk + cumsum[..., -1:].double()
        if check and bool(chunk[..., -1].abs().max() > self.rebase_at):
            shift = chunk[..., -1:]
            chunk = chunk - shift
            cumsum = None if cumsum is None else (cumsum.double() - shift).float()
        return chunk.float() if cumsum is None else torch.cat([cumsum, chunk.float()], dim=-1)

    def update_fox(self, key_states, value_states, log_fgate, raw_keys, raw_values, evict_delta=None,
                   track_key_norm=False, token_mask=None, seq_start=None):
        """Append a chunk of the sequence.

        key_states / value_states (B, kv_heads, T, D); log_fgate (B, heads, T) fp32; raw_keys / raw_values
        (B, T, kv_heads, D), the projections before the token shift, or None for a model without one;
        evict_delta (B, heads): ACP threshold valid for every future query (enables eviction), or None;
        track_key_norm: keep `key_norm_max` (ACP without QK-norm); token_mask (B, T) bool, False at the chunk's
        masked tokens, which come first in each row, or None; seq_start (B,): masked tokens of each row, cached and
        new. Rows are stored left-padded (masked tokens first): a chunk with masked tokens after earlier ones moves
        them to the front. Read the result through `kv_groups()`.
        """
        empty = self.get_seq_length() == 0
        if token_mask is not None and not empty and (self.head_keys is not None or self.record_past):
            raise NotImplementedError(
                "A FoX cache with KV eviction, or one that records its past for `crop` (assisted decoding), takes "
                "masked tokens (0s in `attention_mask`) in the first chunk (the prompt) only."
            )
        if empty:
            self.tokens_since_check = 0
        self.tokens_since_check += key_states.shape[-2]
        check = key_states.shape[-2] > 1 or self.tokens_since_check >= self.check_interval
        if check:
            self.tokens_since_check = 0
        if track_key_norm:
            norms = key_states.detach().float().norm(dim=-1).amax(-1)
            self.key_norm_max = norms if empty else torch.maximum(self.key_norm_max, norms)
        if self.head_keys is None:
            self.update(key_states, value_states)
            self.fgate_cumsum = self._append_cumsum(None if empty else self.fgate_cumsum, log_fgate, check)
            if token_mask is not None and not empty:
                self._move_masked_first(token_mask, seq_start)
        else:
            group = log_fgate.shape[1] // len(self.head_keys)
            for h in range(len(self.head_keys)):
                self.head_keys[h] = torch.cat([self.head_keys[h], key_states[:, h : h + 1]], dim=-2)
                self.head_values[h] = torch.cat([self.head_values[h], value_states[:, h : h + 1]], dim=-2)
                self.head_fgate_cumsum[h] = self._append_cumsum(
                    self.head_fgate_cumsum[h], log_fgate[:, h * group : (h + 1) * group], check
                )
        if evict_delta is not None and check:
            self._evict(evict_delta)
        if raw_keys is None:
            return
        self.shift_keys, self.shift_values = raw_keys[:, -1:], raw_values[:, -1:]
        if self.record_past:
            if self.raw_history is None:
                self.raw_history_start = self.get_seq_length() - key_states.shape[-2]
                self.raw_history = {"keys": raw_keys, "values": raw_values}
            else:
                self.raw_history = {
                    "keys": torch.cat([self.raw_history["keys"], raw_keys], dim=1),
                    "values": torch.cat([self.raw_history["values"], raw_values], dim=1),
                }

    def _move_masked_first(self, token_mask, seq_start):
        """Reorder every row so that its masked tokens come first again, the others keeping their order.

        Before: [masked, real] of the earlier chunks, then [masked, real] of the new chunk of T tokens."""
        S, T = self.keys.shape[-2], token_mask.shape[1]
        positions = torch.arange(S - T, device=seq_start.device)
        earlier_real = positions >= (seq_start - (~token_mask).sum(-1))[:, None]
        order = torch.argsort(torch.cat([earlier_real, token_mask], dim=-1).to(torch.int8), dim=-1, stable=True)
        take = lambda t: t.gather(-2, order[:, None, :, None].expand_as(t))  # noqa: E731
        self.keys, self.values = take(self.keys), take(self.values)
        c = self.fgate_cumsum.gather(-1, order[:, None, :].expand_as(self.fgate_cumsum))
        # Masked positions carry no decay of their own; give them the row's first real value, so that c stays
        # non-increasing along each row as the pruning searches assume.
        first_real = c.gather(-1, seq_start.clamp(max=S - 1)[:, None, None].expand(-1, c.shape[1], 1))
        self.fgate_cumsum = torch.where(torch.arange(S, device=c.device) < seq_start[:, None, None], first_real, c)

    def _evict(self, delta):
        """Drop, per KV head, the oldest keys with `c_newest - c_k < delta` for every sequence and query head of the
        group. Later queries have smaller c (c never increases), so those keys stay pruned for good."""
        if self.head_keys is None:
            num_kv_heads = self.keys.shape[1]
            self.head_keys = list(self.keys.split(1, dim=1))
            self.head_values = list(self.values.split(1, dim=1))
            self.head_fgate_cumsum = list(self.fgate_cumsum.split(self.fgate_cumsum.shape[1] // num_kv_heads, dim=1))
            self.evicted = [0] * num_kv_heads
            self.keys = self.values = self.fgate_cumsum = None
        group = self.head_fgate_cumsum[0].shape[1]
        # c is non-increasing along T, so the pruned keys of a row are a prefix: count them.
        pruned = torch.stack([
            ((c[..., -1:] - c) < delta[:, h * group : (h + 1) * group, None]).sum(-1).amin()
            for h, c in enumerate(self.head_fgate_cumsum)
        ]).tolist()
        for h, drop in enumerate(pruned):
            drop = min(drop, self.head_keys[h].shape[-2] - self.eviction_min_keep)
            if drop > 0:
                # Views for now; the next append copies only the kept part and the dropped memory is released.
                self.head_keys[h] = self.head_keys[h][..., drop:, :]
                self.head_values[h] = self.head_values[h][..., drop:, :]
                self.head_fgate_cumsum[h] = self.head_fgate_cumsum[h][..., drop:]
                self.evicted[h] += drop

    def reset(self):
        super().reset()
        self.fgate_cumsum = self.key_norm_max = self.shift_keys = self.shift_values = self.raw_history = None
        self.head_keys = self.head_values = self.head_fgate_cumsum = self.evicted = None

    def crop(self, tokens_to_remove):
        length = self.get_seq_length()
        if tokens_to_remove > 0:  # transformers < 5.18 passed the length to keep
            tokens_to_remove = max(0, length - tokens_to_remove)
        tokens_to_remove = min(abs(tokens_to_remove), length)
        if tokens_to_remove == 0:
            return
        new_length = length - tokens_to_remove
        if self.head_keys is None:
            self.keys, self.values = self.keys[..., :new_length, :], self.values[..., :new_length, :]
            self.fgate_cumsum = self.fgate_cumsum[..., :new_length]
        else:
            if any(new_length < evicted for evicted in self.evicted):
                raise RuntimeError(f"Cannot crop a FoX cache to {new_length} tokens: earlier tokens were evicted.")
            for h, evicted in enumerate(self.evicted):
                keep = new_length - evicted
                self.head_keys[h] = self.head_keys[h][..., :keep, :]
                self.head_values[h] = self.head_values[h][..., :keep, :]
                self.head_fgate_cumsum[h] = self.head_fgate_cumsum[h][..., :keep]
        if self.shift_keys is None:
            return
        last = new_length - 1 - self.raw_history_start
        if new_length > 0 and (self.raw_history is None or not 0 <= last < self.raw_history["keys"].shape[1]):
            raise RuntimeError(
                "Cannot crop a FoX cache without the raw projections of the new last token: call "
                "`activate_past_recording()` before the tokens to crop are added."
            )
        if new_length == 0:
            self.shift_keys = self.shift_values = self.raw_history = None
            return
        self.raw_history = {name: raw[:, : last + 1] for name, raw in self.raw_history.items()}
        self.shift_keys = self.raw_history["keys"][:, last : last + 1]
        self.shift_values = self.raw_history["values"][:, last : last + 1]

    def _map_state(self, fn, include_kv=True):
        """Apply `fn` to every per-sequence tensor the layer holds (batch ops, beam reordering, offloading)."""
        if self.get_seq_length() == 0:
            return
        if self.head_keys is None:
            if include_kv:
                self.keys, self.values = fn(self.keys), fn(self.values)
            self.fgate_cumsum = fn(self.fgate_cumsum)
        else:
            for tensors in (self.head_keys, self.head_values, self.head_fgate_cumsum):
                tensors[:] = [fn(t) for t in tensors]
        if self.key_norm_max is not None:
            self.key_norm_max = fn(self.key_norm_max)
        if self.shift_keys is not None:
            self.shift_keys, self.shift_values = fn(self.shift_keys), fn(self.shift_values)
        if self.raw_history is not None:
            self.raw_history = {name: fn(raw) for name, raw in self.raw_history.items()}

    def reorder_cache(self, beam_idx):
        self._map_state(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats):
        self._map_state(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        self._map_state(lambda t: t[indices])

    def offload(self):
        if self.head_keys is None:
            super().offload()
        self._map_state(lambda t: t.to("cpu", non_blocking=True), include_kv=False)

    def prefetch(self):
        if self.head_keys is None:
            super().prefetch()
        self._map_state(lambda t: t.to(self.device, non_blocking=True), include_kv=False)


class FoxStaticCacheLayer(StaticLayer):
    """The static twin of `FoxCacheLayer` (`generate(..., cache_implementation="static")`, which transformers builds
    as a `StaticCache` of these): the same state in buffers preallocated for `max_cache_len` tokens, written in place,
    so a decode step has fixed shapes, fixed addresses (CUDA graphs) and no host sync.

    - `keys` / `values` (B, kv_heads, max_cache_len, head_dim) and `cumulative_length`, the filled length as a
      device tensor, as transformers' `StaticLayer`; attention reads the filled part only (`kv_len` of the decode
      kernel). The buffers are allocated by the first chunk, the prompt.
    - `fgate_cumsum` (B, heads, max_cache_len) float64: the dynamic cache rebases its fp32 sum when a host check
      finds it large; here that check would sync every step (or recompile on a counter), and rebasing on the device
      every step would rewrite the whole buffer. float64 instead keeps `c_q - c_k` exact to ~1e-16 * |c| at any
      length the cache can hold, for 4 bytes more per key and query head.
    - `key_norm_max` (B, kv_heads) fp32, `shift_keys` / `shift_values` (B, 1, kv_heads, head_dim) as in the dynamic
      cache; `seq_start` (B,): each row's masked tokens, all in the prompt (later chunks take no masked tokens).
    - KV eviction (`FoxConfig.decode_kv_eviction`) cannot free memory from fixed buffers: the attention runs with
      ACP on instead, so the prefix eviction would drop is skipped, never read, by the decode kernel.

    Whether the layer holds tokens is a Python flag (`filled`), set by the prompt: it never changes during decoding,
    so a compiled step is not recompiled as the cache fills.
    """

    _layer_type = "fox_attention"
    is_static = True

    def __init__(self, max_cache_len, **kwargs):
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self.fgate_cumsum = self.key_norm_max = self.shift_keys = self.shift_values = self.seq_start = None
        self.filled = False

    def _allocate(self, key_states, value_states, log_fgate, raw_keys, track_key_norm):
        if not self.is_initialized:  # generate()'s chunked prefill allocates keys and values ahead
            super().lazy_initialization(key_states, value_states)
        B, heads = log_fgate.shape[:2]
        self.fgate_cumsum = log_fgate.new_zeros(B, heads, self.max_cache_len, dtype=torch.float64)
        buffers = [self.fgate_cumsum]
        if track_key_norm:
            self.key_norm_max = key_states.new_zeros(key_states.shape[:2], dtype=torch.float32)
            buffers.append(self.key_norm_max)
        if raw_keys is not None:
            self.shift_keys, self.shift_values = torch.zeros_like(raw_keys[:, :1]), torch.zeros_like(raw_keys[:, :1])
            buffers += [self.shift_keys, self.shift_values]
        for buffer in buffers:  # as `StaticLayer` does for its own: CUDA graphs need fixed addresses
            torch._dynamo.mark_static_address(buffer)

    def get_seq_length(self):
        return self.cumulative_length if self.filled else 0

    def num_stored_tokens(self):
        """Tokens held per sequence, summed over KV heads: the buffers' capacity, filled or not."""
        return self.keys.shape[1] * self.max_cache_len if self.is_initialized else 0

    def kv_groups(self):
        """(keys, values, fgate_cumsum, evicted) as `FoxCacheLayer.kv_groups`, the whole buffers: read them up to
        `cumulative_length`."""
        return [(self.keys, self.values, self.fgate_cumsum, 0)]

    def shift_state(self, name, like):
        state = self.shift_keys if name == "keys" else self.shift_values
        return state if self.filled and state is not None else torch.zeros_like(like[:, :1])

    def update_fox(self, key_states, value_states, log_fgate, raw_keys, raw_values, evict_delta=None,
                   track_key_norm=False, token_mask=None, seq_start=None):
        """Append a chunk; arguments as `FoxCacheLayer.update_fox` (`evict_delta` must be None: see the class)."""
        T = key_states.shape[-2]
        if evict_delta is not None:
            raise ValueError("a static FoX cache does not evict; its attention skips the evictable keys with ACP.")
        if self.filled and token_mask is not None:
            raise NotImplementedError("A static FoX cache takes masked tokens (0s in `attention_mask`) in the first "
                                      "chunk (the prompt) only.")
        if not self.filled:
            if T > self.max_cache_len:
                raise ValueError(f"A prompt of {T} tokens does not fit a static cache of max_cache_len="
                                 f"{self.max_cache_len}.")
            if self.fgate_cumsum is None:
                self._allocate(key_states, value_states, log_fgate, raw_keys, track_key_norm)
            self.seq_start = None if seq_start is None else seq_start.clone()
        chunk = log_fgate.double().cumsum(-1)
        if self.filled:
            last = self.fgate_cumsum.index_select(-1, (self.cumulative_length - 1).reshape(1))
            chunk = chunk + last
        positions = torch.arange(T, device=self.device) + self.cumulative_length
        self.fgate_cumsum.index_copy_(-1, positions, chunk)
        if self.key_norm_max is not None:
            norms = key_states.detach().float().norm(dim=-1).amax(-1)
            self.key_norm_max.copy_(torch.maximum(self.key_norm_max, norms) if self.filled else norms)
        if self.shift_keys is not None:
            self.shift_keys.copy_(raw_keys[:, -1:])
            self.shift_values.copy_(raw_values[:, -1:])
        self.update(key_states, value_states)  # keys, values and `cumulative_length`, in place
        self.filled = True

    def filled_part(self):
        """(keys, values, fgate_cumsum) up to the filled length, for a chunk too long for the decode kernel: reads
        the length on the host (one sync), and rebases the running sum to fp32 at the newest token (exact)."""
        n = int(self.cumulative_length)
        c = self.fgate_cumsum[..., :n]
        return self.keys[..., :n, :], self.values[..., :n, :], (c - c[..., -1:]).float()

    def reset(self):
        super().reset()
        for buffer in (self.fgate_cumsum, self.key_norm_max, self.shift_keys, self.shift_values):
            if buffer is not None:
                buffer.zero_()
        self.seq_start = None
        self.filled = False

    def crop(self, tokens_to_remove):
        if self.shift_keys is not None:
            raise NotImplementedError("A static FoX cache with a token shift cannot be cropped: it keeps no raw "
                                      "projections of earlier tokens to restore the shift state from.")
        length = int(self.get_seq_length())
        if tokens_to_remove > 0:  # transformers < 5.18 passed the length to keep
            tokens_to_remove = max(0, length - tokens_to_remove)
        tokens_to_remove = min(abs(tokens_to_remove), length)
        self.cumulative_length.sub_(tokens_to_remove)  # the stale tail is overwritten by the next chunk
        self.filled = length > tokens_to_remove

    def reorder_cache(self, beam_idx):
        """Beam search: reorder every per-sequence buffer in place (their addresses stay fixed)."""
        if not self.filled:
            return
        for buffer in (self.keys, self.values, self.fgate_cumsum, self.key_norm_max, self.shift_keys,
                       self.shift_values, self.seq_start):
            if buffer is not None:
                buffer.copy_(buffer.index_select(0, beam_idx.to(buffer.device)))


FOX_CACHE_LAYERS = (FoxCacheLayer, FoxStaticCacheLayer)

__all__ = ["FOX_CACHE_LAYERS", "FoxCacheLayer", "FoxStaticCacheLayer"]
