"""The static FoX cache (`cache_implementation="static"`): the same tokens and the same state as the dynamic cache,
and a decode step that torch.compile traces as one graph, compiled once for every step."""

import pytest
import torch
from transformers import DynamicCache, StaticCache, pipeline

from foxlm import FoxStaticCacheLayer
from foxlm.compat import CACHE_ARG
from tests.conftest import byte_tokenizer, counting_backend

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
VARIANTS = {
    "pro": {},  # token shift, QK-norm, output norm and gate, GQA 4/2
    "plain": dict(use_k_shift=False, use_v_shift=False, qk_norm=False, use_output_norm=False,
                  use_output_gate=False, num_key_value_heads=4),
    "acp": dict(acp_eps=1e-4),
    "acp_without_qk_norm": dict(acp_eps=1e-4, qk_norm=False),  # the cache tracks key norms
    "eviction": dict(decode_kv_eviction=True),
    "logn_scaling": dict(logn_scaling_context=4, acp_eps=None),  # a step's query scale from its position
    # a step's rotation from its position: the slow pairs of the cut at 2 compressed past position 6
    "slow_pairs_start": dict(use_rope=True, rope_max_wavelength=2.0, rope_slow_pairs="compress",
                             rope_slow_pairs_factor=4.0, rope_slow_pairs_start=6.0),
}


def counting_compile_config(graphs, fullgraph):
    """generate()'s compile settings on the CPU too, with a backend that appends every graph it compiles to `graphs`
    (`counting_backend`)."""
    from transformers import CompileConfig

    config = CompileConfig(backend=counting_backend(graphs), fullgraph=fullgraph, mode=None)
    config._compile_all_devices = True  # generate() compiles on CUDA only by default
    return config


def left_padded_batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(3, 97, (len(lengths), T), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, T - n :] = 1
    return ids, mask


@pytest.mark.parametrize("variant", VARIANTS)
def test_static_cache_generates_what_the_dynamic_cache_generates(make_model, variant):
    model = make_model(**VARIANTS[variant])
    ids, mask = left_padded_batch([9, 4, 7])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, **GREEDY)
    static = model.generate(ids, cache_implementation="static", return_dict_in_generate=True, **kwargs)
    assert all(isinstance(layer, FoxStaticCacheLayer) for layer in getattr(static, CACHE_ARG).layers)
    assert torch.equal(static.sequences, model.generate(ids, **kwargs))


@pytest.mark.parametrize("variant", ["pro", "plain"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_chunked_prefill_generates_what_one_prefill_generates(make_model, variant, cache):
    """generate(prefill_chunk_size=...) feeds a long prompt in chunks, the way to fit a large batch's prefill; with a
    static cache transformers allocates the cache's keys and values before the first chunk."""
    model = make_model(**VARIANTS[variant])
    ids, mask = left_padded_batch([21, 9, 16])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, **GREEDY,
                  **({"cache_implementation": "static"} if cache == "static" else {}))
    assert torch.equal(model.generate(ids, prefill_chunk_size=12, **kwargs), model.generate(ids, **kwargs))
    if cache == "static":  # the 9-token row's 12 padding tokens reach into the second chunk of 8
        with pytest.raises(ValueError, match="prefill_chunk_size` at least 12"):
            model.generate(ids, prefill_chunk_size=8, **kwargs)
    else:
        assert torch.equal(model.generate(ids, prefill_chunk_size=8, **kwargs), model.generate(ids, **kwargs))


def test_chunked_prefill_of_a_left_padded_batch_on_the_triton_kernels(make_model):
    """A static cache's later prefill chunk (more than the decode kernel's queries) goes through the Triton attention
    with the cache's running gate sum, rebased at its newest token (`filled_part`), so not 0 in the left padding: the
    kernels must read that c, not zeros, where a key-bias segment starts in the padding (Triton's interpreter, where
    segments are 32 positions long; on a GPU the same with 128). Rows 1 and 2 differed at their first new token."""
    pytest.importorskip("triton")
    model = make_model(attention_backend="triton")
    ids, mask = left_padded_batch([40, 20, 30])
    kwargs = dict(attention_mask=mask, max_new_tokens=2, **GREEDY)
    chunked = model.generate(ids, cache_implementation="static", prefill_chunk_size=20, **kwargs)
    assert torch.equal(chunked, model.generate(ids, **kwargs))


def test_text_generation_pipeline_gives_the_same_text_with_either_cache(make_model):
    tokenizer = byte_tokenizer()
    tokenizer.pad_token, tokenizer.padding_side = tokenizer.eos_token, "left"
    model = make_model(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    kwargs = dict(batch_size=2, max_new_tokens=6, do_sample=False, return_full_text=False)
    prompts = ["def f(x):", "a"]
    assert generator(prompts, cache_implementation="static", **kwargs) == generator(prompts, **kwargs)


@pytest.mark.parametrize("variant", ["pro", "acp_without_qk_norm", "logn_scaling"])
def test_static_state_equals_the_dynamic_state(make_model, variant):
    model = make_model(**VARIANTS[variant])
    ids, mask = left_padded_batch([8, 5])
    ids = torch.cat([ids, torch.randint(3, 97, (2, 5))], dim=1)
    mask = torch.cat([mask, torch.ones(2, 5, dtype=mask.dtype)], dim=1)
    dynamic, static = DynamicCache(config=model.config), StaticCache(config=model.config, max_cache_len=20)
    for cache in (dynamic, static):
        for start, stop in ((0, 8), (8, 9), (9, 12), (12, 13)):  # the prompt, then decode steps of 1 and 3 tokens
            model(ids[:, start:stop], attention_mask=mask[:, :stop], cache=cache, use_cache=True)
    assert int(static.get_seq_length()) == dynamic.get_seq_length() == 13
    # Equal up to rounding: the static cache's float64 running sum rounds the attention's bias differently, which
    # reaches the next layer's keys.
    for d, s in zip(dynamic.layers, static.layers):
        torch.testing.assert_close(s.keys[..., :13, :], d.keys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s.values[..., :13, :], d.values, rtol=1e-5, atol=1e-6)
        assert s.fgate_cumsum.dtype == torch.float64
        torch.testing.assert_close(s.fgate_cumsum[..., :13].float(), d.fgate_cumsum, rtol=1e-6, atol=1e-6)
        assert not s.fgate_cumsum[..., 13:].any()
        if s.shift_keys is not None:
            torch.testing.assert_close(s.shift_keys, d.shift_keys, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s.shift_values, d.shift_values, rtol=1e-5, atol=1e-6)
        if d.key_norm_max is not None:
            torch.testing.assert_close(s.key_norm_max, d.key_norm_max)
        assert torch.equal(s.seq_start, torch.tensor([0, 3]))


def test_static_cache_refuses_what_it_cannot_hold(make_model):
    model = make_model()
    cache = StaticCache(config=model.config, max_cache_len=6)
    with pytest.raises(ValueError, match="max_cache_len=6"):
        model(torch.randint(3, 97, (1, 7)), cache=cache, use_cache=True)
    ids, mask = left_padded_batch([5, 3])
    model(ids, attention_mask=mask, cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="only the prompt may hold masked tokens"):
        model(ids[:, :1], attention_mask=torch.cat([mask, torch.zeros(2, 1, dtype=mask.dtype)], 1), cache=cache)
    with pytest.raises(NotImplementedError, match="token shift"):
        cache.crop(-1)


def test_crop_and_beam_search_on_a_static_cache_without_token_shift(make_model):
    model = make_model(**VARIANTS["plain"])
    ids = torch.randint(3, 97, (2, 10))
    kwargs = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, **GREEDY)
    assert torch.equal(model.generate(ids, cache_implementation="static", **kwargs), model.generate(ids, **kwargs))
    cache = StaticCache(config=model.config, max_cache_len=12)
    model(ids[:, :6], cache=cache, use_cache=True)
    model(ids[:, 6:9], cache=cache, use_cache=True)
    cache.crop(-2)
    logits = model(ids[:, 7:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(logits, model(ids).logits[:, 7:], rtol=1e-5, atol=1e-5)


def test_compiled_chunked_prefill_generates_what_the_dynamic_cache_generates(make_model):
    """With `prefill_chunk_size`, generate() calls its compiled forward for the prompt's chunks too: they run eagerly
    (in CUDA graphs, what they store in the cache would be overwritten by the next replay), and the decode step is
    still the one graph, compiled once for both calls."""
    model = make_model(acp_eps=1e-4)
    ids, mask = left_padded_batch([21, 9, 16])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, **GREEDY)
    graphs = []
    config = counting_compile_config(graphs, fullgraph=False)
    torch._dynamo.reset()
    want = model.generate(ids, **kwargs)
    for _ in range(2):
        got = model.generate(ids, cache_implementation="static", compile_config=config, prefill_chunk_size=12,
                             **kwargs)
        assert torch.equal(got, want)
    computing = [g for g in graphs if any(node.op.startswith("call") for node in g.graph.nodes)]
    assert len(computing) == 1  # the decode step (before the chunks' graph break, dynamo leaves an empty graph)


# triton: the decode kernel in Triton's interpreter; log-n scaling: each step's query scale from its position tensor.
@pytest.mark.parametrize("backend, options", [("reference", dict(acp_eps=1e-4)), ("triton", dict(acp_eps=1e-4)),
                                              ("reference", VARIANTS["logn_scaling"])],
                         ids=["reference", "triton", "reference-logn-scaling"])
def test_compiled_decoding_is_one_graph_compiled_once(make_model, backend, options):
    """generate()'s compile path (what it does on CUDA, here on the CPU): every decode step runs one full graph,
    compiled once, and gives the eager dynamic cache's tokens."""
    if backend == "triton":
        pytest.importorskip("triton")
    model = make_model(attention_backend=backend, **options)
    ids, mask = left_padded_batch([9, 6])
    kwargs = dict(attention_mask=mask, max_new_tokens=6, **GREEDY)
    graphs = []
    config = counting_compile_config(graphs, fullgraph=True)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = model.generate(ids, cache_implementation="static", compile_config=config, **kwargs)
    assert len(graphs) == 1
    # The Triton launch is one op of the graph; the reference is plain torch ops.
    assert ("foxlm.forgetting_decode" in graphs[0].code) == (backend == "triton")
    assert torch.equal(compiled, model.generate(ids, **kwargs))
