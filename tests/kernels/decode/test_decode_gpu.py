"""The split-K decode kernel on a real GPU at real sizes, against float64 on the GPU, and inside generate().

Run on a CUDA machine: `python -m pytest tests/kernels/decode/test_decode_gpu.py -q` (marked `gpu`).
"""

import math

import pytest
import torch
from transformers import CompileConfig

from foxlm.kernels.acp import acp_threshold
from foxlm.kernels.decode import forgetting_decode
from tests.kernels.decode.test_decode import make_cache, naive_decode, rel_error

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B,Tq,Tk,Hq,Hkv,D", [(4, 1, 5000, 32, 8, 128), (3, 4, 3001, 16, 2, 64),
                                             (2, 16, 2048, 8, 8, 96)])
def test_decode_kernel_matches_float64(dtype, B, Tq, Tk, Hq, Hkv, D):
    q, k, v, c = make_cache(B, Tq, Tk, Hq, Hkv, D, dtype=dtype, gate_bias=5.0)
    seq_start = torch.tensor([0, 777, 2000, 10][:B], device="cuda")
    out = forgetting_decode(q, k, v, c, seq_start=seq_start)
    assert rel_error(out, naive_decode(q, k, v, c, seq_start=seq_start)) < TOLERANCE[dtype]


def test_acp_prunes_within_eps_on_gpu():
    q, k, v, c = make_cache(2, 1, 8192, 16, 4, 128, dtype=torch.bfloat16, gate_bias=-1.0)
    delta = torch.full((2, 16), acp_threshold(math.sqrt(128) * 4, 8192, math.exp(-10)), device="cuda")
    out = forgetting_decode(q, k, v, c, acp_delta=delta)
    assert rel_error(out, naive_decode(q, k, v, c, acp_delta=delta)) < 2e-2
    assert rel_error(out, naive_decode(q, k, v, c)) < 2e-2


def test_generate_on_gpu_equals_uncached_argmax(make_model):
    model = make_model(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=16).cuda()
    ids = torch.randint(3, 97, (2, 300), device="cuda")
    out = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    for _ in range(8):
        ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, ids)


def test_static_cache_length_on_gpu_matches_float64():
    B, Tk, capacity = 3, 3001, 4096
    q, k, v, c = make_cache(B, 1, Tk, 16, 4, 64, dtype=torch.bfloat16, gate_bias=5.0)
    seq_start = torch.tensor([0, 777, 10], device="cuda")

    def pad(t, dtype):  # a static cache's buffer: stale values past the filled length
        return torch.cat([t.to(dtype), torch.full((B, capacity - Tk, *t.shape[2:]), 1e4, device="cuda", dtype=dtype)],
                         dim=1)

    out = forgetting_decode(q, pad(k, k.dtype), pad(v, v.dtype), pad(c, torch.float64), seq_start=seq_start,
                            kv_len=torch.tensor(Tk, device="cuda"))
    assert rel_error(out, naive_decode(q, k, v, c, seq_start=seq_start)) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("prefill_chunk_size", [None, 128])
@pytest.mark.parametrize("overrides", [{}, dict(acp_eps=1e-4, qk_norm=False), dict(decode_kv_eviction=True)])
def test_compiled_static_generate_equals_eager_generate_on_gpu(make_model, overrides, prefill_chunk_size):
    """generate()'s own compile path on CUDA (reduce-overhead: CUDA graphs), one graph compiled once, the Triton
    decode kernel inside, against the eager dynamic cache: the same greedy tokens in fp32. With
    `prefill_chunk_size` generate() calls the compiled forward for the prompt's chunks too (they run eagerly: a
    graph break, so not under fullgraph, and a recompile of the empty graph before it per chunk length)."""
    model = make_model(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                       **overrides).cuda()
    ids = torch.randint(3, 97, (2, 300), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :40] = 0  # left padding
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    eager = model.generate(ids, **kwargs)
    chunked = prefill_chunk_size is not None
    static = dict(cache_implementation="static", prefill_chunk_size=prefill_chunk_size)
    if chunked:  # the chunks on the kernels alone, then in the static cache, before any graph
        dynamic = model.generate(ids, prefill_chunk_size=prefill_chunk_size, **kwargs)
        assert_same_tokens(dynamic, eager, "dynamic cache, chunked")
    uncompiled = model.generate(ids, **static, disable_compile=True, **kwargs)
    assert_same_tokens(uncompiled, eager, "static cache, not compiled")
    compile_config = CompileConfig(fullgraph=not chunked)  # reduce-overhead
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=not chunked):
        compiled = model.generate(ids, **static, compile_config=compile_config, **kwargs)
        again = model.generate(ids, **static, compile_config=compile_config, **kwargs)  # the same graph, replayed
    assert_same_tokens(compiled, eager, "compiled, first call")
    assert_same_tokens(again, eager, "compiled, second call")


def assert_same_tokens(got, want, what):
    """Equal token ids, or a message that says where the first difference of each row is."""
    differ = (got != want).int()
    first = [int(row.argmax()) if row.any() else None for row in differ]
    assert not differ.any(), f"{what}: first differing position per row {first} of {want.shape[1]}"
