"""``ReplicaRouter`` and ``routing_keys`` without Ray: keys chain like the BlockManager's
block hashes, shared prefixes share keys, images are keyed by content; cache-aware choice,
its imbalance fallback, the least-loaded baseline, the LRU bound and a failed replica."""

from __future__ import annotations

import pytest

from atlas_vlm.entrypoints.replica_router import ReplicaRouter, routing_keys
from mm_kv_cache_management.hashing import block_hash

pytestmark = [pytest.mark.server, pytest.mark.text]


def test_token_id_keys_are_the_block_managers_chained_block_hashes():
    ids = list(range(100, 140))  # 2 full blocks of 16 + 8 tokens
    hashes, images = routing_keys({"prompt_token_ids": ids})
    h0 = block_hash(None, ids[:16])
    assert hashes == [h0, block_hash(h0, ids[16:32])] and images == []


def test_shared_text_prefix_shares_leading_keys_only():
    a, _ = routing_keys("x" * 130 + "tail one")
    b, _ = routing_keys("x" * 130 + "other tail")
    c, _ = routing_keys("y" + "x" * 129)
    assert len(a) == 2 and a == b  # 138 bytes: 2 full 64-byte blocks, both inside the shared prefix
    assert not set(a) & set(c)  # a different first byte changes every chained hash


def test_chat_keys_include_roles_and_image_digests():
    from PIL import Image

    red, blue = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (8, 8), "blue")

    def chat(img, text):
        return {"messages": [{"role": "user", "content": [{"type": "image", "image": img},
                                                          {"type": "text", "text": text * 40}]}]}
    k1, i1 = routing_keys(chat(red, "a"))
    k2, i2 = routing_keys(chat(Image.new("RGB", (8, 8), "red"), "a"))  # same pixels, another object
    k3, i3 = routing_keys(chat(blue, "a"))
    assert i1 == i2 and k1 == k2 and len(i1) == 1
    assert i3 != i1 and k3[0] != k1[0]
    ks, _ = routing_keys({"messages": [{"role": "system", "content": "a" * 80}]})
    ku, _ = routing_keys({"messages": [{"role": "user", "content": "a" * 80}]})
    assert ks != ku


def test_cache_aware_follows_the_prefix_until_the_replica_is_much_busier():
    r = ReplicaRouter(2, "cache_aware", imbalance_threshold=2)
    a, _ = routing_keys({"prompt_token_ids": list(range(64))})
    first = r.choose(a, [])
    assert first == 0  # no owner yet: least loaded, lowest index
    r.started(0)
    r.started(0)
    assert r.choose(a, []) == 0  # 2 in flight vs 0: within the threshold
    r.started(0)
    assert r.choose(a, []) == 1  # 3 vs 0: over it -> the least-loaded replica, which now owns the keys
    assert r.decisions == {"cache_hit": 1, "load_balance": 1, "no_key": 1}
    longer, _ = routing_keys({"prompt_token_ids": list(range(80))})
    assert r.choose(longer, []) == 1  # its deepest known block is owned by replica 1


def test_least_loaded_ignores_the_cache_and_images_route_alone():
    r = ReplicaRouter(2, "least_loaded")
    keys, _ = routing_keys({"prompt_token_ids": list(range(64))})
    assert [r.choose(keys, []) for _ in range(2)] == [0, 0]
    r.started(0)
    assert r.choose(keys, []) == 1
    ca = ReplicaRouter(2, "cache_aware")
    ca.started(0)
    assert ca.choose([], ["img"]) == 1
    ca.started(1)
    ca.started(1)
    assert ca.choose([], ["img"]) == 1  # the image's encoding (and its blocks) live on replica 1


def test_lru_bound_and_failed_replica_forget_owners():
    r = ReplicaRouter(2, "cache_aware", max_entries=3)
    keys, _ = routing_keys({"prompt_token_ids": list(range(80))})  # 5 blocks
    r.choose(keys, [])
    assert list(r.owner) == keys[2:]  # the 3 most recent entries stay
    r.mark(0, False)
    assert not r.owner and r.least_loaded() == 1 and r.choose(keys, []) == 1
    r.mark(0, True)
    assert r.least_loaded() == 0


@pytest.mark.parametrize("kwargs, match", [(dict(num_replicas=0), "num_replicas"),
                                           (dict(num_replicas=2, policy="random"), "routing policy"),
                                           (dict(num_replicas=2, imbalance_threshold=-1), "imbalance_threshold")])
def test_bad_router_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ReplicaRouter(**kwargs)
