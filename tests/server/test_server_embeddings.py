"""``POST /v1/embeddings`` on the tiny random Qwen2.5-VL server against ``LLM.embed`` on the
same folder and settings: text, token ids and conversations with images give the library's
vectors; base64 (little-endian float32) decodes to the float answer; ``dimensions``; errors
in OpenAI's shape naming the field."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest

from atlas_vlm import PoolingParams
from helpers import IMAGES

pytestmark = [pytest.mark.server, pytest.mark.vlm]

TEXTS = ["Hello world", "Embeddings on a paged cache."]


def data_uri(name: str) -> str:
    kind = "png" if name.endswith(".png") else "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode((IMAGES / name).read_bytes()).decode()


def image_conv(image: str, text: str, as_url: bool) -> list[dict]:
    part = {"type": "image_url", "image_url": {"url": data_uri(image)}} if as_url else \
        {"type": "image", "image": str(IMAGES / image)}
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json={"model": "tiny-vl", **body}, timeout=300)


def unpack(b64: str) -> list[float]:
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


def test_text_inputs_equal_library_and_base64_decodes_to_floats(vlm_server, vlm_llm):
    client = vlm_server.client()
    ref = vlm_llm.embed(TEXTS, use_tqdm=False)
    floats = client.embeddings.create(model="tiny-vl", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1] and floats.model == "tiny-vl"
    for d, r in zip(floats.data, ref):
        assert close(d.embedding, r.embedding)
    n = sum(len(r.prompt_token_ids) for r in ref)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == n
    b64 = client.embeddings.create(model="tiny-vl", input=TEXTS, encoding_format="base64")
    assert [unpack(d.embedding) for d in b64.data] == [d.embedding for d in floats.data]  # float32 both ways
    default = client.embeddings.create(model="tiny-vl", input=TEXTS)  # the SDK asks base64 and decodes it
    assert [list(d.embedding) for d in default.data] == [d.embedding for d in floats.data]


def test_token_ids_and_dimensions(vlm_server, vlm_llm):
    client = vlm_server.client()
    (ref,) = vlm_llm.embed(TEXTS[1], PoolingParams(dimensions=16), use_tqdm=False)
    ids = ref.prompt_token_ids
    one = client.embeddings.create(model="tiny-vl", input=ids, dimensions=16, encoding_format="float")
    many = client.embeddings.create(model="tiny-vl", input=[ids, ids[:3]], dimensions=16, encoding_format="float")
    assert len(one.data[0].embedding) == 16 and close(one.data[0].embedding, ref.embedding)
    assert close(many.data[0].embedding, ref.embedding) and len(many.data[1].embedding) == 16
    assert abs(sum(x * x for x in many.data[1].embedding) - 1) < 1e-5  # truncated, then normalised
    assert many.usage.prompt_tokens == len(ids) + 3


def test_conversations_with_images_equal_library(vlm_server, vlm_llm):
    text = "Describe the picture."
    lib = vlm_llm.embed([{"messages": image_conv(img, text, False), "add_generation_prompt": False}
                         for img in ("chelsea.png", "grace_hopper.jpg")], use_tqdm=False)
    listed = post(vlm_server, {"input": [{"messages": image_conv(img, text, True)}
                                         for img in ("chelsea.png", "grace_hopper.jpg")], "encoding_format": "float"})
    single = post(vlm_server, {"messages": image_conv("grace_hopper.jpg", text, True), "encoding_format": "base64"})
    assert listed.status_code == 200 and single.status_code == 200, (listed.text, single.text)
    got = [d["embedding"] for d in listed.json()["data"]]
    assert close(got[0], lib[0].embedding) and close(got[1], lib[1].embedding)
    assert not close(got[0], got[1], 1e-3)  # different images, different vectors
    assert close(unpack(single.json()["data"][0]["embedding"]), lib[1].embedding)
    assert single.json()["usage"]["prompt_tokens"] == len(lib[1].prompt_token_ids)


@pytest.mark.parametrize("body, param, words", [
    ({"input": "hi", "dimensions": 65}, "dimensions", "hidden size (64)"),
    ({"input": "hi", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": ["ok", ""]}, "input.1", "empty"),
    ({"input": [[]]}, "input", "empty"),
    ({"input": "word " * 1100}, "input", "max_model_len"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
    ({"input": "hi", "messages": [{"role": "user", "content": "x"}]}, None, "exactly one of input and messages"),
    ({"input": "hi", "pooling": "cls"}, "pooling", "not supported"),
])
def test_errors_name_the_field(vlm_server, body, param, words):
    r = post(vlm_server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_sdk_error_and_server_still_serves(vlm_server, vlm_llm):
    client = vlm_server.client()
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model="tiny-vl", input="hi", dimensions=65)
    (ref,) = vlm_llm.embed("hi", use_tqdm=False)
    assert close(client.embeddings.create(model="tiny-vl", input="hi", encoding_format="float").data[0].embedding,
                 ref.embedding)
