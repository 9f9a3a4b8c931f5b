"""``scripts/generate.py`` as a user runs it: text on a model folder, images (real photos)
at the default and at a small ``max_pixels``, and clear errors with exit code 1."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import IMAGES, REPO
from atlas_vlm import LLM, RequestOutput, SamplingParams

FP32 = ["--dtype", "float32"]  # the CLI compared with an in-process reference: both fp32 on any CPU


def _cli():
    spec = importlib.util.spec_from_file_location("generate_cli", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.text
def test_text_prompt_streams_the_greedy_answer(tiny_models, capsys):
    folder = tiny_models["qwen2"][0]
    rc = _cli().main([*FP32, "--model", str(folder), "--prompt", "Hello there", "--max-tokens", "8", "--no-chat"])
    out = capsys.readouterr()
    llm = LLM(str(folder), num_kvcache_blocks=64, dtype="float32")
    expected = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8))
    assert rc == 0
    assert out.out == expected[0].text + "\n"
    assert "[finish_reason=length]" in out.err


@pytest.mark.text
def test_sampling_control_flags_mean_the_library_params(tiny_models, capsys):
    folder = tiny_models["qwen2"][0]
    flags = ["--repetition-penalty", "1.5", "--frequency-penalty", "0.5", "--presence-penalty", "0.25",
             "--logit-bias", "17=5", "--logit-bias", "3=-100"]
    rc = _cli().main([*FP32, "--model", str(folder), "--prompt", "Hello there", "--max-tokens", "8", "--no-chat",
                      *flags])
    out = capsys.readouterr()
    llm = LLM(str(folder), num_kvcache_blocks=64, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.5, frequency_penalty=0.5,
                            presence_penalty=0.25, logit_bias={17: 5.0, 3: -100.0})
    assert rc == 0 and out.out == llm.generate("Hello there", params)[0].text + "\n"
    assert _cli().main(["--model", str(folder), "--prompt", "hi", "--min-p", "2"]) == 1
    assert "min_p must be in [0, 1], got 2.0" in capsys.readouterr().err
    assert _cli().main(["--model", str(folder), "--prompt", "hi", "--logit-bias", "17:5"]) == 1
    assert "--logit-bias '17:5': expected TOKEN_ID=BIAS" in capsys.readouterr().err


@pytest.mark.text
def test_missing_model_is_a_clear_error(capsys, tmp_path):
    rc = _cli().main(["--model", str(tmp_path / "nope"), "--prompt", "hi"])
    assert rc == 1
    assert f"model path {tmp_path / 'nope'} does not exist" in capsys.readouterr().err


@pytest.mark.vlm
@pytest.mark.parametrize("photo", ["chelsea.png", "grace_hopper.jpg", "coffee.png"])
@pytest.mark.parametrize("max_pixels", [None, 64 * 28 * 28])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_image_prompt_on_real_photos(tiny_models, capsys, photo, max_pixels, family):
    folder = tiny_models[family][0]
    args = [*FP32, "--model", str(folder), "--image", str(IMAGES / photo), "--prompt", "Describe it.", "--max-tokens", "6"]
    if max_pixels:
        args += ["--max-pixels", str(max_pixels)]
    rc = _cli().main(args)
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "[finish_reason=" in out.err
    llm = LLM(str(folder), num_kvcache_blocks=256, **({"max_pixels": max_pixels} if max_pixels else {}), dtype="float32")
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(IMAGES / photo)},
                                         {"type": "text", "text": "Describe it."}]}]
    expected = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=6))[0]
    assert out.out == expected.text + "\n"


@pytest.mark.vlm
def test_default_image_model_says_its_words_mean_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_VLM_CACHE", str(tmp_path))
    rc = _cli().main(["--image", str(IMAGES / "chelsea.png"), "--prompt", "What is this?",
                      "--max-tokens", "4", "--max-pixels", str(64 * 28 * 28)])
    err = capsys.readouterr().err
    assert rc == 0
    assert "RANDOM weights" in err and "--model" in err


@pytest.mark.vlm
def test_bad_image_is_a_clear_error(tiny_models, capsys):
    folder = tiny_models["qwen2_5_vl"][0]
    rc = _cli().main(["--model", str(folder), "--image", str(IMAGES / "not_an_image.png"), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "not_an_image.png" in err


class _InterruptedLLM:
    """Stands in for ``atlas_vlm.LLM``: raises Ctrl-C while loading, or after one streamed piece."""

    during_load = True

    def __init__(self, *args, **kwargs):
        if self.during_load:
            raise KeyboardInterrupt

    def chat(self, *args, **kwargs):
        def stream():
            yield RequestOutput("0", None, [], text="Par", new_text="Par")
            raise KeyboardInterrupt
        return stream()


@pytest.mark.text
@pytest.mark.parametrize("during_load", [True, False], ids=["loading", "mid-stream"])
def test_ctrl_c_is_a_one_line_notice_and_exit_130(monkeypatch, capsys, during_load):
    import atlas_vlm

    monkeypatch.setattr(_InterruptedLLM, "during_load", during_load)
    monkeypatch.setattr(atlas_vlm, "LLM", _InterruptedLLM)
    rc = _cli().main(["--dtype", "float32", "--model", "unused", "--prompt", "What is the capital of France?"])
    out = capsys.readouterr()
    assert rc == 130
    assert out.err == "interrupted (Ctrl-C)\n"  # one line, no traceback
    assert out.out == ("" if during_load else "Par\n")


VIDEOS = IMAGES.parent / "videos"


@pytest.mark.vlm
def test_video_prompt_equals_the_library(tiny_models, capsys):
    folder = tiny_models["qwen2_5_vl"][0]
    clip = str(VIDEOS / "frames_30fps_90.mp4")
    rc = _cli().main([*FP32, "--model", str(folder), "--video", clip, "--fps", "1", "--prompt", "What happens?",
                      "--max-tokens", "6"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    llm = LLM(str(folder), num_kvcache_blocks=256, dtype="float32")
    msgs = [{"role": "user", "content": [{"type": "video", "video": clip, "fps": 1.0},
                                         {"type": "text", "text": "What happens?"}]}]
    expected = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=6))[0]
    assert out.out == expected.text + "\n"
    assert expected.prompt_token_ids.count(151656) > 0  # <|video_pad|> tokens: the video reached the model


@pytest.mark.vlm
def test_default_model_runs_a_video_and_a_bad_video_is_a_clear_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ATLAS_VLM_CACHE", str(tmp_path))
    rc = _cli().main(["--video", str(VIDEOS / "short_0.5s_30fps.mp4"), "--prompt", "What is this?",
                      "--max-tokens", "4"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "RANDOM weights" in out.err and "[finish_reason=" in out.err
    rc = _cli().main(["--video", str(VIDEOS / "not_a_video.mp4"), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 1 and "not_a_video.mp4" in err and "not a video" in err


@pytest.mark.text
def test_kv_cache_dtype_flag_equals_the_library(tiny_models, capsys):
    folder = tiny_models["qwen2"][0]
    rc = _cli().main([*FP32, "--model", str(folder), "--prompt", "Hello there", "--max-tokens", "8", "--no-chat",
                      "--kv-cache-dtype", "int8"])
    out = capsys.readouterr()
    llm = LLM(str(folder), num_kvcache_blocks=64, dtype="float32", kv_cache_dtype="int8")
    assert llm.engine.runner.kv_cache.k_cache.dtype == torch.int8
    expected = llm.generate("Hello there", SamplingParams(temperature=0, max_tokens=8))
    assert rc == 0 and out.out == expected[0].text + "\n"


class _NeverLoaded:
    def __init__(self, *args, **kwargs):
        raise AssertionError("the model was loaded before the inputs were checked")


@pytest.mark.text
@pytest.mark.parametrize("args, message", [
    (["--prompt", "  \n"], "--prompt is empty"),
    (["--prompt", ""], "--prompt is empty"),
    (["--image", "/nonexistent/cat.png", "--prompt", "hi"], "--image /nonexistent/cat.png: no such file"),
    (["--image", str(IMAGES), "--prompt", "hi"], f"--image {IMAGES}: is a folder"),
    (["--image", str(IMAGES / "zero_bytes.png"), "--prompt", "hi"], "zero_bytes.png: empty file"),
    (["--image", str(IMAGES / "not_an_image.png"), "--prompt", "hi"], "not_an_image.png: not an image"),
    (["--video", "/nonexistent/clip.mp4", "--prompt", "hi"], "--video /nonexistent/clip.mp4: no such file"),
    (["--video", str(IMAGES / "chelsea.png"), "--prompt", "hi"], "chelsea.png: not a video but a still image"),
    (["--video", str(IMAGES / "grace_hopper.jpg"), "--prompt", "hi"], "grace_hopper.jpg: not a video but a still image"),
    (["--video", str(VIDEOS / "not_a_video.mp4"), "--prompt", "hi"], "not_a_video.mp4: not a video"),
], ids=["blank-prompt", "empty-prompt", "missing-image", "folder-image", "empty-image", "text-as-image",
        "missing-video", "png-as-video", "jpeg-as-video", "text-as-video"])
def test_bad_inputs_fail_before_the_model_loads(monkeypatch, capsys, args, message):
    import atlas_vlm

    monkeypatch.setattr(atlas_vlm, "LLM", _NeverLoaded)
    rc = _cli().main(["--model", "unused", *args])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("error: ") and message in err
