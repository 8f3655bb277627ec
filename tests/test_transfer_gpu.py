"""Attention transfer on a real GPU: bf16 models on the Triton kernel, fp32 master weights for what is trained.

Run on a CUDA machine: `python -m pytest -m gpu tests -q` (marked `gpu`: skipped without CUDA).
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from foxlm import FoxForCausalLM
from foxlm.conversion import convert_llama_to_fox, fox_from_llama, transfer_attention
from foxlm.conversion.transfer import attention_errors

pytestmark = pytest.mark.gpu


def test_a_bf16_llama_on_the_gpu_transfers_with_fp32_masters_and_stays_bf16():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    llama = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    before = {name: tensor.clone() for name, tensor in llama.state_dict().items()}
    fox = fox_from_llama(llama)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 512, (2, 512), generator=generator).cuda() for _ in range(4)]
    held_out = [torch.randint(0, 512, (2, 512), generator=generator).cuda() for _ in range(2)]
    error_before = attention_errors(llama, fox, held_out)
    record = transfer_attention(llama, fox, batches, steps=40, lr=3e-2, qk_rank=4, progress=False)
    error_after = attention_errors(llama, fox, held_out)
    assert all(a < 0.5 * b for a, b in zip(error_after, error_before)), (error_before, error_after)
    assert record.loss[-1] < record.loss[0]
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in fox.parameters())
    assert all(torch.equal(tensor, before[name]) for name, tensor in llama.state_dict().items())


def test_convert_with_transfer_on_the_gpu_writes_a_model_that_loads(tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=64)).save_pretrained(
        tmp_path / "llama")
    batches = [torch.randint(0, 512, (2, 256)) for _ in range(2)]  # on the CPU: the transfer moves them
    out = convert_llama_to_fox(tmp_path / "llama", tmp_path / "fox", dtype="bf16", transfer_steps=5,
                               transfer_data=batches, transfer_qk_rank=2, transfer_device="cuda")
    fox = FoxForCausalLM.from_pretrained(out)
    assert fox.dtype == torch.bfloat16 and fox.model.layers[0].self_attn.fgate_proj.weight.abs().max() > 0
