"""Served names of files, folders and Hub ids (issue 35, item 8), the random-weights check,
and the engine log line's values (no server)."""

from __future__ import annotations

import pytest

from atlas_vlm.default_models import RANDOM_VLM_NOTICE, has_random_weights
from atlas_vlm.engine.request_stream import EngineStats
from atlas_vlm.entrypoints.openai.served_name import default_served_model_name, same_model_path
from atlas_vlm.entrypoints.openai.stat_logging import LoggingStatLogger

pytestmark = pytest.mark.text


def test_served_name_of_file_folder_hub_id_and_default(tmp_path):
    f = tmp_path / "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"
    f.write_bytes(b"")
    d = tmp_path / "Qwen2.5-VL-3B-Instruct"
    d.mkdir()
    assert default_served_model_name(str(f)) == "qwen2.5-coder-1.5b-instruct-q4_k_m"
    assert default_served_model_name(str(d)) == "qwen2.5-vl-3b-instruct"
    assert default_served_model_name(str(d) + "/") == "qwen2.5-vl-3b-instruct"
    assert default_served_model_name("Qwen/Qwen2.5-VL-3B-Instruct") == "Qwen/Qwen2.5-VL-3B-Instruct"
    assert default_served_model_name(None) == "SmolLM2-135M-Instruct"
    assert same_model_path(str(f), str(f)) and not same_model_path("other", str(f))
    assert not same_model_path("a\0b", str(f))


def test_random_weights_from_the_readme_notice(tmp_path):
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "README.md").write_text("# x\n\n" + RANDOM_VLM_NOTICE + "\n")
    (tmp_path / "trained").mkdir()
    (tmp_path / "trained" / "README.md").write_text("# a trained model\n")
    assert has_random_weights(tmp_path / "random")
    assert not has_random_weights(tmp_path / "trained") and not has_random_weights(tmp_path / "missing")
    assert not has_random_weights("Org/Name") and not has_random_weights(None)


def test_engine_line_values_and_idle_silence():
    lg = LoggingStatLogger(10.0)
    idle = EngineStats(num_blocks=100, num_free_blocks=100)
    assert lg.line(idle, 10.0) is None  # idle: no line
    lg.on_first_token(0.1, 40, 10)
    lg.on_new_tokens(20, None)
    busy = EngineStats(num_running=2, num_waiting=1, num_blocks=100, num_free_blocks=75)
    assert lg.line(busy, 10.0) == ("Engine: Avg prompt throughput: 4.0 tokens/s, Avg generation throughput: 2.0 "
                                   "tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix "
                                   "cache hit rate: 25.0%")
    assert "Running: 0 reqs" in lg.line(idle, 10.0)  # one line after the last busy one
    assert lg.line(idle, 10.0) is None
    with pytest.raises(ValueError, match="log-stats-interval"):
        LoggingStatLogger(0)
