"""The model's forward arguments on every supported transformers release: the cache under its current and its old
name, no keyword argument dropped silently, and clear refusals of what FoX does not do."""

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from transformers import DynamicCache

from foxlm import FoxModel
from foxlm.compat import CACHE_ARG, PASSTHROUGH_KWARGS


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_the_cache_is_taken_under_either_name_and_returned_under_the_installed_one(make_model, name):
    model = make_model()
    ids = torch.randint(3, 97, (2, 9))
    cache = DynamicCache(config=model.config)
    # `past_key_values` where transformers renamed it gets transformers' notice, as LLaMA's forward does.
    deprecated = name == "past_key_values" and CACHE_ARG == "cache"
    with pytest.warns(FutureWarning, match="past_key_values") if deprecated else warnings.catch_warnings():
        if not deprecated:
            warnings.simplefilter("error", FutureWarning)
        first = model(ids[:, :6], use_cache=True, **{name: cache})
        assert getattr(first, CACHE_ARG) is cache and cache.get_seq_length() == 6
        rest = model(ids[:, 6:], use_cache=True, **{name: cache}).logits
    torch.testing.assert_close(torch.cat([first.logits, rest], 1), model(ids).logits, rtol=1e-5, atol=1e-5)


def test_the_installed_transformers_names_the_cache_as_foxlm_hands_it_over():
    output_fields = transformers.modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__
    assert CACHE_ARG in output_fields


@pytest.mark.parametrize("kwarg", ["past_key_value", "cache_params", "token_type_ids", "cache_position"])
def test_a_keyword_argument_the_model_does_not_use_is_an_error_naming_it(make_model, kwarg):
    model = make_model()
    ids = torch.randint(3, 97, (1, 4))
    with pytest.raises(TypeError, match=f"FoxForCausalLM.forward.*'{kwarg}'"):
        model(ids, **{kwarg: None})
    with pytest.raises(TypeError, match=f"FoxModel.forward.*'{kwarg}'"):
        model.model(ids, **{kwarg: None})


def test_the_keyword_arguments_transformers_passes_are_accepted(make_model):
    model = make_model()
    ids = torch.randint(3, 97, (1, 6))
    bounds = torch.tensor([0, 2, 6], dtype=torch.int32)
    out = model(ids, labels=ids, num_items_in_batch=torch.tensor(5), output_hidden_states=True,
                output_attentions=False, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=4, max_length_k=4,
                seq_idx=torch.tensor([[0, 0, 1, 1, 1, 1]]), is_causal=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert set(PASSTHROUGH_KWARGS) >= {"num_items_in_batch", "cu_seq_lens_q", "max_length_q"}


@pytest.mark.parametrize("kwargs, message", [
    (dict(output_attentions=True), "attention weights"),
    (dict(is_causal=False), "causal"),
])
def test_what_fox_does_not_compute_is_refused_clearly(make_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_model()(torch.randint(3, 97, (1, 4)), **kwargs)


def test_sequence_classification_takes_the_same_arguments(make_config):
    from foxlm import FoxForSequenceClassification

    model = FoxForSequenceClassification(make_config(num_labels=3)).eval()
    ids = torch.randint(3, 97, (2, 5))
    assert model(ids).logits.shape == (2, 3)
    with pytest.raises(TypeError, match="'token_type_ids'"):
        model(ids, token_type_ids=torch.zeros_like(ids))


def test_foxlm_code_triggers_no_deprecation_notice():
    """Generation (greedy, beam, assisted), cached forwards and a checkpointed training step print nothing about
    the cache's old names (LLaMA prints nothing either) nor about checkpointing's. Run in a fresh process:
    transformers warns once per process."""
    script = textwrap.dedent("""
        import warnings
        warnings.simplefilter("always")
        import torch
        from transformers import DynamicCache
        from conftest import tiny_model
        from foxlm.compat import enable_activation_checkpointing
        model = tiny_model()
        ids = torch.randint(3, 97, (2, 6))
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        model.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=0)
        model.generate(ids[:1], max_new_tokens=3, do_sample=False, pad_token_id=0,
                       assistant_model=tiny_model(seed=1, num_hidden_layers=1))
        cache = DynamicCache(config=model.config)
        model(ids, cache=cache, use_cache=True)
        model.train()
        enable_activation_checkpointing(model)
        model(ids, labels=ids, use_cache=True).loss.backward()
        print("done")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stderr
    assert "done" in result.stdout
    printed = result.stdout + result.stderr
    for old_name in ("past_key_values", "cache_params", "gradient_checkpointing"):
        assert old_name not in printed, result.stderr


def test_model_classes_declare_what_transformers_may_not_assume():
    assert not FoxModel._supports_sdpa and not FoxModel._supports_flash_attn and not FoxModel._supports_flex_attn
    assert FoxModel._can_compile_fullgraph  # with the static cache (tests/test_static_cache.py)
    assert "attentions" not in (FoxModel._can_record_outputs or {})


def test_packed_boundaries_must_agree_and_not_come_with_a_mask_of_zeros(make_model):
    model = make_model()
    ids = torch.randint(3, 97, (1, 6))
    bounds = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        model(ids, cu_seq_lens_q=bounds, cu_seq_lens_k=torch.tensor([0, 3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="not both"):
        model(ids, cu_seq_lens_q=bounds, attention_mask=torch.tensor([[1, 1, 1, 1, 1, 0]]))
    packed = model(ids, cu_seq_lens_q=bounds).logits
    torch.testing.assert_close(model(ids, cu_seq_lens_q=bounds, attention_mask=torch.ones_like(ids)).logits, packed)
    torch.testing.assert_close(packed[:, :2], model(ids[:, :2]).logits)
