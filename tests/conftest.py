import os

import torch

# Without a GPU, Triton kernels run in its interpreter; the flag must be set before any @triton.jit is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_report_header(config):
    import transformers

    # CI runs the suite on more than one transformers release (.ci/run): each run's log says which.
    return f"transformers {transformers.__version__}, torch {torch.__version__}"


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (beside the CPU tests of the same module) need CUDA: without it they are skipped. On a GPU
    machine `python -m pytest -m gpu tests` runs them all."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def counting_backend(graphs):
    """A torch.compile backend that appends every graph it gets to `graphs` and runs it with aot_eager (which traces,
    functionalizes and differentiates as inductor does, quickly)."""
    from torch._dynamo.backends.registry import lookup_backend

    def backend(graph, example_inputs):
        graphs.append(graph)
        return lookup_backend("aot_eager")(graph, example_inputs)

    return backend


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


def save_llama_and_corpus(root, **llama_overrides):
    """A tiny LLaMA (byte-level tokenizer; `llama_overrides` change its config) in root/llama and a folder of text
    files, root/corpus, some of them held out by the path hash; returns root."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = dict(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, bos_token_id=256, eos_token_id=257, max_position_embeddings=128)
    llama = LlamaForCausalLM(LlamaConfig(**{**config, **llama_overrides}))
    llama.save_pretrained(root / "llama")
    byte_tokenizer().save_pretrained(root / "llama")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i}.txt").write_text(f"def function_{i}(x):\n    return x * {i}\n" * 30)
    return root


def torchrun(cwd, *command, processes=2, returncode=0, timeout=600):
    """`python -m torch.distributed.run` with `processes` CPU processes (gloo) in `cwd`, foxlm and tests/ importable;
    asserts its exit status and returns its standard output."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(processes), *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == returncode, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout


def kill_after_checkpoint(step):
    """A Trainer callback that stops a run as a kill would (KeyboardInterrupt), right after checkpoint `step` is on
    disk."""
    from transformers import TrainerCallback

    class KillAfterCheckpoint(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == step:
                raise KeyboardInterrupt(f"killed after checkpoint-{step}")

    return KillAfterCheckpoint()


def finetune_args(root, run, *extra):
    """`foxlm finetune` options for a tiny run on the model and corpus of `save_llama_and_corpus`."""
    return ["--model", str(root / "llama"), "--output-dir", str(root / run), "--text-files",
            str(root / "corpus" / "*.txt"), "--context", "128", "--steps", "3", "--tokens-per-step", "256",
            "--lora-r", "4", "--eval-length", "256", "--eval-docs", "3", *extra]


@pytest.fixture
def make_config():
    return tiny_config


@pytest.fixture
def make_model():
    return tiny_model
