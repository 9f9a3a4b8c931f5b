"""``MultiModalOptions``: validated on creation, built from a dict with unknown keys refused,
merged over defaults; the pixel defaults written once (``mm_token_pipeline.resize``)."""

from __future__ import annotations

import re

import pytest

from helpers import REPO
from mm_token_pipeline import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, MultiModalOptions

pytestmark = pytest.mark.vlm


def test_defaults_and_merging():
    assert MultiModalOptions().resolved() == (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS) == (4 * 784, 16384 * 784)
    base = MultiModalOptions(min_pixels=8 * 784, max_pixels=256 * 784)
    assert MultiModalOptions(max_pixels=64 * 784).merged_over(base) == MultiModalOptions(8 * 784, 64 * 784)
    assert MultiModalOptions().merged_over(base) == base
    assert MultiModalOptions.from_value({"max_pixels": 64 * 784}) == MultiModalOptions(max_pixels=64 * 784)
    assert MultiModalOptions.from_value(None) == MultiModalOptions()
    assert MultiModalOptions.from_value(base) is base
    assert not hasattr(base, "__dict__")  # slotted: no stray attribute can be set
    with pytest.raises(AttributeError):
        base.max_pixels = 1  # frozen


@pytest.mark.parametrize(("value", "exc", "cause"), [
    ({"max_pixel": 784}, ValueError, r"mm_options: unknown option\(s\) \['max_pixel'\]"),
    ({"max_pixels": 0}, ValueError, "max_pixels must be a positive int"),
    ({"min_pixels": 1.5}, ValueError, "min_pixels must be a positive int"),
    ({"min_pixels": 2000, "max_pixels": 1000}, ValueError, r"min_pixels \(2000\) must be <= max_pixels \(1000\)"),
    ("max_pixels=5", TypeError, "mm_options must be a MultiModalOptions, a dict or None"),
])
def test_bad_options_refused_by_name(value, exc, cause):
    with pytest.raises(exc, match=cause):
        MultiModalOptions.from_value(value)


def test_merge_that_crosses_bounds_refused():
    with pytest.raises(ValueError, match=r"min_pixels \(3136\) must be <= max_pixels \(784\)"):
        MultiModalOptions(max_pixels=784).merged_over(MultiModalOptions(min_pixels=3136))


def test_pixel_defaults_written_once():
    """Only mm_token_pipeline/resize.py spells the default bounds out."""
    literal = re.compile(r"(16384|4)\s*\*\s*28\s*\*\s*28")
    hits = [str(p.relative_to(REPO)) for folder in ("atlas_vlm", "mm_token_pipeline", "scripts")
            for p in (REPO / folder).rglob("*.py") if literal.search(p.read_text())]
    assert hits == ["mm_token_pipeline/resize.py"]
