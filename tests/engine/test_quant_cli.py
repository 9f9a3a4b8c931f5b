"""``--quantization`` on ``scripts/generate.py`` and ``atlas-vlm serve``."""

from __future__ import annotations

import importlib.util

import pytest

from helpers import REPO
from atlas_vlm import LLM, SamplingParams
from atlas_vlm.entrypoints import cli
from atlas_vlm.entrypoints.openai.cli_args import engine_config_from_args

pytestmark = pytest.mark.text


def _generate_cli():
    spec = importlib.util.spec_from_file_location("generate_cli", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generate_quantization_flag_equals_the_library(tiny_models, capsys):
    folder = tiny_models["qwen2"][0]
    rc = _generate_cli().main(["--dtype", "float32", "--quantization", "int4", "--model", str(folder),
                               "--prompt", "Hello there", "--max-tokens", "8", "--no-chat"])
    out = capsys.readouterr()
    want = LLM(str(folder), dtype="float32", quantization="int4", num_kvcache_blocks=64).generate(
        "Hello there", SamplingParams(temperature=0, max_tokens=8))[0].text
    dense = LLM(str(folder), dtype="float32", num_kvcache_blocks=64).generate(
        "Hello there", SamplingParams(temperature=0, max_tokens=8))[0].text
    assert rc == 0 and out.out == want + "\n"
    assert want != dense  # the flag reached the loader


def test_generate_refuses_an_unknown_scheme(capsys):
    with pytest.raises(SystemExit):
        _generate_cli().main(["--quantization", "fp8", "--prompt", "x"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_serve_quantization_flag_reaches_the_engine_config(capsys):
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "some/model", "--quantization", "gguf"])
    assert engine_config_from_args(args).quantization == "gguf"
    args = parser.parse_args(["serve", "some/model"])
    assert engine_config_from_args(args).quantization is None
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0 and "--quantization" in capsys.readouterr().out
