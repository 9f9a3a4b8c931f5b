"""Image downloads have an overall deadline and a byte cap (issue 7, example 11): a server
that drips bytes (in the body or in the headers) is cut off at the deadline, not at a
per-read timeout; a body over the cap, declared or not, is refused. Local server only."""

from __future__ import annotations

import pytest

from helpers import slow_http_server
from mm_token_pipeline import ImageInputError, fetch_url, load_image

pytestmark = pytest.mark.vlm


@pytest.fixture(scope="module")
def server():
    with slow_http_server() as s:
        yield s


@pytest.mark.parametrize("path", ["/drip-body", "/drip-headers"])
def test_dripping_server_cut_off_at_the_overall_deadline(server, path):
    base, srv = server
    with pytest.raises(ImageInputError, match=r"overall deadline of 1\.0 s") as err:
        load_image(base + path, allow_http=True, http_timeout_s=1.0)
    assert base + path in str(err.value)
    drip_path, sent, finished = srv.drips.get(timeout=30)  # the handler notices the hang-up
    assert drip_path == path
    assert not finished and sent < 40  # the client left long before the 20 s drip ended


@pytest.mark.parametrize("path", ["/big", "/big-undeclared"])
def test_byte_cap_declared_or_received(server, path):
    base, _ = server
    with pytest.raises(ImageInputError, match="over max_http_bytes=4999"):
        load_image(base + path, allow_http=True, max_http_bytes=4999)
    assert fetch_url(base + path, timeout_s=5.0, max_bytes=5000) == b"y" * 5000


def test_limits_validated():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        fetch_url("http://127.0.0.1:1/x", timeout_s=0, max_bytes=10)
    with pytest.raises(ValueError, match="max_bytes must be an int >= 1"):
        fetch_url("http://127.0.0.1:1/x", timeout_s=1.0, max_bytes=0)
