"""``--speculative ngram --num-speculative-tokens K`` on ``scripts/generate.py`` and
``atlas-vlm serve``: the flags reach ``EngineConfig``; the CLI's greedy text with drafts is
the library's text without them; a count without a method is a clear error (exit 1)."""

from __future__ import annotations

import importlib.util

import pytest

from helpers import REPO
from atlas_vlm import LLM, SamplingParams

pytestmark = pytest.mark.text
PROMPT = "a b c d a b c d a b c d a b c"


def _cli():
    spec = importlib.util.spec_from_file_location("generate_cli_spec", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generate_script_with_drafts_prints_the_plain_greedy_text(tiny_models, capsys):
    folder = tiny_models["qwen2"][0]
    rc = _cli().main(["--dtype", "float32", "--model", str(folder), "--prompt", PROMPT, "--max-tokens", "20",
                      "--no-chat", "--speculative", "ngram", "--num-speculative-tokens", "3"])
    out = capsys.readouterr()
    expected = LLM(str(folder), num_kvcache_blocks=64, dtype="float32").generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert rc == 0
    assert out.out == expected.text + "\n"


def test_generate_script_count_without_method_is_a_clear_error(tiny_models, capsys):
    folder = tiny_models["qwen2"][0]
    rc = _cli().main(["--model", str(folder), "--prompt", "hi", "--num-speculative-tokens", "3"])
    assert rc == 1
    assert "speculative" in capsys.readouterr().err


def test_serve_flags_reach_the_engine_config():
    from atlas_vlm.entrypoints import cli
    from atlas_vlm.entrypoints.openai.cli_args import engine_config_from_args

    args = cli.build_parser().parse_args(["serve", "m", "--speculative", "ngram", "--num-speculative-tokens", "5"])
    config = engine_config_from_args(args)
    assert (config.speculative, config.num_speculative_tokens, config.speculative_config.speculative_tokens) == ("ngram", 5, 5)
    off = engine_config_from_args(cli.build_parser().parse_args(["serve", "m"]))
    assert (off.speculative, off.speculative_config.speculative_tokens) == (None, 0)
