import json

import pytest
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import AutoConfig, DynamicCache, PreTrainedConfig

from foxlm import FoxCacheLayer, FoxConfig


def test_defaults_are_fox_llama_without_rope():
    config = FoxConfig()
    assert config.model_type == "fox"
    assert config.fgate_type == "data_dependent" and not config.use_rope
    assert not any([config.qk_norm, config.use_output_gate, config.use_output_norm, config.use_k_shift,
                    config.use_v_shift])
    assert config.num_key_value_heads == config.num_attention_heads
    assert config.head_dim == config.hidden_size // config.num_attention_heads
    assert config.layer_types == ["fox_attention"] * config.num_hidden_layers
    assert config.acp_eps is None


def test_presets_match_the_paper_variants():
    pro = FoxConfig.fox_pro()
    assert pro.qk_norm and pro.use_output_gate and pro.use_output_norm and pro.use_k_shift and pro.use_v_shift
    assert pro.intermediate_size == 3584  # hidden 1536, hidden_ratio 3.5
    llama = FoxConfig.fox_llama()
    assert llama.intermediate_size == 4096 and not llama.qk_norm
    assert FoxConfig.fox_pro(use_k_shift=False, intermediate_size=100).intermediate_size == 100


def test_save_and_load_round_trip(tmp_path):
    config = FoxConfig.fox_pro(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, fgate_type="fixed",
                               decay_time_min=2.0, decay_time_max=500.0, attention_backend="reference")
    config.save_pretrained(tmp_path)
    loaded = FoxConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()


def test_config_json_leaves_out_the_derived_layer_types(tmp_path):
    config = FoxConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=3)
    assert config.layer_types == ["fox_attention"] * 3
    assert "layer_types" not in config.to_json_string() and "layer_types" not in config.to_json_string(use_diff=False)
    config.save_pretrained(tmp_path)
    assert "layer_types" not in json.loads((tmp_path / "config.json").read_text())


def test_the_base_config_class_reads_a_saved_fox_config(tmp_path):
    # Trainer reads a checkpoint's config.json through the base class when it resumes; AutoTokenizer does so where
    # foxlm is not imported.
    FoxConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=3).save_pretrained(tmp_path)
    read_back = PreTrainedConfig.from_json_file(tmp_path / "config.json"), PreTrainedConfig.from_pretrained(tmp_path)
    for config in read_back:
        assert type(config) is PreTrainedConfig and config.num_hidden_layers == 3


def test_dynamic_cache_of_a_reloaded_config_has_a_fox_layer_per_layer(tmp_path):
    FoxConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=3).save_pretrained(tmp_path)
    for config in (FoxConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(tmp_path)):
        layers = DynamicCache(config=config).layers
        assert len(layers) == 3 and all(type(layer) is FoxCacheLayer for layer in layers)


def test_config_json_with_layer_types_from_earlier_versions_still_loads(tmp_path):
    config = FoxConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=3)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "layer_types": ["fox_attention"] * 3}))
    for loaded in (FoxConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(tmp_path)):
        assert loaded.to_json_string() == config.to_json_string() and loaded.layer_types == ["fox_attention"] * 3
    loaded.save_pretrained(tmp_path / "saved_again")
    assert "layer_types" not in json.loads((tmp_path / "saved_again" / "config.json").read_text())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fgate_type="sigmoid"), "fgate_type"),
        (dict(num_attention_heads=8, num_key_value_heads=3), "num_key_value_heads"),
        (dict(fgate_type="none", decay_time_min=1.0, decay_time_max=10.0), "no gate bias"),
        (dict(decay_time_min=1.0), "both"),
        (dict(decay_time_min=10.0, decay_time_max=1.0), "decay_time_min <= decay_time_max"),
        (dict(decay_time_min=1.0, decay_time_max=10.0, fgate_bias_init=3.0), "give one"),
        (dict(fgate_type="fixed"), "needs its constant"),
        (dict(attention_backend="flash"), "attention_backend"),
        (dict(acp_eps=2.0), "acp_eps"),
        (dict(num_hidden_layers=2, layer_types=["full_attention"] * 2), "fox_attention"),
        (dict(num_hidden_layers=2, layer_types=["fox_attention"]), "entries for 2 layers"),
        (dict(rope_parameters=dict(rope_type="linear", rope_theta=5e5, factor=4.0)), "use_rope=False"),
        (dict(rope_max_wavelength=8192.0), "needs `use_rope=True`"),
        (dict(use_rope=True, rope_max_wavelength=0.0), "positive number of tokens"),
        (dict(use_rope=True, rope_max_wavelength=8192.0, rope_slow_pairs="zero"),
         "one of 'drop', 'clamp', 'interpolate', 'compress'"),
        (dict(use_rope=True, rope_max_wavelength=8192.0, rope_slow_pairs="interpolate"), "a number above 1"),
        (dict(use_rope=True, rope_max_wavelength=8192.0, rope_slow_pairs="compress", rope_slow_pairs_factor=0.5),
         "`rope_slow_pairs='compress'` needs `rope_slow_pairs_factor`"),
        (dict(use_rope=True, rope_max_wavelength=8192.0, rope_slow_pairs="interpolate", rope_slow_pairs_factor=1.0),
         "a number above 1"),
        (dict(use_rope=True, rope_max_wavelength=8192.0, rope_slow_pairs="clamp", rope_slow_pairs_factor=4.0),
         "is for `rope_slow_pairs='interpolate'` or 'compress'"),
        (dict(use_rope=True, rope_slow_pairs="clamp"), "it needs `rope_max_wavelength`"),
        (dict(use_rope=True, rope_max_wavelength=4096.0, rope_slow_pairs="drop", rope_slow_pairs_start=8192.0),
         "is for `rope_slow_pairs='clamp'` or 'compress'"),
        (dict(use_rope=True, rope_max_wavelength=4096.0, rope_slow_pairs="clamp", rope_slow_pairs_start=0.0),
         "`rope_slow_pairs_start` must be a positive number"),
        (dict(use_rope=True, rope_max_wavelength=8192.0,
              rope_parameters=dict(rope_type="dynamic", rope_theta=5e5, factor=2.0)), "fixed RoPE frequencies"),
    ],
)
def test_invalid_values_raise_clear_errors(kwargs, message):
    with pytest.raises((ValueError, StrictDataclassClassValidationError), match=message):
        FoxConfig(**kwargs)


def test_rope_scaling_is_kept_where_rope_is_used_and_trainer_leaves_the_cache_out_of_evaluation():
    from foxlm.compat import CACHE_ARG

    config = FoxConfig(use_rope=True, rope_parameters=dict(rope_type="linear", rope_theta=5e5, factor=4.0))
    assert config.rope_parameters["factor"] == 4.0
    assert config.keys_to_ignore_at_inference == [CACHE_ARG]
