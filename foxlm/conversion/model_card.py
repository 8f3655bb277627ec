"""The README.md model card of a converted model: what it was made from, how, and what to do next."""

from pathlib import Path

FINE_TUNE = """## Fine-tune it

{why}

```bash
pip install foxlm
foxlm finetune --help   # foxlm's long-context fine-tuning job (Trainer + LoRA)
```

or in your own `Trainer` loop (LoRA on the attention and MLP projections, the new `fgate_proj` fully trainable):

```python
import foxlm  # registers model_type "fox" with the Auto classes
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{folder}", dtype="bfloat16")
tokenizer = AutoTokenizer.from_pretrained("{folder}")
```

Without foxlm installed, `AutoModelForCausalLM.from_pretrained("{folder}", trust_remote_code=True)` loads the
model with the code saved beside the weights. The tokenizer needs neither foxlm nor that code:
`AutoTokenizer.from_pretrained("{folder}")` loads it either way (transformers first asks whether to run the folder's
code, for its config; pass `trust_remote_code=False` to skip the question).
"""


def describe_gate(options):
    if options["gate_init"] == "open":
        return (f"zero weights and bias {options['gate_bias']:g} in every head (f = sigmoid(bias) at every "
                "token: the gates start nearly open)")
    low, high = options["decay_times"]
    return (f"zero weights and per-head biases giving decay times log-spaced from {low:g} to {high:g} tokens over "
            "the heads of each layer (`decay-spread`: an ALiBi-like recency bias, short-range and long-range heads)")


def write_model_card(folder, *, name, kind, source, config, dtype, tokenizer_saved, source_config=None, options=None,
                     notes=()):
    """Write README.md into `folder`; `name` is the output folder's final name, `notes` extra changes to list."""
    folder = Path(folder)
    if kind == "llama":
        architecture = (source_config.architectures or [source_config.model_type])[0]
        changes = [
            f"Every tensor of the source copied unchanged ({config.num_hidden_layers} layers, hidden "
            f"{config.hidden_size}, {config.num_attention_heads} query / {config.num_key_value_heads} key-value "
            f"heads of size {config.head_dim}).",
            f"Added: a data-dependent forget gate per query head and layer (`self_attn.fgate_proj`), initialised "
            f"with {describe_gate(options)}.",
            "RoPE kept (`use_rope=True`, the source's rope parameters)." if config.use_rope else
            "RoPE dropped: FoX needs no position embedding, the forget gate gives the recency bias.",
        ]
        gate = (f"--gate-init open --gate-bias {options['gate_bias']:g}" if options["gate_init"] == "open" else
                "--gate-init decay-spread --decay-times {:g} {:g}".format(*options["decay_times"]))
        command = f"foxlm convert llama {source} {name} {gate}" + (" --keep-rope" if config.use_rope else "")
        why = ("The converted model is not yet a good language model: without RoPE (and with the new gates) the "
               "pretrained attention no longer sees positions as it was trained to, so its loss starts well above "
               "the source's. Fine-tuning on long documents teaches the attention to work without RoPE and the gates "
               "to forget.") if not config.use_rope else (
               "With RoPE kept and gates nearly open the model starts close to the source; fine-tune to let the "
               "gates learn to forget.")
    else:
        architecture = "FoX (official `forgetting_transformer` format)"
        changes = [
            "Weights renamed to LLaMA-style names (`embeddings` -> `embed_tokens`, `attn_norm` -> "
            "`input_layernorm`, `mlp_norm` -> `post_attention_layernorm`, `k_proj.linear` -> `k_proj`, "
            "`k_proj.shift_proj` -> `k_shift_proj`, ...); the fused MLP `gate_proj` split into `gate_proj` and "
            "`up_proj`; shared QK-norm scales tiled over heads. Logits are unchanged.",
        ]
        command = f"foxlm convert official {source} {name}"
        why = "The model computes what the official implementation computes; fine-tune it like any FoX model."
    changes.extend(notes)
    if not tokenizer_saved:
        changes.append("No tokenizer was found in the source: load the source's tokenizer separately.")
    lines = [
        "---", "library_name: transformers", "tags:", "- foxlm", "- forgetting-transformer", "---", "",
        f"# FoX conversion of `{source}`", "",
        f"A Forgetting Transformer (FoX, arXiv 2503.02130) made from `{source}` ({architecture}) with "
        f"`{command}` (foxlm), stored in {str(dtype).removeprefix('torch.')}.", "",
        "## What changed", "", *[f"- {change}" for change in changes], "",
        FINE_TUNE.format(why=why, folder=name),
    ]
    (folder / "README.md").write_text("\n".join(lines))
