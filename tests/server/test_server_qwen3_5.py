"""``atlas-vlm serve`` on a tiny random Qwen3.5 VLM (hybrid: Gated DeltaNet state slots beside
the paged KV cache, the Qwen3.5 tower): an image sent to ``/v1/chat/completions`` as a
``data:`` URI, greedy, returns the in-process ``LLM``'s text for the same image and settings,
and a text-only chat beside it does too."""

from __future__ import annotations

import base64

import pytest

from atlas_vlm import LLM, SamplingParams
from helpers import IMAGES
from qwen3_5_helpers import build_tiny_qwen3_5, tiny_vl_config
from server_process import ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.vlm]

PX = 32 * 32  # pixels per visual token (patch 16, merge 2)
SETTINGS = dict(max_model_len=1024, num_kvcache_blocks=128, min_pixels=16 * PX, max_pixels=40 * PX, dtype="float32",
                device="cpu")
PHOTO = IMAGES / "grace_hopper.jpg"
N = 8


@pytest.fixture(scope="module")
def q35_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_qwen3_5_serve")
    build_tiny_qwen3_5(folder, seed=9, config=tiny_vl_config())
    args = [x for k, v in SETTINGS.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    server = ServerProcess(str(folder), *args, name="tiny-q35")
    yield server, LLM(str(folder), **SETTINGS)
    server.stop()


def test_image_chat_completion_equals_the_library(q35_server):
    server, llm = q35_server
    uri = "data:image/jpeg;base64," + base64.b64encode(PHOTO.read_bytes()).decode()
    r = server.client().chat.completions.create(
        model="tiny-q35", max_tokens=N, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                               {"type": "text", "text": "Describe this image."}]}])
    conv = [{"role": "user", "content": [{"type": "image", "image": str(PHOTO)},
                                         {"type": "text", "text": "Describe this image."}]}]
    ref = llm.chat(conv, SamplingParams(temperature=0, max_tokens=N), use_tqdm=False)[0]
    assert len(ref.token_ids) == N
    assert r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == N and r.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_text_chat_completion_equals_the_library(q35_server):
    server, llm = q35_server
    msgs = [{"role": "user", "content": "Name three colours."}]
    r = server.client().chat.completions.create(model="tiny-q35", max_tokens=N, temperature=0, messages=msgs)
    ref = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=N), use_tqdm=False)[0]
    assert r.choices[0].message.content == ref.text
