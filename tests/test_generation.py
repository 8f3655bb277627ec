"""Cached generation equals the uncached forward in every mode generate() offers."""

import pytest
import torch
from transformers import DynamicCache

from foxlm import FoxCacheLayer
from foxlm.compat import CACHE_ARG


def greedy_without_cache(model, ids, steps):
    for _ in range(steps):
        next_token = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_token], dim=-1)
    return ids


def test_generate_builds_fox_cache_layers(make_model):
    model = make_model()
    out = model.generate(torch.randint(3, 97, (1, 5)), max_new_tokens=3, do_sample=False,
                         return_dict_in_generate=True)
    assert all(isinstance(layer, FoxCacheLayer) for layer in getattr(out, CACHE_ARG).layers)
    assert getattr(out, CACHE_ARG).get_seq_length() == 7


ROPE = {"no-rope": {}, "partial-rope": dict(use_rope=True, rope_max_wavelength=50.0),
        "clamped-slow-pairs": dict(use_rope=True, rope_max_wavelength=6.0, rope_slow_pairs="clamp"),
        "interpolated-slow-pairs": dict(use_rope=True, rope_max_wavelength=6.0, rope_slow_pairs="interpolate",
                                        rope_slow_pairs_factor=4.0),
        "compressed-slow-pairs": dict(use_rope=True, rope_max_wavelength=6.0, rope_slow_pairs="compress",
                                      rope_slow_pairs_factor=4.0),
        "compressed-slow-pairs-from-8": dict(use_rope=True, rope_max_wavelength=4.0, rope_slow_pairs="compress",
                                             rope_slow_pairs_factor=4.0, rope_slow_pairs_start=8.0),
        "compressed-slow-pairs-logn-scaling": dict(use_rope=True, rope_max_wavelength=6.0, rope_slow_pairs="compress",
                                                   rope_slow_pairs_factor=4.0, logn_scaling_context=4, acp_eps=None)}


@pytest.mark.parametrize("rope", ROPE.values(), ids=ROPE.keys())
@pytest.mark.parametrize("chunks", [[1] * 12, [5, 1, 4, 2], [12]])
def test_incremental_forward_equals_full_forward(make_model, chunks, rope):
    model = make_model(**rope)
    ids = torch.randint(3, 97, (2, sum(chunks)))
    full = model(ids).logits
    cache = DynamicCache(config=model.config)
    pieces, start = [], 0
    for n in chunks:
        pieces.append(model(ids[:, start : start + n], cache=cache, use_cache=True).logits)
        start += n
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rope", ROPE.values(), ids=ROPE.keys())
def test_greedy_generation_equals_uncached_argmax(make_model, rope):
    model = make_model(**rope)
    ids = torch.randint(3, 97, (2, 6))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, greedy_without_cache(model, ids, 8))


def test_sampling_with_a_seed_equals_uncached_sampling(make_model):
    model = make_model()
    ids = torch.randint(3, 97, (1, 6))
    kwargs = dict(max_new_tokens=8, do_sample=True, top_k=0, num_return_sequences=3, eos_token_id=None,
                  pad_token_id=0)
    torch.manual_seed(123)
    cached = model.generate(ids, **kwargs)
    torch.manual_seed(123)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


def test_beam_search_equals_uncached_beam_search(make_model):
    model = make_model()
    ids = torch.randint(3, 97, (2, 5))
    kwargs = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False, eos_token_id=None,
                  pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), model.generate(ids, use_cache=False, **kwargs))


def test_assisted_decoding_with_a_fox_assistant_equals_greedy(make_model):
    model = make_model(seed=0)
    assistant = make_model(seed=1, num_hidden_layers=1)
    ids = torch.randint(3, 97, (1, 6))
    kwargs = dict(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    assisted = model.generate(ids, assistant_model=assistant, **kwargs)
    assert torch.equal(assisted, greedy_without_cache(model, ids, 10))


@pytest.mark.parametrize("positions", [{}, dict(logn_scaling_context=3, acp_eps=None)], ids=["gates", "logn-scaling"])
def test_left_padded_batch_generates_what_each_prompt_generates_alone(make_model, positions):
    model = make_model(**positions)
    prompts = [torch.randint(3, 97, (n,)) for n in (7, 3, 5)]
    T = max(len(p) for p in prompts)
    ids = torch.randint(3, 97, (len(prompts), T))
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :], mask[b, T - len(p) :] = p, 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    for b, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(out[b, T:], alone[0, len(p) :])


def test_crop_rolls_back_every_piece_of_state(make_model):
    model = make_model()
    ids = torch.randint(3, 97, (1, 14))
    cache = DynamicCache(config=model.config)
    model(ids[:, :6], cache=cache, use_cache=True)
    cache.activate_past_recording()
    model(ids[:, 6:11], cache=cache, use_cache=True)
    cache.crop(-3)
    assert cache.get_seq_length() == 8
    logits = model(ids[:, 8:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(logits, model(ids).logits[:, 8:], rtol=1e-5, atol=1e-5)


def test_crop_without_recording_the_shift_state_is_refused(make_model):
    model = make_model()
    cache = DynamicCache(config=model.config)
    model(torch.randint(3, 97, (1, 6)), cache=cache, use_cache=True)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        cache.crop(-2)


def test_reorder_and_batch_select_carry_the_gate_and_shift_state(make_model):
    model = make_model()
    ids = torch.randint(3, 97, (3, 9))
    cache = DynamicCache(config=model.config)
    model(ids[:, :6], cache=cache, use_cache=True)
    order = torch.tensor([2, 0, 1])
    cache.reorder_cache(order)
    logits = model(ids[order, 6:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(logits, model(ids[order]).logits[:, 6:], rtol=1e-5, atol=1e-5)
    cache.batch_select_indices(torch.tensor([1]))
    cache.batch_repeat_interleave(2)
    logits = model(ids[[0, 0], 9:].new_tensor([[5], [7]]), cache=cache, use_cache=True).logits
    expected = model(torch.cat([ids[[0, 0]], torch.tensor([[5], [7]])], dim=1)).logits[:, -1:]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_a_cache_without_fox_layers_is_refused_clearly(make_model):
    with pytest.raises(TypeError, match="FoxCacheLayer"):
        make_model()(torch.randint(3, 97, (1, 4)), cache=DynamicCache(), use_cache=True)
