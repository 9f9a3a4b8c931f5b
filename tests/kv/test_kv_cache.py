"""PagedKVCache / ContiguousKVCache storage: exact round trips through slot mappings, paged ==
contiguous, capacity math, and isolation between requests at the storage level (MAC-4/5)."""

from __future__ import annotations

import pytest
import torch

from mm_kv_cache_management import (
    BlockManager,
    BlockTable,
    ContiguousKVCache,
    KVCacheSpec,
    PagedKVCache,
    RequestState,
)

pytestmark = pytest.mark.text

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def random_kv(n: int, seed: int, spec: KVCacheSpec = SPEC) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[num_layers, n, kv_heads, head_dim]`` with distinct values everywhere."""
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, n, spec.num_kv_heads, spec.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def write_all(cache, table: BlockTable, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
    """Write tokens ``start .. start+n-1`` of one request in every layer."""
    n = k.shape[1]
    slots = torch.tensor(table.slots(start, start + n), dtype=torch.long)
    for layer in range(k.shape[0]):
        cache.write(layer, slots, k[layer], v[layer])


# ---- capacity math ------------------------------------------------------------------------
def test_bytes_per_token():
    assert SPEC.bytes_per_token == 2 * 2 * 2 * 4 * 4 == 128
    assert KVCacheSpec(24, 8, 128, torch.bfloat16).bytes_per_token == 2 * 24 * 8 * 128 * 2 == 98304
    assert KVCacheSpec(30, 3, 64, torch.float32).bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert KVCacheSpec(1, 1, 1, torch.float16).bytes_per_token == 4


@pytest.mark.parametrize(
    "budget, block_size, expected",
    [
        (0, 16, 0),
        (2047, 16, 0),  # one block of 16 tokens is 16 * 128 = 2048 bytes
        (2048, 16, 1),
        (2048 * 5 + 2047, 16, 5),
        (10**6, 16, 488),  # floor(1_000_000 / 2048)
        (10**6, 1, 7812),  # floor(1_000_000 / 128)
        (128 * 3, 1, 3),
    ],
)
def test_num_blocks_for_budget(budget, block_size, expected):
    assert PagedKVCache.num_blocks_for_budget(budget, SPEC, block_size) == expected


def test_a_budget_below_one_block_cannot_build_a_cache():
    n = PagedKVCache.num_blocks_for_budget(2047, SPEC, 16)
    assert n == 0
    with pytest.raises(ValueError, match=r"at least one block of 16 tokens \(2048 bytes\); got num_blocks=0"):
        PagedKVCache(SPEC, num_blocks=n, block_size=16)
    with pytest.raises(ValueError, match=r"\(2048 bytes\)"):
        PagedKVCache(SPEC, num_blocks=-3, block_size=16)


def test_cache_shapes_and_nbytes():
    cache = PagedKVCache(SPEC, num_blocks=7, block_size=16)
    assert cache.k_cache.shape == (2, 7, 16, 2, 4)
    assert cache.v_cache.shape == (2, 7, 16, 2, 4)
    assert cache.k_cache.dtype == torch.float32
    assert cache.nbytes == 7 * 16 * SPEC.bytes_per_token == 14336
    # the budget that gave 7 blocks is what they use
    assert PagedKVCache.num_blocks_for_budget(cache.nbytes, SPEC, 16) == 7
    contiguous = ContiguousKVCache(SPEC, max_num_seqs=3, max_model_len=40)
    assert contiguous.k_cache.shape == (2, 3, 40, 2, 4)
    assert contiguous.nbytes == 3 * 40 * SPEC.bytes_per_token


# ---- paged round trip ---------------------------------------------------------------------
# non-contiguous, shuffled block ids; lengths that end mid-block, on a boundary, past it
TABLES = {
    "a": (5, [7, 2]),
    "b": (8, [11, 0]),
    "c": (13, [3, 9, 1, 8]),
    "d": (1, [5]),
}


def paged_with_requests(interleave: bool):
    cache = PagedKVCache(SPEC, num_blocks=12, block_size=4)
    tables, data = {}, {}
    for i, (rid, (n, blocks)) in enumerate(TABLES.items()):
        tables[rid] = BlockTable(4, list(blocks), num_tokens=n)
        data[rid] = random_kv(n, seed=i)
    if interleave:
        # every request's tokens in one write per layer, in a shuffled order
        slots = torch.tensor([s for rid, t in tables.items() for s in t.slots(0, t.num_tokens)])
        ks = torch.cat([data[rid][0] for rid in tables], dim=1)
        vs = torch.cat([data[rid][1] for rid in tables], dim=1)
        perm = torch.randperm(len(slots), generator=torch.Generator().manual_seed(0))
        for layer in range(SPEC.num_layers):
            cache.write(layer, slots[perm], ks[layer][perm], vs[layer][perm])
    else:
        for rid, t in tables.items():
            write_all(cache, t, *data[rid])
    return cache, tables, data


@pytest.mark.parametrize("interleave", [False, True])
def test_paged_write_then_gather_returns_tokens_in_order(interleave):
    cache, tables, data = paged_with_requests(interleave)
    order = list(tables)
    max_len = max(t.num_tokens for t in tables.values())
    for layer in range(SPEC.num_layers):
        k, v = cache.gather_kv_for_attention(layer, [tables[r] for r in order], max_len)
        assert k.shape == v.shape == (len(order), max_len, 2, 4)
        for i, rid in enumerate(order):
            n = tables[rid].num_tokens
            assert torch.equal(k[i, :n], data[rid][0][layer])
            assert torch.equal(v[i, :n], data[rid][1][layer])


def test_paged_gather_single_table_and_tensor_forms_agree():
    cache, tables, data = paged_with_requests(interleave=True)
    t = tables["c"]
    k1, v1 = cache.gather_kv_for_attention(1, t, 13)
    assert k1.shape == (1, 13, 2, 4)
    assert torch.equal(k1[0], data["c"][0][1])
    assert torch.equal(v1[0], data["c"][1][1])
    # padded [num_seqs, max_blocks] tensor, padding with block 0 as the attention metadata does
    rows = torch.tensor([[7, 2, 0, 0], [3, 9, 1, 8]])
    k2, v2 = cache.gather_kv_for_attention(0, rows, 13)
    assert torch.equal(k2[0, :5], data["a"][0][0])
    assert torch.equal(k2[1], data["c"][0][0])
    assert torch.equal(v2[1], data["c"][1][0])
    # a shorter max_len cuts every request at that length
    k3, _ = cache.gather_kv_for_attention(0, [tables["b"], tables["a"]], 3)
    assert k3.shape == (2, 3, 2, 4)
    assert torch.equal(k3[0], data["b"][0][0][:3])
    assert torch.equal(k3[1], data["a"][0][0][:3])


def test_paged_write_lands_exactly_in_the_block_table_slots():
    cache, tables, data = paged_with_requests(interleave=False)
    # token 6 of c: block c[1] = 9, offset 2
    assert torch.equal(cache.k_cache[0, 9, 2], data["c"][0][0, 6])
    assert torch.equal(cache.v_cache[1, 9, 2], data["c"][1][1, 6])
    # token 4 of a: block a[1] = 2, offset 0
    assert torch.equal(cache.k_cache[1, 2, 0], data["a"][0][1, 4])
    # the untouched rest of the cache is still zero: blocks 4, 6, 10, and tails of partial blocks
    for blk in (4, 6, 10):
        assert torch.count_nonzero(cache.k_cache[:, blk]) == 0
        assert torch.count_nonzero(cache.v_cache[:, blk]) == 0
    assert torch.count_nonzero(cache.k_cache[:, 2, 1:]) == 0  # a: 5 tokens, block 2 holds token 4 only
    assert torch.count_nonzero(cache.k_cache[:, 5, 1:]) == 0  # d: 1 token
    assert torch.count_nonzero(cache.k_cache[:, 8, 1:]) == 0  # c: 13 tokens, block 8 holds token 12


def test_paged_prefill_then_decode_one_token_at_a_time():
    cache = PagedKVCache(SPEC, num_blocks=8, block_size=4)
    bm = BlockManager(8, 4)
    bm.prefill_allocate(RequestState("pad", [0, 0]))  # so the request below starts at block 1
    req = RequestState("r", list(range(6)))
    table = bm.prefill_allocate(req)
    assert table.block_ids == [1, 2]
    k, v = random_kv(11, seed=3)
    write_all(cache, table, k[:, :6], v[:, :6])
    for pos in range(6, 11):
        req.token_ids.append(pos)
        slot = bm.decode_append(req)
        for layer in range(2):
            cache.write(layer, torch.tensor([slot]), k[layer, pos : pos + 1], v[layer, pos : pos + 1])
    assert table.block_ids == [1, 2, 3]
    for layer in range(2):
        kg, vg = cache.gather_kv_for_attention(layer, table, 11)
        assert torch.equal(kg[0], k[layer])
        assert torch.equal(vg[0], v[layer])


def test_layers_are_independent():
    cache = PagedKVCache(SPEC, num_blocks=2, block_size=4)
    t = BlockTable(4, [1], num_tokens=3)
    k, v = random_kv(3, seed=9)
    cache.write(1, torch.tensor(t.slots(0, 3)), k[1], v[1])
    assert torch.count_nonzero(cache.k_cache[0]) == 0
    assert torch.count_nonzero(cache.v_cache[0]) == 0
    kg, _ = cache.gather_kv_for_attention(1, t, 3)
    assert torch.equal(kg[0], k[1])


def test_write_casts_to_the_cache_dtype():
    spec = KVCacheSpec(1, 1, 4, torch.bfloat16)
    cache = PagedKVCache(spec, num_blocks=2, block_size=2)
    k = torch.tensor([[[1.0, 2.5, -3.0, 1 / 3]]])
    cache.write(0, torch.tensor([3]), k, -k)
    assert cache.k_cache.dtype == torch.bfloat16
    assert torch.equal(cache.k_cache[0, 1, 1], k[0].to(torch.bfloat16))
    assert torch.equal(cache.v_cache[0, 1, 1], (-k[0]).to(torch.bfloat16))


# ---- contiguous reference -----------------------------------------------------------------
def contiguous_with_requests():
    cache = ContiguousKVCache(SPEC, max_num_seqs=5, max_model_len=16)
    strips = {"a": 3, "b": 0, "c": 4, "d": 1}
    tables, data = {}, {}
    for i, (rid, (n, _)) in enumerate(TABLES.items()):
        tables[rid] = BlockTable(16, [strips[rid]], num_tokens=n)
        data[rid] = random_kv(n, seed=i)  # same data as the paged fixture
        write_all(cache, tables[rid], *data[rid])
    return cache, tables, data


def test_contiguous_write_then_gather_returns_tokens_in_order():
    cache, tables, data = contiguous_with_requests()
    assert tables["c"].slots(0, 3) == [64, 65, 66]
    order = ["d", "c", "a", "b"]
    for layer in range(SPEC.num_layers):
        k, v = cache.gather_kv_for_attention(layer, [tables[r] for r in order], 13)
        assert k.shape == v.shape == (4, 13, 2, 4)
        for i, rid in enumerate(order):
            n = tables[rid].num_tokens
            assert torch.equal(k[i, :n], data[rid][0][layer])
            assert torch.equal(v[i, :n], data[rid][1][layer])
    # the strip of c holds c's tokens at positions 0..12 and nothing after
    assert torch.equal(cache.k_cache[0, 4, :13], data["c"][0][0])
    assert torch.count_nonzero(cache.k_cache[:, 4, 13:]) == 0
    assert torch.count_nonzero(cache.k_cache[:, 2]) == 0  # unused strip


def test_paged_and_contiguous_gather_identical_tensors():
    paged, ptables, pdata = paged_with_requests(interleave=True)
    contig, ctables, cdata = contiguous_with_requests()
    for layer in range(SPEC.num_layers):
        for rid in TABLES:
            n = TABLES[rid][0]
            kp, vp = paged.gather_kv_for_attention(layer, ptables[rid], n)
            kc, vc = contig.gather_kv_for_attention(layer, ctables[rid], n)
            assert kp.shape == kc.shape == (1, n, 2, 4)
            assert torch.equal(kp, kc)
            assert torch.equal(vp, vc)
        # batched: every request's valid prefix agrees
        order = list(TABLES)
        kp, vp = paged.gather_kv_for_attention(layer, [ptables[r] for r in order], 13)
        kc, vc = contig.gather_kv_for_attention(layer, [ctables[r] for r in order], 13)
        for i, rid in enumerate(order):
            n = TABLES[rid][0]
            assert torch.equal(kp[i, :n], kc[i, :n])
            assert torch.equal(vp[i, :n], vc[i, :n])


# ---- isolation (MAC-4/5 at the storage level) ---------------------------------------------
def test_writing_one_request_leaves_the_others_bit_identical():
    cache, tables, data = paged_with_requests(interleave=False)
    before_k, before_v = cache.k_cache.clone(), cache.v_cache.clone()
    # a's decode tokens 5, 6, 7 fill the rest of block 2; then a new block 6
    a = tables["a"]
    a.block_ids.append(6)
    k_new, v_new = random_kv(4, seed=42)
    write_all(cache, a, k_new, v_new, start=5)  # tokens 5..8
    written = torch.zeros(12, 4, dtype=torch.bool)
    for s in a.slots(5, 9):
        written[s // 4, s % 4] = True
    assert torch.equal(cache.k_cache[:, ~written], before_k[:, ~written])
    assert torch.equal(cache.v_cache[:, ~written], before_v[:, ~written])
    for rid in ("b", "c", "d"):
        n = tables[rid].num_tokens
        for layer in range(2):
            k, v = cache.gather_kv_for_attention(layer, tables[rid], n)
            assert torch.equal(k[0], data[rid][0][layer])
            assert torch.equal(v[0], data[rid][1][layer])
    k, _ = cache.gather_kv_for_attention(0, a, 9)
    assert torch.equal(k[0, :5], data["a"][0][0])
    assert torch.equal(k[0, 5:], k_new[0])


def test_reused_blocks_of_a_freed_request_change_nothing_for_the_others():
    bs = 4
    bm = BlockManager(6, bs)
    cache = PagedKVCache(SPEC, num_blocks=6, block_size=bs)
    a, b = RequestState("a", list(range(7))), RequestState("b", list(range(100, 110)))
    assert bm.prefill_allocate(a).block_ids == [0, 1]
    assert bm.prefill_allocate(b).block_ids == [2, 3, 4]
    ka, va = random_kv(7, seed=1)
    kb, vb = random_kv(10, seed=2)
    write_all(cache, a.block_table, ka, va)
    write_all(cache, b.block_table, kb, vb)
    b_blocks = list(b.block_table.block_ids)
    b_k, b_v = cache.k_cache[:, b_blocks].clone(), cache.v_cache[:, b_blocks].clone()

    bm.free_request(a)
    c = RequestState("c", list(range(200, 212)))  # 3 blocks: 5, then a's 1, 0 (tail first)
    assert bm.prefill_allocate(c).block_ids == [5, 1, 0]
    kc, vc = random_kv(12, seed=3)
    write_all(cache, c.block_table, kc, vc)

    assert torch.equal(cache.k_cache[:, b_blocks], b_k)
    assert torch.equal(cache.v_cache[:, b_blocks], b_v)
    for layer in range(2):
        k, v = cache.gather_kv_for_attention(layer, [b.block_table, c.block_table], 12)
        assert torch.equal(k[0, :10], kb[layer])
        assert torch.equal(v[0, :10], vb[layer])
        assert torch.equal(k[1], kc[layer])
        assert torch.equal(v[1], vc[layer])


def test_a_refused_allocation_leaves_every_kv_bit_identical():
    bm = BlockManager(3, 4)
    cache = PagedKVCache(SPEC, num_blocks=3, block_size=4)
    a = RequestState("a", list(range(6)))
    bm.prefill_allocate(a)
    ka, va = random_kv(6, seed=5)
    write_all(cache, a.block_table, ka, va)
    before_k, before_v = cache.k_cache.clone(), cache.v_cache.clone()
    big = RequestState("big", list(range(9)))  # needs 3 blocks, 1 free
    with pytest.raises(Exception) as info:
        bm.prefill_allocate(big)
    assert type(info.value).__name__ == "NoFreeBlocksError"
    assert big.block_table is None
    assert bm.num_free_blocks == 1
    assert torch.equal(cache.k_cache, before_k)
    assert torch.equal(cache.v_cache, before_v)
    k, v = cache.gather_kv_for_attention(0, a.block_table, 6)
    assert torch.equal(k[0], ka[0])
    assert torch.equal(v[0], va[0])
