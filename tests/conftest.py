import os

import torch

# Without a GPU, Triton kernels run in its interpreter; the flag must be set before any @triton.jit is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (beside the CPU tests of the same module) need CUDA: without it they are skipped. On a GPU
    machine `python -m pytest -m gpu tests` runs them all."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def tiny_config(**overrides):
    """A FoX (Pro) config small enough for CPU tests: GQA 4/2 heads, every Pro part on."""
    from foxlm import FoxConfig

    kwargs = dict(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    kwargs.update(overrides)
    return FoxConfig.fox_pro(**kwargs)


def tiny_model(seed=0, **overrides):
    from foxlm import FoxForCausalLM

    torch.manual_seed(seed)
    model = FoxForCausalLM(tiny_config(**overrides)).eval()
    # Random gate biases spread the decay over heads so that the forget gate matters in every test.
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.self_attn.fgate_proj
            if gate is not None:
                gate.bias.copy_(torch.randn_like(gate.bias) * 2 + 2)
    return model


def byte_tokenizer():
    """A byte-level tokenizer built offline: 256 byte tokens plus <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab.update({"<s>": 256, "</s>": 257})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def load_script(path):
    """A script outside the package (an example, a benchmark) imported as a module; its folder goes on sys.path, as
    when it runs, so that it can import the scripts beside it."""
    import importlib.util
    import sys

    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def make_config():
    return tiny_config


@pytest.fixture
def make_model():
    return tiny_model
