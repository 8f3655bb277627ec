"""Every 2-D attention mask LLaMA takes: a masked token (a 0 anywhere, left, right or between real tokens)
contributes neither attention nor decay, so real tokens get the logits of their sequence with the masked tokens
removed, in one forward, chunk by chunk against the cache, and in generate()."""

import pytest
import torch
from transformers import DynamicCache, pipeline

from conftest import byte_tokenizer

BACKENDS = ["reference", "triton"]  # the Triton kernels run in the interpreter on the CPU


def masked_batch(seed=0):
    """ids and a mask whose rows are: all real, left-padded, right-padded, holes everywhere, one real token."""
    torch.manual_seed(seed)
    ids = torch.randint(3, 97, (5, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, -3:] = 0
    mask[3, [0, 2, 3, 6, 10]] = 0
    mask[4, :] = 0
    mask[4, 5] = 1
    return ids, mask


def position_ids_of(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


def assert_logits_of_sequences_without_masked_tokens(logits, ids, mask, reference, atol=1e-5):
    """`logits` at the real tokens equal the float64 model's on each sequence with its masked tokens removed."""
    assert torch.isfinite(logits).all()
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        alone = reference(ids[b, real][None]).logits[0]
        torch.testing.assert_close(logits[b, real].double(), alone, rtol=0, atol=atol)


def float64_twin(make_model, **overrides):
    return make_model(attention_backend="reference", **overrides).double()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use_rope", [False, True])
def test_masked_tokens_are_removed_from_a_forward(make_model, backend, use_rope):
    model = make_model(attention_backend=backend, use_rope=use_rope)
    ids, mask = masked_batch()
    logits = model(ids, attention_mask=mask, position_ids=position_ids_of(mask)).logits
    assert_logits_of_sequences_without_masked_tokens(logits, ids, mask, float64_twin(make_model, use_rope=use_rope))


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_tokens_are_removed_chunk_by_chunk_against_the_cache(make_model, backend):
    """A prompt with holes, a chunk with holes after it (the cache moves the chunk's masked tokens before the
    cached real ones), then decode steps, one of them masked."""
    model = make_model(attention_backend=backend)
    ids, mask = masked_batch()
    more_ids = torch.randint(3, 97, (ids.shape[0], 6))
    more_mask = torch.ones_like(more_ids)
    more_mask[0, 1] = more_mask[2, :2] = more_mask[3, 2] = more_mask[1, 4] = 0
    all_ids, all_mask = torch.cat([ids, more_ids], 1), torch.cat([mask, more_mask], 1)
    cache = DynamicCache(config=model.config)
    T = ids.shape[1]
    chunks = [(0, T), (T, T + 3), (T + 3, T + 4), (T + 4, T + 5), (T + 5, T + 6)]
    logits = torch.cat([
        model(all_ids[:, a:b], attention_mask=all_mask[:, :b], cache=cache, use_cache=True).logits
        for a, b in chunks
    ], dim=1)
    assert cache.get_seq_length() == all_ids.shape[1]
    assert_logits_of_sequences_without_masked_tokens(logits, all_ids, all_mask, float64_twin(make_model))


def test_a_decode_step_after_a_right_padded_prompt_does_not_see_the_pads(make_model):
    model = make_model()
    prompt = torch.randint(3, 97, (1, 5))
    padded = torch.cat([prompt, torch.zeros(1, 3, dtype=torch.long)], 1)
    mask = torch.tensor([[1] * 5 + [0] * 3 + [1]])
    cache = DynamicCache(config=model.config)
    model(padded, attention_mask=mask[:, :8], cache=cache, use_cache=True)
    step = model(torch.tensor([[42]]), attention_mask=mask, cache=cache, use_cache=True).logits
    alone = float64_twin(make_model)(torch.cat([prompt, torch.tensor([[42]])], 1)).logits[:, -1:]
    torch.testing.assert_close(step.double(), alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mode", ["greedy", "sample", "beam"])
def test_cached_generation_of_a_padded_batch_equals_uncached_recompute(make_model, side, mode):
    model = make_model()
    prompts = [torch.randint(3, 97, (n,)) for n in (7, 3, 5)]
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        where = slice(T - len(p), T) if side == "left" else slice(0, len(p))
        ids[b, where], mask[b, where] = p, 1
    kwargs = dict(greedy=dict(do_sample=False), sample=dict(do_sample=True, top_k=0),
                  beam=dict(do_sample=False, num_beams=3, num_return_sequences=2))[mode]
    kwargs.update(attention_mask=mask, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(7)
    cached = model.generate(ids, **kwargs)
    torch.manual_seed(7)
    assert torch.equal(cached, model.generate(ids, use_cache=False, **kwargs))


def test_text_generation_pipeline_equals_uncached_generation_with_either_padding(make_model):
    tokenizer = byte_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    model = make_model(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    prompts = ["def f(x):", "a"]
    kwargs = dict(batch_size=2, max_new_tokens=5, do_sample=False, return_full_text=False)
    for side in ("left", "right"):
        tokenizer.padding_side = side
        cached = generator(prompts, **kwargs)
        assert cached == generator(prompts, use_cache=False, **kwargs)
    ids = tokenizer(prompts[0], return_tensors="pt").input_ids  # the longest prompt is not padded
    for _ in range(5):
        ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    # the pipeline drops special tokens, which an untrained model may generate
    assert cached[0][0]["generated_text"] == tokenizer.decode(ids[0, -5:], skip_special_tokens=True)


def test_masked_tokens_after_the_prompt_are_refused_by_an_evicting_cache(make_model):
    model = make_model(decode_kv_eviction=True)
    cache = DynamicCache(config=model.config)
    model(torch.randint(3, 97, (1, 4)), cache=cache, use_cache=True)
    cache.layers[0]._evict(torch.full((1, 4), -1e9))  # switch to per-head storage, dropping nothing
    with pytest.raises(NotImplementedError, match="first chunk"):
        model(torch.randint(3, 97, (1, 2)), attention_mask=torch.tensor([[1, 1, 1, 1, 0, 1]]), cache=cache,
              use_cache=True)


def test_a_mask_of_the_wrong_shape_is_refused(make_model):
    with pytest.raises(ValueError, match=r"attention_mask.*\(1, 5\)"):
        make_model()(torch.ones(1, 5, dtype=torch.long), attention_mask=torch.ones(1, 4, dtype=torch.long))


@pytest.mark.gpu
def test_masked_tokens_are_removed_on_the_gpu_in_prefill_and_decode(make_model):
    """The Triton prefill and decode kernels on a GPU (fp32, TF32 products), against the float64 CPU model."""
    model = make_model(head_dim=16).cuda()
    ids, mask = masked_batch()
    more_ids = torch.randint(3, 97, (ids.shape[0], 4))
    more_mask = torch.ones_like(more_ids)
    more_mask[0, 1] = more_mask[2, :2] = 0
    all_ids, all_mask = torch.cat([ids, more_ids], 1), torch.cat([mask, more_mask], 1)
    cache = DynamicCache(config=model.config)
    T = ids.shape[1]
    chunks = [(0, T), (T, T + 2), (T + 2, T + 3), (T + 3, T + 4)]
    logits = torch.cat([
        model(all_ids[:, a:b].cuda(), attention_mask=all_mask[:, :b].cuda(), cache=cache, use_cache=True).logits
        for a, b in chunks
    ], dim=1).cpu()
    assert_logits_of_sequences_without_masked_tokens(logits, all_ids, all_mask,
                                                     float64_twin(make_model, head_dim=16), atol=5e-3)
