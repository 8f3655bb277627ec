"""FoxForCausalLM on a real GPU: the Triton path agrees with the reference path at model level.

Run on a CUDA machine: `python -m pytest -m gpu tests -q` (marked `gpu`: skipped without CUDA).
"""

import pytest
import torch
from transformers import DynamicCache

from foxlm import FoxConfig, FoxForCausalLM

pytestmark = pytest.mark.gpu


def gpu_model(dtype, backend="auto", seed=0, **overrides):
    kwargs = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, pad_token_id=0, attention_backend=backend)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = FoxForCausalLM(FoxConfig.fox_pro(**kwargs))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.fgate_proj.bias.copy_(torch.randn(4) * 2 + 2)
    return model.to("cuda", dtype)


def relative_error(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def test_triton_and_reference_paths_agree_in_bf16_with_gradients():
    model = gpu_model(torch.bfloat16)
    ids = torch.randint(3, 512, (2, 1000), device="cuda")
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.config.attention_backend = "reference"
    ref = model(ids, labels=ids, use_cache=False)
    ref.loss.backward()
    assert relative_error(out.logits, ref.logits) < 2e-2
    assert abs(out.loss.item() - ref.loss.item()) < 1e-2
    for name, p in model.named_parameters():
        assert relative_error(grads[name], p.grad) < 5e-2, name


def test_padding_packing_and_cache_on_the_gpu_kernel():
    model = gpu_model(torch.float32).eval()
    seqs = [torch.randint(3, 512, (n,), device="cuda") for n in (300, 129, 1)]
    T = 300
    ids = torch.randint(3, 512, (3, T), device="cuda")
    mask = torch.zeros(3, T, dtype=torch.long, device="cuda")
    for b, s in enumerate(seqs):
        ids[b, T - len(s) :], mask[b, T - len(s) :] = s, 1
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        packed = model(torch.cat(seqs)[None], position_ids=torch.cat([torch.arange(len(s)) for s in seqs])[None]
                       .cuda(), use_cache=False).logits[0]
        start = 0
        for b, s in enumerate(seqs):
            alone = model(s[None]).logits[0]
            assert relative_error(padded[b, T - len(s) :], alone) < 1e-3
            assert relative_error(packed[start : start + len(s)], alone) < 1e-3
            start += len(s)
        full = model(seqs[0][None]).logits
        cache = DynamicCache(config=model.config)
        pieces = [model(seqs[0][None, a:b], cache=cache, use_cache=True).logits
                  for a, b in ((0, 200), (200, 201), (201, 300))]
        assert relative_error(torch.cat(pieces, dim=1), full) < 1e-3


def test_generate_and_torch_compile_on_the_gpu():
    model = gpu_model(torch.bfloat16).eval()
    prompt = torch.randint(3, 512, (2, 64), device="cuda")
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    assert out.shape == (2, 80)
    train_model = gpu_model(torch.bfloat16).train()
    ids = torch.randint(3, 512, (2, 512), device="cuda")
    compiled = torch.compile(train_model, fullgraph=True)
    loss = compiled(ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert abs(loss.item() - train_model(ids, labels=ids, use_cache=False).loss.item()) < 2e-2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_layers_spread_over_two_gpus_give_what_one_gpu_gives():
    # device_map-style placement: the kernels must launch on each layer's own GPU, not on the current one (cuda:0).
    from accelerate import dispatch_model

    model = gpu_model(torch.bfloat16)
    ids = torch.randint(3, 512, (2, 600), device="cuda:0")
    want = model(ids, labels=ids, use_cache=False)
    want.loss.backward()
    want_grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    want_tokens = model.generate(ids[:, :100], max_new_tokens=8, do_sample=False)
    model.zero_grad()
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1, "lm_head": 1}
    spread = dispatch_model(model, device_map=device_map)
    torch.cuda.set_device(0)
    assert spread.model.layers[1].self_attn.q_proj.weight.device == torch.device("cuda", 1)
    got = spread(ids, labels=ids, use_cache=False)
    got.loss.backward()
    assert relative_error(got.logits.to("cuda:0"), want.logits) < 1e-2
    for name, param in spread.named_parameters():
        assert relative_error(param.grad.float().cpu(), want_grads[name]) < 1e-2, name
    assert torch.equal(spread.generate(ids[:, :100], max_new_tokens=8, do_sample=False).cpu(), want_tokens.cpu())
