"""``atlas-vlm plan``: one model's plan and the four-model ``--matrix``, from config.json alone."""

from __future__ import annotations

import pytest

from atlas_vlm.entrypoints.cli import main, parse_bytes
from atlas_vlm.entrypoints.plan import CHAIN, plan_model
from atlas_vlm.memory_plan import GiB

pytestmark = pytest.mark.text


def _args(**values):
    """The plan subcommand's parsed defaults, with ``values`` over them."""
    import argparse

    from atlas_vlm.entrypoints.plan import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    return argparse.Namespace(**{**vars(sub.choices["plan"].parse_args([])), **values})


def test_plan_one_model(capsys):
    assert main(["plan", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--gpu-memory", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "KV per token                    12,288 bytes" in out
    assert "KV per block (16 tokens)        196,608 bytes" in out
    assert "blocks (num_kvcache_blocks=-1)  107,477 (1,719,632 tokens)" in out  # see test_memory_plan
    assert "sequences of L=4096             419 at once" in out


def test_plan_a_local_folder_and_options(capsys, tiny_models):
    folder = tiny_models["qwen2_5_vl"][0]
    assert main(["plan", "--model", str(folder), "--gpu-memory", "2GiB", "--dtype", "fp32",
                 "--max-model-len", "512", "--max-pixels", str(64 * 28 * 28)]) == 0
    out = capsys.readouterr().out
    assert "KV per token                    512 bytes" in out  # 2 layers x 2 (K, V) x 2 kv heads x 16 x 4 bytes
    assert "max_pixels=50,176 (64 visual tokens per image; given)" in out
    # weights 78,422,912 bytes (fp32); vision peak: 2 x 256 patches x (5 x 32 + 2 x 64) x 4 bytes
    budget = int(2 * GiB * 0.9) - (78_422_912 + (512 << 20)) - ((512 << 20) + 2 * 256 * 288 * 4)
    assert f"blocks (num_kvcache_blocks=-1)  {budget // 8192:,} " in out


def test_matrix_prints_the_four_models_on_six_gpus(capsys):
    assert main(["plan", "--matrix"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[1]
    for g in (8, 12, 16, 24, 48, 80):
        assert f"{g} GiB" in header
    rows = {line.split()[0]: line.split() for line in lines[2:6]}
    assert list(rows) == list(CHAIN)
    assert "each model's own max_pixels" in lines[0]
    assert rows["Qwen/Qwen3-VL-4B-Instruct"][5:7] == ["-", "(0)"]  # 8 GiB cannot hold 8.27 GiB of weights
    # the released processors allow 16,384-token images (Qwen3-VL: 16,777,216 px / 32**2), longer than L:
    # those rows are planned at the largest usable image (3/4 of L = 3,072 tokens), marked '*', and say its size
    for model, patch in (("Qwen/Qwen3-VL-4B-Instruct", 32), ("Qwen/Qwen2.5-VL-3B-Instruct", 28)):
        usable = 3072 * patch * patch
        assert rows[model][4] == "16384" and rows[model][-2] == f"{usable:,}"
        explicit = plan_model(model, _args(max_pixels=usable), gpu_memory=24 * GiB, max_model_len=4096)
        assert rows[model][11] == f"{explicit.max_num_seqs}*" and rows[model][12] == f"({explicit.num_blocks})"
    assert rows["HuggingFaceTB/SmolVLM2-2.2B-Instruct"][-2] == "-"  # its 1,377-token images fit
    assert rows["Qwen/Qwen2.5-0.5B-Instruct"][3:5] == ["12,288", "-"]
    assert rows["Qwen/Qwen2.5-0.5B-Instruct"][11:13] == ["419", "(107477)"]  # 24 GiB column
    # the last column: a 10 s clip at qwen-vl-utils' fps 2: 20 frames, 10 groups of 768 tokens
    assert [rows[m][-1] for m in CHAIN] == ["7680", "7680", "-", "-"]  # SmolVLM2's config states no video_sampling


def test_plan_has_a_video_row(capsys, tmp_path):
    assert main(["plan", "--model", "Qwen/Qwen2.5-VL-3B-Instruct", "--max-model-len", "32768",
                 "--video-seconds", "60"]) == 0
    out = capsys.readouterr().out
    # 60 s at fps 2 = 120 frames; per frame min(768 tokens, 0.9 * 128000 / 120 * 2 tokens) * 28**2 px
    assert "video bound" in out and "60 s clip: 120 frames x 602,112 pixels = 46,080 visual tokens" in out


def test_matrix_with_an_explicit_bound(capsys):
    assert main(["plan", "--matrix", "--max-pixels", str(1280 * 28 * 28)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "one image at max_pixels=1,003,520" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[2:6]}
    assert rows["Qwen/Qwen2.5-VL-3B-Instruct"][4] == "1280" and rows["Qwen/Qwen2.5-VL-3B-Instruct"][11] != "img>L"
    # then the same four with int4 decoder projections (group 128, bf16 scales and zeros)
    int4 = {line.split()[0]: line.split()[1:] for line in lines[6:10]}
    assert list(int4) == list(CHAIN) and all(r[0] == "int4" for r in int4.values())
    assert int4["Qwen/Qwen2.5-VL-3B-Instruct"][5:7] == ["19", "(5004)"]  # 8 GiB: >= 8 sequences of 1,280-token images
    assert int4["Qwen/Qwen3-VL-4B-Instruct"][1:3] == ["3.30", "GiB"] and int4["Qwen/Qwen3-VL-4B-Instruct"][5] == "4"


def test_plan_takes_the_checkpoints_bound_and_says_so(capsys):
    """Qwen2.5-VL-3B at its released max_pixels: one image is 16,384 tokens, more than L=4,096;
    plan says so and plans the largest usable image (3,072 tokens, 3/4 of L: 3,072 x 28 x 28
    pixels), exit 0 (issue 24: it used to exit 1). An explicit --max-pixels over L still fails."""
    usable = 3072 * 28 * 28  # 2,408,448
    assert main(["plan", "--model", "Qwen/Qwen2.5-VL-3B-Instruct"]) == 0
    out = capsys.readouterr().out
    assert "note: the checkpoint's max_pixels=12,845,056 (from " in out
    assert "Qwen2.5-VL-3B-Instruct/preprocessor_config.json) is 16,384 visual tokens per image, more than L=4,096" in out
    assert f"run the engine with --max-pixels {usable} " in out
    assert f"max_pixels={usable:,} (3,072 visual tokens per image; from the largest usable image" in out
    assert main(["plan", "--model", "Qwen/Qwen2.5-VL-3B-Instruct", "--max-pixels", str(usable)]) == 0
    same = capsys.readouterr().out  # the same figures as that explicit bound
    for label in ("blocks (num_kvcache_blocks=-1)", "sequences of L=4096", "vision activation peak"):
        assert next(x for x in out.splitlines() if x.startswith(label)) == \
            next(x for x in same.splitlines() if x.startswith(label))
    assert main(["plan", "--model", "Qwen/Qwen2.5-VL-3B-Instruct", "--max-pixels", "12845056"]) == 1
    out = capsys.readouterr().out
    assert "does not fit: one image at max_pixels=12,845,056 is 16,384 visual tokens, more than L=4,096" in out
    assert f"the largest usable image is max_pixels={usable:,}" in out
    assert main(["plan", "--model", "Qwen/Qwen2.5-VL-3B-Instruct", "--max-model-len", "32768"]) == 0
    assert main(["plan", "--model", "Qwen/Qwen3-VL-4B-Instruct", "--gpu-memory", "8GiB"]) == 1
    assert "does not fit: 8.00 GiB x 0.9 holds no KV block after 8.27 GiB of weights" in capsys.readouterr().out


@pytest.mark.parametrize(("text", "value"), [("24GiB", 24 * GiB), ("24G", 24 * GiB), ("80", 80 * GiB),
                                             ("24GB", 24 * 10**9), ("512MiB", 512 << 20), ("1.5GiB", 3 * GiB // 2)])
def test_parse_bytes(text, value):
    assert parse_bytes(text, bare_unit=GiB) == value


def test_bad_input_is_a_clear_error(capsys, tmp_path, monkeypatch):
    with pytest.raises(SystemExit):
        main(["plan", "--model", "x", "--gpu-memory", "lots"])
    assert "not a byte size: 'lots'" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert main(["plan", "--model", "nobody/nothing"]) == 1
    assert "huggingface-cli download nobody/nothing" in capsys.readouterr().err


def test_plan_a_hub_id_from_the_cache_offline(capsys, tmp_path, monkeypatch, tiny_models):
    """A Hub id that is not a chain model: its config.json comes from huggingface_hub's cache."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--tiny-org--tiny-qwen3"
    (repo / "snapshots" / rev).mkdir(parents=True)
    (repo / "snapshots" / rev / "config.json").write_text((tiny_models["qwen3"][0] / "config.json").read_text())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["plan", "--model", "tiny-org/tiny-qwen3", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "KV per token                    768 bytes" in out  # 2 layers x 2 (K, V) x 2 kv heads x 24 x 4 bytes
    assert "none (text-only model)" in out


def test_video_seconds_must_be_positive(capsys):
    assert main(["plan", "--matrix", "--video-seconds", "-5"]) == 1
    assert "--video-seconds must be > 0 (seconds), got -5" in capsys.readouterr().err


def test_plan_takes_the_engines_dtype_names(capsys):
    """issue 24: --dtype as serve / generate take it (bfloat16, float16, float32, auto: 2 bytes on a
    GPU), with the short names kept as aliases."""
    outs = {}
    for dtype in ("bfloat16", "bf16", "auto", "float16", "float32", "fp32"):
        assert main(["plan", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--dtype", dtype]) == 0
        outs[dtype] = capsys.readouterr().out
    assert outs["bfloat16"] == outs["bf16"] == outs["auto"] == outs["float16"]
    assert "KV per token                    12,288 bytes" in outs["bfloat16"]  # 24 x 2 x 2 x 64 x 2 bytes
    assert outs["float32"] == outs["fp32"] and "KV per token                    24,576 bytes" in outs["float32"]


def test_the_embedded_default_model_is_planned_offline(capsys, tmp_path, monkeypatch):
    """issue 24: no --model plans the embedded SmolLM2-135M-Instruct (its GGUF header), as serve
    and generate run it; by name or Hub id too, with no Hub (an empty offline cache)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in out and "none (text-only model)" in out
    assert "KV per token                    23,040 bytes" in out  # 30 layers x 2 (K, V) x 3 kv heads x 64 x 2 bytes
    for name in ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert main(["plan", "--model", name]) == 0
        assert capsys.readouterr().out.splitlines()[1:] == out.splitlines()[1:]  # all but the model row


def test_per_video_options_count_the_clip(capsys):
    """issue 24: --frames / --fps / --max-frames, as a video item's nframes / fps / max_frames
    (qwen-vl-utils: 768 tokens per 2-frame group of 28x28 patches at these lengths)."""
    model = ["plan", "--model", "Qwen/Qwen2.5-VL-3B-Instruct", "--max-model-len", "32768"]
    cases = [(["--frames", "8"], 8), (["--fps", "1"], 10), (["--max-frames", "6"], 6)]
    for flags, frames in cases:
        assert main([*model, *flags]) == 0
        out = capsys.readouterr().out
        assert f"10 s clip: {frames} frames x 602,112 pixels = {frames // 2 * 768:,} visual tokens" in out
    assert main([*model, "--frames", "0"]) == 1
    assert "--frames must be > 0, got 0" in capsys.readouterr().err


def test_an_8bit_kv_cache_is_planned_and_in_the_matrix(capsys):
    assert main(["plan", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--gpu-memory", "24GiB",
                 "--kv-cache-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    # 24 layers x (K, V) x 2 KV heads x (64 one-byte codes + one 2-byte scale)
    assert "KV per token                    6,336 bytes (int8 K/V + scales)" in out
    assert "blocks (num_kvcache_blocks=-1)  208,441 " in out  # 1.94x the 107,477 of bf16 K/V
    assert main(["plan", "--matrix"]) == 0
    # after the name: weights (2 words), KV/token, image tok, 6 x "seqs (blocks)", usable px, video tok
    rows = {" ".join(line.split()[:-18]): line.split()[-18:] for line in capsys.readouterr().out.splitlines()[2:]}
    dense, q8 = rows["Qwen/Qwen2.5-0.5B-Instruct"], rows["Qwen/Qwen2.5-0.5B-Instruct kv int8"]
    assert (dense[2], q8[2]) == ("12,288", "6,336") and q8[10:12] == ["814", "(208441)"]  # 24 GiB
    assert "Qwen/Qwen2.5-VL-3B-Instruct int4 kv int8" in rows


def test_serve_takes_kv_cache_dtype():
    from atlas_vlm.entrypoints import cli
    from atlas_vlm.entrypoints.openai.cli_args import engine_config_from_args

    args = cli.build_parser().parse_args(["serve", "m", "--kv-cache-dtype", "int8"])
    assert engine_config_from_args(args).kv_cache_dtype == "int8"
    assert engine_config_from_args(cli.build_parser().parse_args(["serve", "m"])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "m", "--kv-cache-dtype", "int4"])
