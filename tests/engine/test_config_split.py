"""``EngineConfig`` as sub-configs (issue 27): the flat ``LLM(...)`` keywords land in the
right sub-config, each sub-config refuses a bad value naming it, an unknown keyword is
refused by name, and the generated routes cover every sub-config field exactly once."""

from __future__ import annotations

import dataclasses

import pytest

from atlas_vlm.config import (FLAT_ROUTES, SUB_CONFIGS, CacheConfig, DeviceConfig, EngineConfig, MediaFetchPolicy,
                              ModelConfig, MultiModalConfig, SchedulerConfig, SpeculativeConfig)

pytestmark = pytest.mark.text


@pytest.mark.parametrize(("flat", "value", "path"), [
    ("kvcache_block_size", 32, "cache_config.block_size"),
    ("kv_cache_dtype", "int8", "cache_config.kv_cache_dtype"),
    ("max_state_snapshots", 3, "cache_config.max_state_snapshots"),
    ("max_num_seqs", 8, "scheduler_config.max_num_seqs"),
    ("encoder_cache_tokens", 0, "scheduler_config.encoder_cache_tokens"),
    ("max_model_len", 512, "model_config.max_model_len"),
    ("seed", 7, "model_config.seed"),
    ("reasoning_parser", "qwen3", "model_config.reasoning_parser"),
    ("device", "cpu", "device_config.device"),
    ("deterministic", True, "device_config.deterministic"),
    ("attention_backend", "reference", "device_config.attention_backend"),
    ("speculative", "ngram", "speculative_config.method"),
    ("speculative_disable_by_batch_size", None, "speculative_config.disable_by_batch_size"),
    ("max_pixels", 4096, "multimodal_config.max_pixels"),
    ("allow_http_images", True, "multimodal_config.media.allow_http_images"),
    ("http_image_timeout_s", 2.5, "multimodal_config.media.http_timeout_s"),
    ("http_image_max_bytes", 1000, "multimodal_config.media.max_image_bytes"),
    ("allowed_media_domains", ["images.example"], "multimodal_config.media.allowed_media_domains"),
])
def test_flat_keyword_lands_in_its_sub_config(flat, value, path):
    config = EngineConfig(model="m", **{flat: value})
    node = config
    for part in path.split("."):
        node = getattr(node, part)
    assert node == value
    assert getattr(config, flat) == value  # the read-only flat view
    default = EngineConfig(model="m")
    changed = [name for name in FLAT_ROUTES if getattr(config, name) != getattr(default, name)]
    assert changed == [flat]  # nothing else moved


def test_routes_cover_every_field_once_and_round_trip():
    paths = set(FLAT_ROUTES.values())
    assert len(paths) == len(FLAT_ROUTES)
    for attr, cls in SUB_CONFIGS.items():
        for f in dataclasses.fields(cls):
            if f.name == "media":
                assert {p[2] for p in paths if p[:2] == (attr, "media")} == \
                    {g.name for g in dataclasses.fields(MediaFetchPolicy)}
            else:
                assert (attr, f.name) in paths
    config = EngineConfig(model="m", kvcache_block_size=8, max_num_seqs=3, speculative="ngram",
                          num_speculative_tokens=2, allow_http_images=True, max_pixels=1 << 16, seed=5)
    assert EngineConfig(**config.flat_kwargs()) == config
    assert EngineConfig.flat_names() == tuple(sorted(FLAT_ROUTES))


@pytest.mark.parametrize(("make", "message"), [
    (lambda: CacheConfig(block_size=0), "kvcache_block_size must be >= 1"),
    (lambda: CacheConfig(kv_cache="ring"), "kv_cache must be one of"),
    (lambda: CacheConfig(kv_cache_dir="/tmp/x", enable_prefix_caching=False), "kv_cache_dir .* needs prefix caching"),
    (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
    (lambda: SchedulerConfig(max_num_encoder_tokens=0), "max_num_encoder_tokens must be an int >= 1"),
    (lambda: ModelConfig(model="m", max_model_len=0), "max_model_len must be >= 1"),
    (lambda: ModelConfig(model="m", quantization="fp8"), "quantization must be None or one of"),
    (lambda: ModelConfig(model="m", mmproj="p.gguf"), "mmproj='p.gguf' needs model to be"),
    (lambda: MultiModalConfig(min_pixels=10, max_pixels=5), r"min_pixels \(10\) must be <= max_pixels \(5\)"),
    (lambda: DeviceConfig(attention_backend="flash"), "attention_backend must be one of"),
    (lambda: DeviceConfig(num_threads=0), "num_threads must be an int >= 1"),
    (lambda: SpeculativeConfig(method="eagle"), "speculative must be one of"),
    (lambda: SpeculativeConfig(num_speculative_tokens=2), "num_speculative_tokens is set but speculative is None"),
    (lambda: MediaFetchPolicy(http_timeout_s=0), "http_image_timeout_s must be > 0"),
    (lambda: MediaFetchPolicy(max_video_bytes=0), "max_video_bytes must be an int >= 1"),
    (lambda: MediaFetchPolicy(allowed_media_domains="a.example"), "allowed_media_domains must be a list"),
])
def test_each_sub_config_refuses_a_bad_value_naming_it(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_unknown_keyword_is_refused_by_name_with_the_known_ones():
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['kv_cach'\].*'kvcache_block_size'"):
        EngineConfig(model="m", kv_cach="paged")
    with pytest.raises(TypeError, match="needs model="):
        EngineConfig(kvcache_block_size=16)


def test_sub_config_objects_with_flat_keywords_over_them():
    config = EngineConfig(model="m", cache_config=CacheConfig(block_size=32), kv_cache_memory=1 << 20)
    assert (config.cache_config.block_size, config.cache_config.kv_cache_memory) == (32, 1 << 20)
    config = EngineConfig(model_config=ModelConfig(model="m", seed=3), max_num_seqs=2)
    assert (config.model_config.seed, config.scheduler_config.max_num_seqs) == (3, 2)
    with pytest.raises(ValueError, match="kvcache_block_size must be >= 1"):  # the flat value is checked too
        EngineConfig(model="m", cache_config=CacheConfig(block_size=32), kvcache_block_size=0)
    with pytest.raises(TypeError, match="cache_config must be a CacheConfig"):
        EngineConfig(model="m", cache_config={"block_size": 32})


def test_flat_view_is_read_only():
    config = EngineConfig(model="m")
    with pytest.raises(AttributeError, match="read-only view of cache_config.block_size"):
        config.kvcache_block_size = 32
    with pytest.raises(AttributeError, match="no attribute 'kv_cach'"):
        config.kv_cach  # noqa: B018 - the read is the test
    assert config.cache_config.block_size == 16
