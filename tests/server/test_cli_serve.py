"""``atlas-vlm`` command line, in process: the console script in pyproject resolves to
``cli.main``, ``serve`` documents its flags, byte sizes parse, and a bad model path is a
clear error with exit code 1 (no server is started)."""

from __future__ import annotations

import argparse
import importlib
import re

import pytest

from atlas_vlm.entrypoints import cli
from helpers import REPO

pytestmark = [pytest.mark.server, pytest.mark.text]


def test_console_script_points_at_cli_main():
    text = (REPO / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    module, func = re.search(r'^atlas-vlm = "([\w.]+):(\w+)"$', section, re.M).groups()
    assert getattr(importlib.import_module(module), func) is cli.main


def test_serve_help_lists_the_server_flags(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--max-waiting-requests", "--allowed-local-media-path",
                 "--allow-http-images", "--image-fetch-timeout", "--max-image-bytes", "--served-model-name",
                 "--max-model-len", "--dtype", "--kv-cache-memory", "--replicas", "--routing",
                 "--imbalance-threshold", "--num-gpus-per-replica", "--num-cpus-per-replica", "--ray-address",
                 "--allowed-media-domains", "--max-request-body-bytes", "--max-prompts-per-request",
                 "--protect-docs-metrics", "--input-workers", "--shutdown-timeout"):
        assert flag in out
    assert "127.0.0.1" in out and "8000" in out


@pytest.mark.parametrize("text, expected", [("1048576", 1 << 20), ("64MiB", 64 << 20), ("2G", 2 << 30),
                                            ("1.5k", 1536), ("300KiB", 300 << 10)])
def test_parse_bytes(text, expected):
    assert cli.parse_bytes(text) == expected


def test_parse_bytes_refuses_garbage():
    with pytest.raises(argparse.ArgumentTypeError, match="not a byte size"):
        cli.bytes_arg()("lots")


def test_serve_on_a_missing_model_exits_1_with_the_path(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    assert cli.main(["serve", str(missing), "--port", "1"]) == 1
    assert str(missing) in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [(["--replicas", "0"], "--replicas must be >= 1, got 0"),
                                            (["--replicas", "2", "--imbalance-threshold", "-1"],
                                             "imbalance_threshold must be >= 0, got -1")])
def test_serve_replica_flags_refused_before_ray_starts(flags, message, capsys):
    assert cli.main(["serve", *flags, "--port", "1"]) == 1
    assert message in capsys.readouterr().err
