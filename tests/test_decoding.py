"""Decoding through the FoX cache: the decode kernel inside generate(), the running gate sum at long lengths, ACP at
decode time and KV eviction."""

import math
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import DynamicCache

from foxlm import FoxCacheLayer
from foxlm.compat import CACHE_ARG
from foxlm.kernels.decode import forgetting_decode


def fast_forgetting_model(make_model, **overrides):
    """Tiny FoX Pro model (4 query heads, 2 KV heads) whose KV head 0 forgets within a few tokens (log f ~ -2.1)
    and KV head 1 barely forgets (log f ~ -0.0025)."""
    model = make_model(**overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.fgate_proj.bias.copy_(torch.tensor([-2.0, -2.0, 6.0, 6.0]))
    return model


def greedy(model, ids, steps, **kwargs):
    return model.generate(ids, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)


def test_incremental_decoding_through_the_triton_kernel_equals_full_forward(make_model):
    model = make_model(attention_backend="triton")  # the Triton interpreter on CPU
    ids = torch.randint(3, 97, (2, 14))
    cache = DynamicCache(config=model.config)
    pieces = [model(ids[:, :9], cache=cache, use_cache=True).logits]
    pieces.append(model(ids[:, 9:12], cache=cache, use_cache=True).logits)  # several new tokens
    for t in (12, 13):
        pieces.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    full = make_model(attention_backend="reference")(ids).logits
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-4)


def test_running_gate_sum_stays_precise_at_128k_cached_tokens():
    T, H, D = 131072, 2, 8
    torch.manual_seed(0)
    log_fgate = -3.0 + 0.1 * torch.rand(1, H, T + 1)  # |c| reaches ~4e5, where the fp32 ulp is 0.03
    keys, values = torch.randn(1, 1, T + 1, D), torch.randn(1, 1, T + 1, D)
    q = torch.randn(1, 1, H, D)
    c = log_fgate.double().cumsum(-1)
    scores = torch.einsum("bqhd,bkd->bhk", q.double(), keys[:, 0].double()) / math.sqrt(D) + c[..., -1:] - c
    exact = torch.einsum("bhk,bkd->bhd", scores.softmax(-1), values[:, 0].double())

    def decode_error(rebase_at):
        layer = FoxCacheLayer()
        layer.rebase_at = rebase_at
        layer.update_fox(keys[:, :, :T], values[:, :, :T], log_fgate[..., :T], None, None)
        layer.update_fox(keys[:, :, T:], values[:, :, T:], log_fgate[..., T:], None, None)
        (k, v, cumsum, _), = layer.kv_groups()
        out = forgetting_decode(q, k.transpose(1, 2), v.transpose(1, 2), cumsum.transpose(1, 2))
        return (out[:, 0].double() - exact).abs().max().item(), cumsum[..., -1].abs().max().item()

    error, newest = decode_error(FoxCacheLayer.rebase_at)
    assert error < 1e-5 and newest <= FoxCacheLayer.rebase_at
    assert decode_error(float("inf"))[0] > 100 * error  # without the rebase fp32 loses the recent differences


def test_acp_at_decode_time_keeps_greedy_generation(make_model):
    model = fast_forgetting_model(make_model)
    pruned = fast_forgetting_model(make_model, acp_eps=math.exp(-10))
    ids = torch.randint(3, 97, (2, 30))
    assert torch.equal(greedy(pruned, ids, 12), greedy(model, ids, 12))
    cache = DynamicCache(config=pruned.config)
    pruned(ids, cache=cache, use_cache=True)
    step = torch.randint(3, 97, (2, 1))
    expected = model(torch.cat([ids, step], dim=1)).logits[:, -1:]
    torch.testing.assert_close(pruned(step, cache=cache, use_cache=True).logits, expected,
                               rtol=1e-4, atol=1e-4)


def test_eviction_keeps_greedy_tokens_and_bounds_fast_heads(make_model, monkeypatch):
    monkeypatch.setattr(FoxCacheLayer, "check_interval", 8)
    monkeypatch.setattr(FoxCacheLayer, "eviction_min_keep", 4)
    model = fast_forgetting_model(make_model)
    evicting = fast_forgetting_model(make_model, decode_kv_eviction=True)
    prompts = [torch.randint(3, 97, (n,)) for n in (40, 25)]
    ids = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):  # a left-padded batch
        ids[b, 40 - len(p) :], mask[b, 40 - len(p) :] = p, 1
    out = greedy(evicting, ids, 120, attention_mask=mask, return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy(model, ids, 120, attention_mask=mask))
    for layer in getattr(out, CACHE_ARG).layers:
        fast, slow = (keys.shape[-2] for keys in layer.head_keys)
        # 40 prompt + 119 fed-back tokens; the fast head keeps its ~12-token window plus the check interval.
        assert layer.get_seq_length() == slow == 159 and fast <= 30


def test_eviction_needs_qk_norm(make_config):
    with pytest.raises((ValueError, StrictDataclassClassValidationError), match="qk_norm"):
        make_config(decode_kv_eviction=True, qk_norm=False)


def test_acp_without_qk_norm_bounds_scores_by_measured_norms(make_model):
    model = fast_forgetting_model(make_model, qk_norm=False)
    pruned = fast_forgetting_model(make_model, qk_norm=False, acp_eps=math.exp(-10))
    ids = torch.randint(3, 97, (1, 30))
    assert torch.equal(greedy(pruned, ids, 10), greedy(model, ids, 10))


def test_acp_bound_without_qk_norm_prunes_nothing_for_nan_queries(make_model):
    attention = fast_forgetting_model(make_model, qk_norm=False, acp_eps=math.exp(-10)).model.layers[0].self_attn
    q = torch.randn(1, 1, attention.num_heads, attention.head_dim)
    q[0, 0, 0, 0] = float("nan")
    cache_layer = SimpleNamespace(key_norm_max=torch.ones(1, attention.num_kv_heads))
    bound = attention._acp_bound(q, cache_layer)
    assert bound[0, 0].isinf() and bound[0, 1:].isfinite().all()  # delta = -inf: that head keeps every key


def test_eviction_keeps_assisted_decoding_exact(make_model, monkeypatch):
    monkeypatch.setattr(FoxCacheLayer, "check_interval", 8)
    model = fast_forgetting_model(make_model)
    evicting = fast_forgetting_model(make_model, decode_kv_eviction=True)
    assistant = make_model(seed=1, num_hidden_layers=1)
    ids = torch.randint(3, 97, (1, 50))
    assert torch.equal(greedy(evicting, ids, 30, assistant_model=assistant), greedy(model, ids, 30))
