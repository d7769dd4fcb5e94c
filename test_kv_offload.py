"""Tests for kv_offload.py. Run: python -m pytest  (CPU; the CUDA cases run when a GPU is present).

Oracles, never the code under test: hand-derived numbers (in each docstring), ToyModel.expected_kv
for KV bytes, the pre-fix variant (every test about either bug must fail there: see
assert_variant), vLLM's copy-test oracle for the worker, and vLLM 0.33 itself when importable
(the differential tests at the end skip cleanly without it).

Sections: hashing and requests; block pool; find_longest_cache_hit; copy worker; toy model and
engine; manager scenarios (vLLM's test_scheduler.py, PR #53532's seven tests); reliability
(random schedules, injected faults, bad input); the notebook; differential tests against vLLM.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import re
import struct
from types import SimpleNamespace

import pytest
import torch

import kv_offload as ko


def bids(blocks):
    return [b.block_id for b in blocks]


def free_ids(pool):
    return bids(pool.free_block_queue.get_all_free_blocks())

# ----------------------------------------------------------------------------- hashing and requests

def test_hash_chain_is_deterministic_and_prefix_sensitive():
    """sha256 chain: same tokens -> same bytes (no per-process seed); a changed token changes
    its block's hash and every later one, but none before it."""
    a = ko.Request("a", list(range(64)), 16)
    b = ko.Request("b", list(range(64)), 16)
    assert a.block_hashes == b.block_hashes and len(a.block_hashes) == 4
    assert all(isinstance(h, bytes) and len(h) == 32 for h in a.block_hashes)
    assert a.block_hashes[0] == hashlib.sha256(ko.NONE_HASH + struct.pack("<16q", *range(16))).digest()
    c = ko.Request("c", list(range(20)) + [999] + list(range(21, 64)), 16)
    assert c.block_hashes[0] == a.block_hashes[0]
    assert all(x != y for x, y in zip(c.block_hashes[1:], a.block_hashes[1:]))


def test_request_hashes_grow_with_output_tokens():
    """block_hashes covers only full hash_block_size chunks, also after appends (int or list)."""
    r = ko.Request("r", list(range(15)), 4)
    assert len(r.block_hashes) == 3            # 15 // 4
    r.append_output_token_ids(15)
    assert len(r.block_hashes) == 4 and r.num_tokens == 16
    r.append_output_token_ids([16, 17, 18])
    assert len(r.block_hashes) == 4            # 19 tokens: still 4 full chunks
    assert r.block_hashes == ko.Request("x", list(range(16)), 4).block_hashes
    assert r.output_token_ids == [15, 16, 17, 18] and r.num_prompt_tokens == 15


def test_group_id_key_roundtrip():
    key = ko.make_block_hash_with_group_id(b"\x01" * 32, 258)
    assert key[-4:] == b"\x00\x00\x01\x02"
    assert ko.get_block_hash(key) == b"\x01" * 32 and ko.get_group_id(key) == 258


# ----------------------------------------------------------------------------- block pool

def test_null_block_and_fifo_allocation():
    """Block 0 is the null block: out of the queue from the start; allocation goes in id order."""
    pool = ko.BlockPool(6, True, 4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3, 4, 5] and pool.get_num_free_blocks() == 5
    blocks = pool.get_new_blocks(3)
    assert bids(blocks) == [1, 2, 3] and all(b.ref_cnt == 1 and b.block_hash is None for b in blocks)
    assert pool.get_usage() == pytest.approx(3 / 5)
    pool.touch([pool.null_block]); pool.free_blocks([pool.null_block])  # silently skipped
    assert pool.null_block.ref_cnt == 0 and free_ids(pool) == [4, 5]


def test_free_order_unhashed_front_hashed_back():
    """free_blocks: unhashed blocks are prepended (reused first), hashed ones appended (LRU),
    each group in the given order."""
    pool = ko.BlockPool(8, True, 2)
    req = ko.Request("r", list(range(8)), 2)
    blocks = pool.get_new_blocks(5)                      # ids 1..5; queue now [6, 7]
    pool.cache_full_blocks(req, blocks, 0, 2, 2, 0)      # 1, 2 hashed
    pool.free_blocks(blocks)                             # order 1, 2, 3, 4, 5
    assert free_ids(pool) == [3, 4, 5, 6, 7, 1, 2]


def test_lru_eviction_order_and_touch_removes_from_queue():
    """Cached free blocks are evicted front first; a touched block leaves the queue and
    survives; a freed block goes to the back (most recently used)."""
    pool = ko.BlockPool(5, True, 2)
    req = ko.Request("r", list(range(8)), 2)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(req, blocks, 0, 4, 2, 0)
    pool.free_blocks(reversed(blocks))                   # vLLM frees tails first: [4, 3, 2, 1]
    assert free_ids(pool) == [4, 3, 2, 1]
    pool.touch([blocks[2]])                              # block 3 hit by another request
    assert free_ids(pool) == [4, 2, 1] and blocks[2].ref_cnt == 1
    new = pool.get_new_blocks(1)
    assert bids(new) == [4] and new[0].block_hash is None            # evicted lazily, now
    assert pool.get_cached_block(req.block_hashes[3], [0]) is None  # its key is gone
    assert pool.get_cached_block(req.block_hashes[2], [0]) == [blocks[2]]
    pool.free_blocks([blocks[2]])
    assert free_ids(pool) == [2, 1, 3]


def test_several_blocks_per_key_and_pop():
    """The map does not de-duplicate; get_one_block returns the first inserted."""
    pool = ko.BlockPool(4, True, 2)
    req = ko.Request("r", [5, 6], 2)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, [b1], 0, 1, 2, 0)
    pool.cache_full_blocks(req, [b2], 0, 1, 2, 0)
    key = b1.block_hash
    m = pool.cached_block_hash_to_block
    assert key == b2.block_hash and len(m) == 1 and m.contain(key, 1) and m.contain(key, 2)
    assert m.get_one_block(key) is b1
    assert m.pop(key, 1) is b1 and m.get_one_block(key) is b2
    assert m.pop(key, 7) is None and m.pop(key, 2) is b2 and len(m) == 0


def test_insert_guard_traps_a_stamped_block():
    """Bug 1 in five lines: a block stamped with its key returns at guard 1; the map stays empty."""
    pool = ko.BlockPool(3, True, 4)
    blk = pool.get_new_blocks(1)[0]
    key = ko.make_block_hash_with_group_id(b"k" * 32, 0)
    blk._block_hash = key                              # what the pre-fix manager did
    pool._insert_block_hash(key, blk, None)
    assert pool.cached_block_hash_to_block.get_one_block(key) is None
    blk.reset_hash()                                   # the fix: reset first
    pool._insert_block_hash(key, blk, None)
    assert pool.cached_block_hash_to_block.get_one_block(key) is blk


def test_secondary_keys_registered_found_and_evicted_together():
    """A second key on a hashed block is a secondary; eviction removes primary + secondaries.
    Guard 2: re-inserting a secondary changes nothing."""
    pool = ko.BlockPool(3, True, 4)
    blk = pool.get_new_blocks(1)[0]
    k1, k2 = (ko.make_block_hash_with_group_id(bytes([i]) * 32, 0) for i in (1, 2))
    pool._insert_block_hash(k1, blk, 8)
    pool._insert_block_hash(k2, blk, None)
    pool._insert_block_hash(k2, blk, None)
    assert blk.block_hash == k1 and blk.block_hash_num_tokens == 8
    assert pool.cached_block_hashes_by_block == {blk.block_id: {k2}}
    assert pool.cached_block_hash_to_block.get_one_block(k2) is blk
    pool.free_blocks([blk])
    pool.get_new_blocks(2)                              # [2, 1]: block 1 evicted last
    assert len(pool.cached_block_hash_to_block) == 0 and pool.cached_block_hashes_by_block == {}
    assert blk.block_hash is None


def test_cache_partial_block_promotion():
    """A partial-tail key is the primary of an unfilled block; cache_full_blocks promotes it.
    On a block with a longer primary, the partial key becomes a secondary."""
    pool = ko.BlockPool(4, True, 4)
    req = ko.Request("r", list(range(16)), 4)
    b = pool.get_new_blocks(1)[0]
    k4 = pool.cache_partial_block(req, b, 4, 0)
    assert b.block_hash == k4 and b.block_hash_num_tokens == 4
    pool.cache_full_blocks(req, [b], 0, 1, 8, 0)       # block_size 8: key = fine hash #1
    assert b.block_hash == ko.make_block_hash_with_group_id(req.block_hashes[1], 0)
    assert pool.cached_block_hash_to_block.get_one_block(k4) is None
    pool.cache_partial_block(req, b, 4, 0)
    assert pool.cached_block_hashes_by_block[b.block_id] == {k4}


def test_reset_prefix_cache_refused_while_in_use():
    pool = ko.BlockPool(4, True, 2)
    req = ko.Request("r", [1, 2, 3, 4], 2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 2, 0)
    assert pool.reset_prefix_cache() is False and len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert len(pool.cached_block_hash_to_block) == 0 and all(b.block_hash is None for b in pool.blocks)


def test_caching_disabled_prepends_everything():
    pool = ko.BlockPool(5, False, 2)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(blocks)
    assert free_ids(pool) == [1, 2, 3, 4]


def test_free_queue_primitives():
    blocks = [ko.KVCacheBlock(i) for i in range(5)]
    q = ko.FreeKVCacheBlockQueue(blocks)
    assert q.popleft() is blocks[0] and bids(q.popleft_n(2)) == [1, 2]
    q.remove(blocks[4])
    q.prepend_n([blocks[1], blocks[2]]); q.append(blocks[4]); q.append_n([blocks[0]])
    assert bids(q.get_all_free_blocks()) == [1, 2, 3, 4, 0] and q.num_free_blocks == 5
    with pytest.raises(RuntimeError):
        q.remove(ko.KVCacheBlock(9))
    empty = ko.FreeKVCacheBlockQueue([])
    with pytest.raises(ValueError, match="No free blocks"):
        empty.popleft()


# ----------------------------------------------------------------------------- find_longest_cache_hit

def _cached_pool(tokens, block_size, hash_block_size, n_blocks):
    pool = ko.BlockPool(n_blocks + 2, True, hash_block_size)
    req = ko.Request("r", tokens, hash_block_size)
    blocks = pool.get_new_blocks(n_blocks)
    pool.cache_full_blocks(req, blocks, 0, n_blocks, block_size, 0)
    return pool, req, blocks


def test_longest_hit_stops_at_first_miss_and_respects_max_length():
    """3 blocks of 16 cached; a prompt sharing the first 40 tokens hits 2 blocks (32 tokens);
    max_length 47 allows only 2 whole blocks (47 // 16)."""
    pool, req, blocks = _cached_pool(list(range(48)), 16, 16, 3)
    (hit,), n = ko.find_longest_cache_hit(req.block_hashes, 48, [0], pool, 16)
    assert n == 48 and hit == blocks
    (hit,), n = ko.find_longest_cache_hit(req.block_hashes, 47, [0], pool, 16)
    assert n == 32 and hit == blocks[:2]
    other = ko.Request("o", list(range(40)) + [7] * 8, 16)
    (hit,), n = ko.find_longest_cache_hit(other.block_hashes, 48, [0], pool, 16)
    assert n == 32 and hit == blocks[:2]


def test_fine_grained_hit_needs_a_secondary_key():
    """block 16, hash 4. Block 2 (tokens 16..31) is cached under its full key only: a prompt of
    28 tokens (fine hashes at 20, 24, 28) cannot reach into it. Register the 24-token boundary as a
    secondary: phase 2 probes 28 (miss: the prompt differs after 24) then 24 (hit) -> 24 tokens."""
    pool, req, blocks = _cached_pool(list(range(32)), 16, 4, 2)
    probe = ko.Request("p", list(range(24)) + [99, 99, 99, 99], 4)
    assert ko.find_longest_cache_hit(probe.block_hashes, 28, [0], pool, 16)[1] == 16
    pool.cache_partial_block(req, blocks[1], 24, 0)
    (hit,), n = ko.find_longest_cache_hit(probe.block_hashes, 28, [0], pool, 16)
    assert n == 24 and hit == blocks
    # coarse alignment (the manager's): the same lookup rounds down to whole blocks
    (hit,), n = ko.find_longest_cache_hit(probe.block_hashes, 28, [0], pool, 16, alignment_tokens=16)
    assert n == 16 and hit == blocks[:1]


def test_multi_group_lookup_requires_every_group():
    pool = ko.BlockPool(8, True, 4)
    req = ko.Request("r", list(range(8)), 4)
    g0, g1 = pool.get_new_blocks(2), pool.get_new_blocks(2)
    pool.cache_full_blocks(req, g0, 0, 2, 4, 0)
    pool.cache_full_blocks(req, g1, 0, 1, 4, 1)
    hits, n = ko.find_longest_cache_hit(req.block_hashes, 8, [0, 1], pool, 4)
    assert n == 4 and hits == ([g0[0]], [g1[0]])


# ----------------------------------------------------------------------------- copy worker

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


def _make_caches(layout, device, num_blocks=12):
    g = torch.Generator().manual_seed(1)
    if layout == "flash":   # per layer (2, num_blocks, block_size, heads, dim)
        shape = {f"l{i}": (2, num_blocks, 4, 2, 8) for i in range(2)}
    else:                   # block dimension first, all layers in one tensor
        shape = {"all": (num_blocks, 2, 2, 4, 2, 8)}
    return {k: torch.randn(s, generator=g).to(torch.float16).to(device) for k, s in shape.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["flash", "blocks_first"])
@pytest.mark.parametrize("ids", ["contiguous", "scattered"])
def test_worker_copies_exact_blocks_both_directions(device, layout, ids):
    """vLLM's copy-test oracle: clone both sides first; after the copy the source is unchanged,
    every mapped destination block equals its source block, every unmapped one is untouched."""
    caches = _make_caches(layout, device)
    w = ko.SimpleCPUOffloadWorker(10)
    w.register_kv_caches(caches, 12)
    for r in w.cpu_caches.values():
        r.copy_(torch.randn(r.shape, generator=torch.Generator().manual_seed(2)).to(r.dtype))
    assert all(r.is_pinned() == (device == "cuda") for r in w.cpu_caches.values())
    gpu_ids, cpu_ids = ([3, 4, 5, 6], [1, 2, 3, 4]) if ids == "contiguous" else ([9, 2, 5, 11], [7, 1, 8, 3])
    for direction in ("store", "load"):
        src, dst = (w.gpu_caches, w.cpu_caches) if direction == "store" else (w.cpu_caches, w.gpu_caches)
        s_ids, d_ids = (gpu_ids, cpu_ids) if direction == "store" else (cpu_ids, gpu_ids)
        before_src = {k: v.clone() for k, v in src.items()}
        before_dst = {k: v.clone() for k, v in dst.items()}
        w.bind_connector_metadata(ko.SimpleCPUOffloadMetadata(
            **({"store_event": 0, "store_gpu_blocks": gpu_ids, "store_cpu_blocks": cpu_ids} if direction == "store"
               else {"load_event": 0, "load_gpu_blocks": gpu_ids, "load_cpu_blocks": cpu_ids,
                     "load_event_to_reqs": {0: ["r"]}})))
        (w.wait_for_save if direction == "store" else w.start_load_kv)()
        if device == "cuda":
            torch.cuda.synchronize()
        for k in src:
            assert torch.equal(src[k], before_src[k])
            for s, d in zip(s_ids, d_ids):
                assert torch.equal(dst[k][d].cpu(), src[k][s].cpu())
            untouched = [i for i in range(dst[k].shape[0]) if i not in d_ids]
            assert torch.equal(dst[k][untouched], before_dst[k][untouched])
        _, recv = w.get_finished(set())
        assert recv == ({"r"} if direction == "load" else None)
        meta = w.build_connector_worker_meta()
        assert (meta.completed_store_events == {0: 1}) if direction == "store" else meta is None
        w.clear_connector_metadata()


def test_worker_splits_flash_layout_and_dedups_shared_storage():
    t = torch.zeros(2, 6, 4, 8)
    w = ko.SimpleCPUOffloadWorker(4)
    w.register_kv_caches({"a": t, "b": t}, 6)          # two layers, one storage
    assert list(w.cpu_caches) == ["a.k", "a.v"] and w.cpu_caches["a.k"].shape == (4, 4, 8)


def test_coalesce_runs():
    assert ko._coalesce_runs([1, 2, 3, 7, 8, 4], [5, 6, 7, 9, 10, 1]) == [(1, 5, 3), (7, 9, 2), (4, 1, 1)]
    assert ko._coalesce_runs([1, 2], [2, 1]) == [(1, 2, 1), (2, 1, 1)]


@pytest.mark.parametrize("meta_kwargs, match", [
    ({"store_event": 0, "store_gpu_blocks": [1, 2], "store_cpu_blocks": [1]}, "1 destination"),
    ({"store_event": 0, "store_gpu_blocks": [12], "store_cpu_blocks": [1]}, "source block ids"),
    ({"load_event": 0, "load_gpu_blocks": [1], "load_cpu_blocks": [10]}, "source block ids"),
    ({"load_event": 0, "load_gpu_blocks": [-1], "load_cpu_blocks": [1]}, "destination block ids"),
])
def test_worker_rejects_bad_ids_before_copying(meta_kwargs, match):
    caches = _make_caches("flash", "cpu")
    w = ko.SimpleCPUOffloadWorker(10)
    w.register_kv_caches(caches, 12)
    snap = {k: v.clone() for k, v in {**w.gpu_caches, **w.cpu_caches}.items()}
    with pytest.raises(ValueError, match=match):  # rejected at bind: nothing recorded, nothing copied
        w.bind_connector_metadata(ko.SimpleCPUOffloadMetadata(**meta_kwargs))
    w.wait_for_save(); w.start_load_kv()
    assert all(torch.equal(v, snap[k]) for k, v in {**w.gpu_caches, **w.cpu_caches}.items())
    assert w.get_finished(set()) == (None, None) and w.build_connector_worker_meta() is None


def test_worker_rejects_bad_cache_shapes():
    w = ko.SimpleCPUOffloadWorker(4)
    with pytest.raises(ValueError, match="shape"):
        w.register_kv_caches({"a": torch.zeros(6, 2), "b": torch.zeros(5, 2)})
    with pytest.raises(ValueError, match="no KV caches"):
        w.register_kv_caches({})
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        ko.SimpleCPUOffloadWorker(1)


# ----------------------------------------------------------------------------- toy model and engine

def _story_engine(connector_cls=ko.SimpleCPUOffloadScheduler, num_gpu_blocks=300, num_cpu_blocks=300,
                  block_size=16, budget=512, device="cpu", workers=1, **kw):
    model = ko.ToyModel(2, 2, 16, device=device)
    conn = connector_cls(num_cpu_blocks, block_size, **kw)
    ws = [ko.SimpleCPUOffloadWorker(num_cpu_blocks) for _ in range(workers)]
    eng = ko.MiniEngine(num_gpu_blocks, block_size, budget, model, conn, ws if workers > 1 else ws[0], capture_kv=True)
    return eng, conn, model


def _prompt(n, seed=0):
    return torch.randint(0, 32000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_all_free(eng, conn):
    assert eng.gpu_block_pool.get_num_free_blocks() == eng.gpu_block_pool.num_gpu_blocks - 1
    assert conn.cpu_block_pool.get_num_free_blocks() == conn.num_cpu_blocks - 1
    assert not conn.has_pending_push_work() and not conn._reqs_to_load and not conn._reqs_to_store


def test_toy_model_is_chunking_invariant():
    """KV of a token depends on (id, position) only: chunked writes equal one-shot expected_kv."""
    m = ko.ToyModel(2, 2, 8)
    toks = _prompt(40)
    whole = m.expected_kv(toks)
    parts = torch.cat([m.compute_kv(torch.tensor(toks[i:i + 7]), torch.arange(i, min(i + 7, 40)))
                       for i in range(0, 40, 7)], dim=2)
    assert torch.equal(whole, parts) and whole.shape == (2, 2, 40, 2, 8) and whole.dtype == torch.float16
    assert not torch.equal(whole[:, :, 0], m.expected_kv([toks[1]])[:, :, 0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["fixed", "registration_bug", "flush_bug"])
def test_repeated_prompt_end_to_end(device, variant):
    """A 3000-token prompt, 512-token chunks, block 16. Fixed: B loads (3000-1)//16 = 187 blocks
    = 2992 tokens and computes 8; its KV equals expected_kv bit for bit, outputs match, pools
    end all-free. Registration bug: nothing is findable -> B recomputes all 3000. Flush bug: the
    last chunk's blocks (2560..2991, confirmed in A's last step) never reach CPU -> 2560 loaded."""
    cls, kw = ((ko.SimpleCPUOffloadScheduler, {}) if variant == "fixed" else
               (ko.PreFixCPUOffloadScheduler, {"registration_bug": variant == "registration_bug",
                                               "flush_bug": variant == "flush_bug"}))
    eng, conn, model = _story_engine(cls, device=device, **kw)
    prompt = _prompt(3000)
    eng.add_request(ko.Request("A", prompt, 16))
    eng.run()
    assert eng.reset_gpu_prefix_cache()
    eng.add_request(ko.Request("B", prompt, 16))
    st = eng.run()
    a, b = st["A"], st["B"]
    expected_hit = {"fixed": 2992, "registration_bug": 0, "flush_bug": 2560}[variant]
    assert b.cpu_hit_tokens == expected_hit and b.computed_tokens == 3000 - expected_hit
    assert a.output_token_ids == b.output_token_ids and len(b.output_token_ids) == 1
    assert torch.equal(b.kv, model.expected_kv(prompt)) and torch.equal(a.kv, b.kv)
    _assert_all_free(eng, conn)


def test_shared_prefix_decode_and_gpu_hits():
    """Three requests share 1000 tokens (62 whole blocks of 16), then differ. r1 arrives after r0
    finished, GPU cache intact: 992 tokens hit on GPU and the CPU lookup (from 992 on) finds
    nothing more. After the GPU cache is dropped, r2 loads those 62 blocks (992 tokens) from CPU."""
    eng, conn, model = _story_engine()
    shared = _prompt(1000)
    reqs = [ko.Request(f"r{i}", shared + _prompt(100, seed=i + 1), 16, max_tokens=5) for i in range(3)]
    eng.add_request(reqs[0]); eng.run()
    eng.add_request(reqs[1]); eng.run()
    assert eng.reset_gpu_prefix_cache()
    eng.add_request(reqs[2]); st = eng.run()
    assert (st["r1"].gpu_hit_tokens, st["r1"].cpu_hit_tokens) == (992, 0)
    assert (st["r2"].gpu_hit_tokens, st["r2"].cpu_hit_tokens) == (0, 992)
    _assert_all_free(eng, conn)


def test_gpu_preemption_recomputes_and_stays_exact():
    """A GPU pool too small for three 600-token prompts at once forces preemption; every request
    still ends with KV equal to expected_kv and the pools drain."""
    eng, conn, model = _story_engine(num_gpu_blocks=60, budget=256)
    prompts = [_prompt(600, seed=s) for s in range(3)]
    for i, p in enumerate(prompts):
        eng.add_request(ko.Request(f"r{i}", p, 16, max_tokens=3))
    st = eng.run()
    assert sum(s.computed_tokens for s in st.values()) > 3 * 602   # something was recomputed
    for i, p in enumerate(prompts):
        assert torch.equal(st[f"r{i}"].kv, model.expected_kv(p))
    _assert_all_free(eng, conn)


def test_two_workers_world_size_2():
    """Two TP workers: a store completes only once both reported it; the story still holds."""
    eng, conn, model = _story_engine(workers=2, world_size=2)
    prompt = _prompt(1000)
    eng.add_request(ko.Request("A", prompt, 16)); eng.run()
    assert eng.reset_gpu_prefix_cache()
    eng.add_request(ko.Request("B", prompt, 16)); st = eng.run()
    assert st["B"].cpu_hit_tokens == 992 and torch.equal(st["B"].kv, model.expected_kv(prompt))
    _assert_all_free(eng, conn)


# ===============================================================================================
# from test_manager_part.py
BS = 16  # tokens per block unless a test says otherwise
VARIANTS = ("fixed", "registration_bug", "flush_bug")


# -----------------------------------------------------------------------------
# harness


def make_scheduler(variant: str, **kw) -> ko.SimpleCPUOffloadScheduler:
    if variant == "fixed":
        return ko.SimpleCPUOffloadScheduler(**kw)
    return ko.PreFixCPUOffloadScheduler(**kw, registration_bug=variant == "registration_bug",
                                        flush_bug=variant == "flush_bug")


def ids(table) -> tuple[list[int], ...]:
    """Block ids per group of a table of KVCacheBlocks."""
    return tuple([b.block_id for b in grp] for grp in table)


def assert_variant(variant: str, observed, fixed, **bugged) -> None:
    """`fixed` is vLLM's answer after PR #53532; `bugged[v]` is what pre-fix variant `v` must show
    instead (a variant not named is not affected by the scenario and must match `fixed`)."""
    for v, value in bugged.items():
        assert value != fixed, f"a regression test whose {v} answer equals the fixed one proves nothing"
    expected = bugged.get(variant, fixed)
    assert observed == expected, f"{variant}: observed {observed!r}, expected {expected!r}"


class Harness:
    """Plays the engine (a GPU BlockPool bound to the scheduler) and the worker (completions)."""

    def __init__(self, variant="fixed", num_cpu_blocks=8, num_gpu_blocks=64, block_size=BS,
                 hash_block_size=None, group_block_sizes=None, world_size=1):
        self.hbs = hash_block_size or block_size
        self.group_sizes = list(group_block_sizes or [block_size])
        self.world_size = world_size
        self.sched = make_scheduler(variant, num_cpu_blocks=num_cpu_blocks, block_size=block_size,
                                    hash_block_size=hash_block_size,
                                    group_block_sizes=group_block_sizes, world_size=world_size)
        self.gpu = ko.BlockPool(num_gpu_blocks, True, self.hbs)
        self.sched.bind_gpu_block_pool(self.gpu)
        self.cpu = self.sched.cpu_block_pool
        self._n = 0

    # --- requests -----------------------------------------------------------
    def request(self, num_tokens=0, tokens=None) -> ko.Request:
        """A request with `num_tokens` tokens no other request shares (or exactly `tokens`)."""
        self._n += 1
        if tokens is None:
            tokens = range(self._n * 100_000, self._n * 100_000 + num_tokens)
        return ko.Request(f"r{self._n}", list(tokens), self.hbs)

    def twin(self, req: ko.Request) -> ko.Request:
        return self.request(tokens=req.all_token_ids[:req.num_prompt_tokens])

    # --- engine -------------------------------------------------------------
    def alloc(self, req, num_tokens, prev=None, confirm=True, cache=True):
        """Grow `req`'s table to cover `num_tokens` in every group, register its full blocks in the
        GPU prefix cache (as vLLM's KV cache manager does at allocation) and, with `confirm`, mark
        the tokens computed (a finished forward pass)."""
        prev = prev or tuple([] for _ in self.group_sizes)
        table = []
        for g, gs in enumerate(self.group_sizes):
            blocks = list(prev[g]) + self.gpu.get_new_blocks(ko.cdiv(num_tokens, gs) - len(prev[g]))
            if cache:
                num_cached = sum(1 for b in prev[g] if b.block_hash is not None)
                num_full = min(num_tokens, len(req.block_hashes) * self.hbs) // gs
                self.gpu.cache_full_blocks(req, blocks, num_cached, num_full, gs, g)
            table.append(blocks)
        if confirm:
            req.num_computed_tokens = num_tokens
        return tuple(table)

    def step(self, sched_tokens=None, new_blocks=None, resumed=(), preempted=()):
        """One build_connector_meta; `new_blocks` maps req_id -> table of KVCacheBlocks."""
        out = ko.SchedulerOutput(
            num_scheduled_tokens=dict(sched_tokens or {}),
            new_block_ids={rid: ids(t) for rid, t in (new_blocks or {}).items()},
            resumed_req_ids=set(resumed), preempted_req_ids=set(preempted))
        return self.sched.build_connector_meta(out)

    def prefill(self, *reqs_tokens, complete=True):
        """Admit each (req, num_tokens) with no external hit, confirm its tokens and run one step
        that stores them; complete the store unless told not to. Returns (meta, tables)."""
        tables = []
        for req, n in reqs_tokens:
            tables.append(self.alloc(req, n))
            self.sched.update_state_after_alloc(req, tables[-1], 0)
        meta = self.step({r.request_id: n for r, n in reqs_tokens},
                         {r.request_id: t for (r, _), t in zip(reqs_tokens, tables)})
        if complete and meta.store_event >= 0:
            self.complete_store(meta.store_event)
        return meta, tables

    def finish(self, req, table):
        """The request ends: the connector's finish hook, then the engine frees its blocks."""
        assert self.sched.request_finished_all_groups(req, ids(table)) == (False, None)
        for grp in table:
            self.gpu.free_blocks(reversed(grp))

    # --- worker -------------------------------------------------------------
    def complete_store(self, event, count=None):
        meta = ko.SimpleCPUOffloadWorkerMetadata(completed_store_events={event: count or self.world_size})
        self.sched.update_connector_output(ko.KVConnectorOutput(kv_connector_worker_meta=meta))

    def complete_load(self, *req_ids):
        self.sched.update_connector_output(ko.KVConnectorOutput(finished_recving=set(req_ids)))

    # --- observation --------------------------------------------------------
    def probe(self, req, num_computed_tokens=0) -> int:
        """CPU hit tokens a twin of `req` would get; the lookup's pin is released again."""
        twin = self.twin(req)
        hit, is_async = self.sched.get_num_new_matched_tokens(twin, num_computed_tokens)
        assert is_async == (hit > 0)
        self.sched.request_finished(twin, [])
        return hit

    def in_cpu(self, req, g=0) -> list[bool]:
        """For each full group-`g` block of `req`: is its key in the CPU prefix cache map?"""
        scale = self.group_sizes[g] // self.hbs
        keys = [ko.make_block_hash_with_group_id(req.block_hashes[i + scale - 1], g)
                for i in range(0, len(req.block_hashes) - scale + 1, scale)]
        return [self.cpu.cached_block_hash_to_block.get_one_block(k) is not None for k in keys]

    def queued_flush_gpu_ids(self) -> list[int]:
        return [b for t in self.sched._pending_finished_stores for b in t.gpu_block_ids]

    def state(self):
        s = self.sched
        return dict(cpu=pool_state(self.cpu), gpu=pool_state(self.gpu),
                    to_store=sorted(s._reqs_to_store), to_load=sorted(s._reqs_to_load),
                    in_flight=set(s._in_flight_store_gpu_blocks),
                    queued=[(list(t.gpu_block_ids), list(t.cpu_block_ids)) for t in s._pending_finished_stores])


def pool_state(pool: ko.BlockPool) -> dict:
    """Everything observable about a pool: ref counts, hashes, free-queue order, the hash map."""
    hmap = pool.cached_block_hash_to_block
    keys = {b.block_hash for b in pool.blocks if b.block_hash is not None}
    keys |= set().union(*pool.cached_block_hashes_by_block.values())
    return dict(
        ref_cnt=[b.ref_cnt for b in pool.blocks],
        hashes=[(b.block_hash, b.block_hash_num_tokens) for b in pool.blocks],
        free_order=[b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        num_free=pool.get_num_free_blocks(),
        secondaries={k: set(v) for k, v in pool.cached_block_hashes_by_block.items() if v},
        map_len=len(hmap),
        map={k: [b.block_id for b in pool.blocks if hmap.contain(k, b.block_id)] for k in keys},
    )


# -----------------------------------------------------------------------------
# store -> lookup -> load


@pytest.mark.parametrize("variant", VARIANTS)
def test_store_lookup_load_roundtrip(variant):
    """Stored blocks become CPU hits and load into the GPU blocks after the local hit (bug 1: never)."""
    h = Harness(variant)
    req = h.request(2 * BS + 1)  # 33 tokens: 2 full blocks + 1
    meta, (table,) = h.prefill((req, 33))
    # fresh CPU pool: free queue [1..7]; the two stored blocks land in CPU blocks 1 and 2
    assert (meta.store_gpu_blocks, meta.store_cpu_blocks) == (ids(table)[0][:2], [1, 2])
    # registration: both keys in the CPU map. Cap 33-1=32 keeps both blocks: hit 32.
    # Pre-fix: the copy ran but the keys never reach the map: hit 0.
    assert_variant(variant, (h.in_cpu(req), h.probe(req)), ([True, True], 32),
                   registration_bug=([False, False], 0))
    if variant == "registration_bug":
        return
    req2 = h.twin(req)
    assert h.sched.get_num_new_matched_tokens(req2, 0) == (32, True)
    table2 = h.alloc(req2, 33, cache=False, confirm=False)  # 3 GPU blocks: 2 loaded + 1 computed
    h.sched.update_state_after_alloc(req2, table2, 32)
    meta2 = h.step({req2.request_id: 1}, {req2.request_id: table2})
    assert (meta2.load_gpu_blocks, meta2.load_cpu_blocks) == (ids(table2)[0][:2], [1, 2])
    assert meta2.load_event_to_reqs == {meta2.load_event: [req2.request_id]}
    # pinned during the copy: CPU 1 ref (load), GPU 2 refs (request + load)
    assert [h.cpu.blocks[i].ref_cnt for i in (1, 2)] == [1, 1]
    assert [b.ref_cnt for b in table2[0]] == [2, 2, 1]
    h.complete_load(req2.request_id)
    assert [h.cpu.blocks[i].ref_cnt for i in (1, 2)] == [0, 0]
    assert [b.ref_cnt for b in table2[0]] == [1, 1, 1]
    assert req2.request_id not in h.sched._reqs_to_load


@pytest.mark.parametrize("extra, expected_hit", [(0, 16), (1, 32), (15, 32)])
def test_hit_capped_at_num_tokens_minus_one(extra, expected_hit):
    """The `num_tokens - 1` cap drops an exactly aligned last block: 32 tokens -> cap 31 -> 1 block."""
    h = Harness()
    req = h.request(2 * BS + extra)
    h.prefill((req, 2 * BS + extra))
    assert h.in_cpu(req) == [True, True]  # both blocks stored either way
    # cap = 31 + extra; whole 16-blocks under it, at most 2: extra 0 -> 16, 1 -> 32, 15 -> 32
    assert h.probe(req) == expected_hit


def test_lookup_starts_after_local_hit():
    """The CPU lookup starts at the local hit: CPU needs no copy of the GPU-hit prefix."""
    h = Harness(num_cpu_blocks=5)  # 4 usable
    req = h.request(4 * BS + 1)  # 65 tokens
    h.prefill((req, 64))  # blocks 0..3 -> CPU 1..4
    h.prefill((h.request(33), 33))  # 2 more blocks pop CPU 1, 2: req's blocks 0, 1 evicted
    assert h.in_cpu(req) == [False, False, True, True]
    # from 0: block 0 misses -> 0. From 32: hashes [2:] hit, cap 65-1-32 = 32 -> 32
    assert (h.probe(req, 0), h.probe(req, 2 * BS)) == (0, 2 * BS)


def test_unaligned_local_hit_gets_no_cpu_hit():
    """A local hit that is not a whole number of scheduler blocks gets (0, False) and pins nothing."""
    h = Harness(block_size=32, hash_block_size=16)
    req = h.request(4 * 16 + 1)
    h.prefill((req, 64))
    before = h.state()
    assert h.sched.get_num_new_matched_tokens(h.twin(req), 16) == (0, False)
    assert h.state() == before


def test_partial_gpu_prefix_plus_cpu_load():
    """GPU hit [0,2) + CPU hit [2,6), scheduler accepts only [2,4): load exactly blocks 2,3."""
    h = Harness()
    req = h.request(6 * BS + 1)  # 97 tokens, 6 full blocks
    meta, _ = h.prefill((req, 97))
    cpu_of = meta.store_cpu_blocks  # CPU block holding each of the 6 blocks: [1..6]
    assert cpu_of == [1, 2, 3, 4, 5, 6]
    req2 = h.twin(req)
    # local hit 32 tokens: look up hashes [2:]; cap 97-1-32=64 -> 4 blocks; 4 are on CPU -> 64
    assert h.sched.get_num_new_matched_tokens(req2, 2 * BS) == (64, True)
    assert [h.cpu.blocks[i].ref_cnt for i in cpu_of] == [0, 0, 1, 1, 1, 1]  # pinned by the lookup
    table2 = h.alloc(req2, 2 * BS, confirm=False)  # | comp(2) |  (GPU prefix hit, hashed)
    table2 = h.alloc(req2, 6 * BS, prev=table2, cache=False, confirm=False)  # | ext(2) | new(2) |
    h.sched.update_state_after_alloc(req2, table2, 2 * BS)  # accepts 32 of the 64 offered
    meta2 = h.step({req2.request_id: 2 * BS + 1}, {req2.request_id: table2})
    assert (meta2.load_gpu_blocks, meta2.load_cpu_blocks) == (ids(table2)[0][2:4], cpu_of[2:4])
    # the two offered-but-declined blocks lost the lookup pin; the loaded two keep the load pin
    assert [h.cpu.blocks[i].ref_cnt for i in cpu_of] == [0, 0, 1, 1, 0, 0]


def test_load_event_to_reqs_lists_every_outstanding_load():
    """Each step sends at most one load event; load_event_to_reqs lists all that are in flight."""
    h = Harness()
    req = h.request(2 * BS + 1)
    h.prefill((req, 33))
    metas, twins = [], []
    for _ in range(2):
        twin = h.twin(req)
        assert h.sched.get_num_new_matched_tokens(twin, 0) == (32, True)
        table = h.alloc(twin, 33, cache=False, confirm=False)
        h.sched.update_state_after_alloc(twin, table, 32)
        metas.append(h.step({twin.request_id: 1}, {twin.request_id: table}))
        twins.append(twin.request_id)
    e0, e1 = metas[0].load_event, metas[1].load_event
    assert e1 > e0 >= 0
    assert metas[1].load_event_to_reqs == {e0: [twins[0]], e1: [twins[1]]}
    h.complete_load(twins[0])
    meta3 = h.step()
    assert (meta3.load_event, meta3.load_event_to_reqs) == (-1, {e1: [twins[1]]})


# -----------------------------------------------------------------------------
# CPU pool: LRU, duplicates, in-flight dedup


def _fill_four(h):
    """Store a and b (2 blocks each) in one step into a 4-block CPU pool: CPU 1,2 = a; 3,4 = b."""
    a, b = h.request(33), h.request(33)
    meta, _ = h.prefill((a, 33), (b, 33))
    assert meta.store_cpu_blocks == [1, 2, 3, 4]
    # completion frees them in event order: hashed -> appended, so LRU front is a's
    assert pool_state(h.cpu)["free_order"] == [1, 2, 3, 4]
    return a, b


def test_lru_eviction_order():
    """With the CPU pool full, a new store evicts the least recently used blocks (a's)."""
    h = Harness(num_cpu_blocks=5)  # 4 usable + the null block
    a, b = _fill_four(h)
    c = h.request(33)
    meta, _ = h.prefill((c, 33))
    assert meta.store_cpu_blocks == [1, 2]  # popped from the LRU front: a's blocks
    assert (h.in_cpu(a), h.in_cpu(b), h.in_cpu(c)) == ([False] * 2, [True] * 2, [True] * 2)
    assert pool_state(h.cpu)["free_order"] == [3, 4, 1, 2]


def test_touched_blocks_survive_eviction():
    """Touching a cached CPU block moves it to the MRU end, so b (now LRU) is evicted instead of a."""
    h = Harness(num_cpu_blocks=5)
    a, b = _fill_four(h)
    for i in (1, 2):  # a's CPU blocks
        h.cpu.touch([h.cpu.blocks[i]])
        h.cpu.free_blocks([h.cpu.blocks[i]])
    assert pool_state(h.cpu)["free_order"] == [3, 4, 1, 2]
    c = h.request(33)
    meta, _ = h.prefill((c, 33))
    assert meta.store_cpu_blocks == [3, 4]
    assert (h.in_cpu(a), h.in_cpu(b), h.in_cpu(c)) == ([True] * 2, [False] * 2, [True] * 2)


@pytest.mark.parametrize("variant", VARIANTS)
def test_duplicate_store_skipped(variant):
    """A second request with the same prefix stores nothing new (bug 1: stores it again)."""
    h = Harness(variant)
    req = h.request(33)
    h.prefill((req, 33))
    meta2, _ = h.prefill((h.twin(req), 33))  # fresh GPU blocks, same hashes
    # fixed: both keys already in the CPU map -> no store event.
    # pre-fix: the map is empty, so both blocks are copied again, into the next free CPU
    # blocks: free queue after the first store is [3..7, 1, 2] -> CPU 3, 4 (event 1).
    assert_variant(variant, (meta2.store_event, meta2.store_cpu_blocks), (-1, []),
                   registration_bug=(1, [3, 4]))


def test_in_flight_store_dedup_across_steps():
    """GPU blocks whose store is in flight are not stored again by a request sharing them."""
    h = Harness()
    req = h.request(33)
    meta1, (table,) = h.prefill((req, 33), complete=False)
    assert set(h.sched._in_flight_store_gpu_blocks) == set(ids(table)[0][:2])
    assert [b.ref_cnt for b in table[0][:2]] == [2, 2]  # request + store pin
    twin = h.twin(req)  # GPU prefix hit: reuses the same GPU blocks
    h.gpu.touch(table[0][:2])
    twin.num_computed_tokens = 32
    h.sched.update_state_after_alloc(twin, (table[0][:2],), 0)
    meta2 = h.step({twin.request_id: 1}, {twin.request_id: (table[0][:2],)})
    assert (meta2.store_event, meta2.store_gpu_blocks) == (-1, [])
    assert h.cpu.get_num_free_blocks() == 7 - 2
    h.complete_store(meta1.store_event)
    assert set(h.sched._in_flight_store_gpu_blocks) == set()
    assert [b.ref_cnt for b in table[0][:2]] == [2, 2]  # request + twin; the store pin is gone


# -----------------------------------------------------------------------------
# request lifecycle: deferred cleanup, lookup pins


def _start_load(h, req):
    """A twin of stored `req` (33 tokens) hits 32 on CPU and its load is sent. Returns (twin, table)."""
    twin = h.twin(req)
    assert h.sched.get_num_new_matched_tokens(twin, 0) == (32, True)
    table = h.alloc(twin, 33, cache=False, confirm=False)
    h.sched.update_state_after_alloc(twin, table, 32)
    meta = h.step({twin.request_id: 1}, {twin.request_id: table})
    assert meta.load_event >= 0
    return twin, table


def test_finish_during_load_defers_cleanup():
    """request_finished while the load is in flight keeps the pins until finished_recving."""
    h = Harness()
    req = h.request(33)
    meta, _ = h.prefill((req, 33))
    twin, table = _start_load(h, req)
    assert h.sched.request_finished(twin, []) == (False, None)
    h.gpu.free_blocks(table[0])  # engine frees; the loaded GPU blocks keep the load pin
    assert twin.request_id in h.sched._reqs_to_load
    assert [b.ref_cnt for b in table[0]] == [1, 1, 0]
    assert [h.cpu.blocks[i].ref_cnt for i in meta.store_cpu_blocks] == [1, 1]
    h.complete_load(twin.request_id)
    assert twin.request_id not in h.sched._reqs_to_load
    assert [b.ref_cnt for b in table[0]] == [0, 0, 0]
    assert [h.cpu.blocks[i].ref_cnt for i in meta.store_cpu_blocks] == [0, 0]


def test_finish_during_store_defers_cleanup():
    """request_finished while its store is in flight: state kept until the store completes."""
    h = Harness()
    req = h.request(33)
    meta, (table,) = h.prefill((req, 33), complete=False)
    assert h.sched.request_finished(req, []) == (False, None)
    h.gpu.free_blocks(table[0])
    assert req.request_id in h.sched._reqs_to_store
    assert [b.ref_cnt for b in table[0]] == [1, 1, 0]  # store pin only
    h.complete_store(meta.store_event)
    assert req.request_id not in h.sched._reqs_to_store
    assert [b.ref_cnt for b in table[0]] == [0, 0, 0]
    assert h.probe(req) == 32


def test_lookup_pin_survives_eviction_pressure():
    """A hit pinned by get_num_new_matched_tokens is not evicted before update_state_after_alloc."""
    h = Harness(num_cpu_blocks=5)  # 4 usable
    a = h.request(33)
    h.prefill((a, 33))  # a -> CPU 1, 2
    b = h.twin(a)
    assert h.sched.get_num_new_matched_tokens(b, 0) == (32, True)
    assert [h.cpu.blocks[i].ref_cnt for i in (1, 2)] == [1, 1]
    c, d = h.request(33), h.request(33)
    meta, _ = h.prefill((c, 33), (d, 33))
    # only CPU 3, 4 are free: c takes them, d finds the pool full; a's pinned blocks survive
    assert meta.store_cpu_blocks == [3, 4]
    assert (h.in_cpu(a), h.in_cpu(c), h.in_cpu(d)) == ([True] * 2, [True] * 2, [False] * 2)
    table = h.alloc(b, 33, cache=False, confirm=False)
    h.sched.update_state_after_alloc(b, table, 32)
    meta_b = h.step({b.request_id: 1}, {b.request_id: table})
    assert (meta_b.load_gpu_blocks, meta_b.load_cpu_blocks) == (ids(table)[0][:2], [1, 2])


def test_lookup_pin_released_by_relookup_zero_alloc_and_finish():
    """The lookup pin is one ref: a repeated lookup, 0 external tokens or request_finished drop it."""
    h = Harness()
    req = h.request(33)
    h.prefill((req, 33))
    refs = lambda: [h.cpu.blocks[i].ref_cnt for i in (1, 2)]  # noqa: E731
    twin = h.twin(req)
    h.sched.get_num_new_matched_tokens(twin, 0)
    h.sched.get_num_new_matched_tokens(twin, 0)  # retry: the earlier pin is released first
    assert refs() == [1, 1]
    h.sched.update_state_after_alloc(twin, h.alloc(twin, 33, confirm=False), 0)  # declined the hit
    assert refs() == [0, 0]
    other = h.twin(req)
    h.sched.get_num_new_matched_tokens(other, 0)
    assert refs() == [1, 1]
    h.sched.request_finished(other, [])  # cancelled before allocation
    assert refs() == [0, 0]


@pytest.mark.parametrize("aggregate", [False, True])
def test_store_completes_after_world_size_reports(aggregate):
    """With world_size=2 a store completes only when both workers reported it."""
    h = Harness(world_size=2)
    req = h.request(33)
    meta, (table,) = h.prefill((req, 33), complete=False)
    one = ko.SimpleCPUOffloadWorkerMetadata(completed_store_events={meta.store_event: 1})
    if aggregate:  # both workers' reports merged within a step
        merged = one.aggregate(ko.SimpleCPUOffloadWorkerMetadata(completed_store_events={meta.store_event: 1}))
        assert merged.completed_store_events == {meta.store_event: 2}
        h.sched.update_connector_output(ko.KVConnectorOutput(kv_connector_worker_meta=merged))
    else:  # one report per step
        h.sched.update_connector_output(ko.KVConnectorOutput(kv_connector_worker_meta=one))
        assert h.in_cpu(req) == [False, False]
        assert [b.ref_cnt for b in table[0][:2]] == [2, 2]
        assert h.sched.has_pending_stores()
        h.sched.update_connector_output(ko.KVConnectorOutput(kv_connector_worker_meta=one))
    assert h.in_cpu(req) == [True, True]
    assert [b.ref_cnt for b in table[0][:2]] == [1, 1]
    assert not h.sched.has_pending_stores()


# -----------------------------------------------------------------------------
# block tables: null blocks, chunked prefill, preemption


def test_null_blocks_never_in_transfer_lists():
    """The null block is skipped on store and never appears in load pairs."""
    h = Harness()
    req = h.request(33)
    (real,) = h.gpu.get_new_blocks(1)
    h.gpu.cache_full_blocks(req, [real], 0, 1, BS, 0)
    table = ([real, h.gpu.null_block],)
    req.num_computed_tokens = 32
    h.sched.update_state_after_alloc(req, table, 0)
    meta = h.step({req.request_id: 1}, {req.request_id: table})
    assert meta.store_gpu_blocks == [real.block_id]  # block 1 was null: only block 0 stored
    h.complete_store(meta.store_event)
    twin = h.twin(req)
    assert h.sched.get_num_new_matched_tokens(twin, 0) == (16, True)  # one stored block
    (new,) = h.gpu.get_new_blocks(1)
    table2 = ([new, h.gpu.null_block],)
    h.sched.update_state_after_alloc(twin, table2, 16)
    meta2 = h.step({twin.request_id: 1}, {twin.request_id: table2})
    assert meta2.load_gpu_blocks == [new.block_id]
    assert 0 not in meta.store_gpu_blocks + meta2.load_gpu_blocks


def test_chunked_prefill_reads_live_block_ids():
    """Chunk 2's new block ids are appended to the request's table; only they are stored next."""
    h = Harness()
    req = h.request(4 * BS + 1)
    t1 = h.alloc(req, 2 * BS)
    h.sched.update_state_after_alloc(req, t1, 0)
    meta1 = h.step({req.request_id: 2 * BS}, {req.request_id: t1})
    assert meta1.store_gpu_blocks == ids(t1)[0]
    h.complete_store(meta1.store_event)
    t2 = h.alloc(req, 4 * BS, prev=t1)
    h.sched.update_state_after_alloc(req, t2, 0)  # idempotent registration
    assert list(h.sched._reqs_to_store).count(req.request_id) == 1
    meta2 = h.step({req.request_id: 2 * BS}, {req.request_id: (t2[0][2:],)})
    assert meta2.store_gpu_blocks == ids(t2)[0][2:4]


def test_preemption_resets_table_and_cursor():
    """A preempted request resumes with a new full table and its store cursor back at 0."""
    h = Harness(num_cpu_blocks=4)  # 3 usable CPU blocks
    req = h.request(3 * BS + 1)  # 49 tokens
    meta1, (t1,) = h.prefill((req, 2 * BS))  # blocks 0,1 -> CPU 1,2; cursor = 2
    assert meta1.store_cpu_blocks == [1, 2]
    meta_p = h.step(preempted={req.request_id})
    assert meta_p.need_flush
    h.gpu.free_blocks(t1[0])
    x = h.request(49)
    meta_x, _ = h.prefill((x, 48))  # 3 blocks pop CPU 3,1,2: req's two blocks are evicted
    assert meta_x.store_cpu_blocks == [3, 1, 2]
    assert h.in_cpu(req) == [False, False, False]
    t2 = h.alloc(req, 3 * BS)  # resumed: fresh GPU blocks, 48 tokens recomputed
    meta2 = h.step({req.request_id: 1}, {req.request_id: t2}, resumed={req.request_id})
    # cursor reset -> all 3 blocks stored (no reset: only block 2; stale table: old ids)
    assert meta2.store_gpu_blocks == ids(t2)[0]


def test_resumed_table_replaces_old_block_ids():
    """A resumed request's new_block_ids are its whole table: they replace the old ids."""
    h = Harness()
    req = h.request(3 * BS + 1)
    meta1, (t1,) = h.prefill((req, 2 * BS))  # blocks 0,1 stored; table [g0, g1], cursor 2
    h.gpu.free_blocks(t1[0])
    t2 = h.alloc(req, 3 * BS)  # resumed with fresh blocks n0..n2, 48 tokens confirmed
    meta2 = h.step({req.request_id: 1}, {req.request_id: t2}, resumed={req.request_id})
    # table [n0, n1, n2], cursor 2 -> n2 stored. Appending instead gives [g0, g1, n0, n1, n2],
    # whose index 2 is n0 (already on CPU): nothing stored.
    assert meta2.store_gpu_blocks == [t2[0][2].block_id]


# -----------------------------------------------------------------------------
# several KV-cache groups


def test_two_groups_same_size_store_and_load():
    """Two 16-token groups: every block of both groups is stored, hit, and loaded in pairs."""
    h = Harness(group_block_sizes=[BS, BS])
    req = h.request(33)
    meta, (table,) = h.prefill((req, 33))
    g0, g1 = ids(table)
    assert sorted(meta.store_gpu_blocks) == sorted(g0[:2] + g1[:2])
    assert (h.in_cpu(req, 0), h.in_cpu(req, 1)) == ([True] * 2, [True] * 2)
    cpu_of = dict(zip(meta.store_gpu_blocks, meta.store_cpu_blocks))
    twin = h.twin(req)
    assert h.sched.get_num_new_matched_tokens(twin, 0) == (32, True)
    t2 = h.alloc(twin, 33, cache=False, confirm=False)
    h.sched.update_state_after_alloc(twin, t2, 32)
    meta2 = h.step({twin.request_id: 1}, {twin.request_id: t2})
    # destination block i of group g receives the CPU copy of source block i of group g
    want = {d: cpu_of[s] for g in (0, 1) for s, d in zip(ids(table)[g][:2], ids(t2)[g][:2])}
    assert dict(zip(meta2.load_gpu_blocks, meta2.load_cpu_blocks)) == want


def test_hit_must_hold_in_every_group():
    """If one group's blocks are not on CPU, the request has no CPU hit at all."""
    h = Harness(group_block_sizes=[BS, BS])
    req = h.request(33)
    t = h.alloc(req, 33)
    h.sched.update_state_after_alloc(req, t, 0)
    meta = h.step({req.request_id: 33}, {req.request_id: (t[0], [])})  # only group 0's ids known
    h.complete_store(meta.store_event)
    assert (h.in_cpu(req, 0), h.in_cpu(req, 1)) == ([True] * 2, [False] * 2)
    assert h.probe(req) == 0


@pytest.mark.parametrize("num_tokens, expected_hit", [(65, 64), (64, 32)])
def test_groups_of_different_sizes(num_tokens, expected_hit):
    """Groups of 16 and 32 tokens (block 32, hash 16): the hit is what both groups agree on."""
    h = Harness(num_cpu_blocks=8, block_size=32, hash_block_size=16, group_block_sizes=[16, 32])
    req = h.request(num_tokens)
    meta, _ = h.prefill((req, num_tokens))
    assert len(meta.store_gpu_blocks) == 4 + 2  # 64 computed tokens: 4 x 16 + 2 x 32
    # 65 tokens: cap 64 -> group 16: 4 blocks (64), group 32: 2 blocks (64) -> 64.
    # 64 tokens: cap 63 -> group 16: 3 blocks (48), group 32: 1 block (32); 16-group again
    #   under 32 -> 2 blocks (32); stable at 32, a whole 32-block.
    assert h.probe(req) == expected_hit


def test_groups_store_only_scheduler_block_aligned_prefix():
    """With several groups only the block_size-aligned confirmed prefix is stored (hybrid coordinator)."""
    h = Harness(block_size=32, hash_block_size=16, group_block_sizes=[16, 32])
    req = h.request(65)
    meta, (table,) = h.prefill((req, 49))
    # 49 confirmed -> round down to 32 (vLLM HybridKVCacheCoordinator._align_cacheable):
    # group 16 stores blocks 0,1 (not 2), group 32 stores block 0
    assert sorted(meta.store_gpu_blocks) == sorted(ids(table)[0][:2] + ids(table)[1][:1])


# -----------------------------------------------------------------------------
# the seven tests PR #53532 added


@pytest.mark.parametrize("variant", VARIANTS)
def test_eager_store_preserves_secondary_block_hashes(variant):
    """A stored block is found under its primary key and its fine-grained secondaries (bug 1: neither)."""
    h = Harness(variant, block_size=32, hash_block_size=16)
    a = h.request(4 * 16 + 1)  # 65 tokens: fine hashes f0..f3, two 32-blocks keyed f1 and f3
    table = h.alloc(a, 65)
    sec = [ko.make_block_hash_with_group_id(a.block_hashes[i], 0) for i in (0, 2)]
    for blk, key in zip(table[0], sec):  # interior boundaries at 16 and 48 tokens
        h.gpu._insert_block_hash(key, blk, None)
    h.sched.update_state_after_alloc(a, table, 0)
    meta = h.step({a.request_id: 1}, {a.request_id: table})
    h.complete_store(meta.store_event)
    cpu0, cpu1 = meta.store_cpu_blocks
    secondaries = {b: set(h.cpu.cached_block_hashes_by_block.get(b, ())) for b in (cpu0, cpu1)}
    # b shares only a's first 16 tokens: its first 32-block misses (f1 differs), the
    # fine-grained probe finds f0 as the secondary key of CPU block cpu0 -> 16 tokens
    b = h.request(tokens=a.all_token_ids[:16] + list(range(7, 27)))  # 36 tokens
    _, fine_hit = ko.find_longest_cache_hit(b.block_hashes, 35, [0], h.cpu, 32)
    _, full_hit = ko.find_longest_cache_hit(a.block_hashes, 64, [0], h.cpu, 32)
    assert_variant(variant, (secondaries, fine_hit, full_hit),
                   ({cpu0: {sec[0]}, cpu1: {sec[1]}}, 16, 64),
                   registration_bug=({cpu0: set(), cpu1: set()}, 0, 0))


def _prefill_then_finish(h, *reqs_tokens):
    """Requests whose prefill ran in their last step: nothing confirmed was stored before finishing."""
    tables = [h.alloc(r, n, confirm=False) for r, n in reqs_tokens]
    for (r, _), t in zip(reqs_tokens, tables):
        h.sched.update_state_after_alloc(r, t, 0)
    meta = h.step({r.request_id: n for r, n in reqs_tokens},
                  {r.request_id: t for (r, _), t in zip(reqs_tokens, tables)})
    assert meta.store_event == -1  # nothing confirmed yet
    for (r, n), t in zip(reqs_tokens, tables):
        r.num_computed_tokens = n  # the forward pass ran; the request ends now
        h.finish(r, t)
    return tables


@pytest.mark.parametrize("variant", VARIANTS)
def test_finished_eager_stores_are_batched(variant):
    """Two finish-time flushes and a running request's store go out as one store event."""
    h = Harness(variant)
    c = h.request(33)
    tc = h.alloc(c, 33)  # running request with 2 confirmed blocks
    h.sched.update_state_after_alloc(c, tc, 0)
    a, b = h.request(33), h.request(33)
    ta, tb = _prefill_then_finish(h, (a, 33), (b, 33))  # queue a -> CPU 1,2 and b -> CPU 3,4
    meta = h.step({c.request_id: 1}, {c.request_id: tc})  # c's blocks get CPU 5,6 now
    pairs = dict(zip(meta.store_gpu_blocks, meta.store_cpu_blocks))
    ga, gb, gc = ids(ta)[0], ids(tb)[0], ids(tc)[0]
    fixed_pairs = {ga[0]: 1, ga[1]: 2, gb[0]: 3, gb[1]: 4, gc[0]: 5, gc[1]: 6}
    assert meta.store_event >= 0
    h.complete_store(meta.store_event)
    # a, b, c all 33 tokens -> hit 32 each once stored and registered
    assert_variant(variant, (pairs, [h.probe(r) for r in (a, b, c)]),
                   (fixed_pairs, [32, 32, 32]),
                   registration_bug=(fixed_pairs, [0, 0, 0]),
                   flush_bug=({gc[0]: 1, gc[1]: 2}, [0, 0, 32]))
    # the flushed GPU blocks were freed by the engine at finish; the completion drops the pin
    assert [blk.ref_cnt for blk in ta[0] + tb[0]] == [0] * 6


@pytest.mark.parametrize("variant", VARIANTS)
def test_finished_eager_store_skips_existing_cpu_cache_entries(variant):
    """The flush skips blocks already in the CPU cache (bug 1: the empty map makes it copy them again)."""
    h = Harness(variant)
    x = h.request(33)
    h.prefill((x, 33))  # x's blocks 0,1 on CPU (1, 2)
    a = h.request(tokens=x.all_token_ids[:32] + list(range(5, 22)))  # 49 tokens, shares 2 blocks
    (ta,) = _prefill_then_finish(h, (a, 49))
    g = ids(ta)[0]
    # confirmed 49 -> 3 full blocks; 0 and 1 are cached -> only block 2 queued: 7 - 1 = 6 free
    # (cached ref-0 blocks count as free). Pre-fix registration: the map is empty, all 3 are
    # copied again (4 free); pre-fix flush: nothing queued (7 free).
    assert_variant(variant, (h.queued_flush_gpu_ids(), h.cpu.get_num_free_blocks()),
                   ([g[2]], 6), registration_bug=(g[:3], 4), flush_bug=([], 7))


@pytest.mark.parametrize("variant", VARIANTS)
def test_finished_eager_store_skips_in_flight_blocks(variant):
    """The flush skips GPU blocks whose store is already in flight."""
    h = Harness(variant)
    x = h.request(33)
    meta_x, (tx,) = h.prefill((x, 33), complete=False)  # x's blocks 0,1 in flight
    a = h.twin(x)
    a.append_output_token_ids(list(range(5, 21)))  # grows to 49 tokens: 3 full blocks
    h.gpu.touch(tx[0][:2])  # GPU prefix hit on x's two blocks
    ta = (tx[0][:2] + h.gpu.get_new_blocks(2),)
    h.gpu.cache_full_blocks(a, ta[0], 2, 3, BS, 0)
    h.sched.update_state_after_alloc(a, ta, 0)
    a.num_computed_tokens = 49
    h.finish(a, ta)
    assert_variant(variant, h.queued_flush_gpu_ids(), [ta[0][2].block_id], flush_bug=[])
    assert set(h.sched._in_flight_store_gpu_blocks) >= set(ids(tx)[0][:2])


def test_queued_flush_counts_as_in_flight():
    """Blocks queued by a finish flush are not stored again by a request that shares them."""
    h = Harness()
    a = h.request(33)
    (ta,) = _prefill_then_finish(h, (a, 33))  # a's blocks 0,1 queued (pinned), a freed
    shared = ta[0][:2]
    b = h.twin(a)
    h.gpu.touch(shared)  # b's GPU prefix hit
    b.num_computed_tokens = 32
    h.sched.update_state_after_alloc(b, (shared,), 0)
    meta = h.step({b.request_id: 1}, {b.request_id: (shared,)})
    # one copy per block: the flush's; b's scan skips them as in flight (CPU 1, 2 from the flush)
    assert sorted(zip(meta.store_gpu_blocks, meta.store_cpu_blocks)) == [(shared[0].block_id, 1),
                                                                        (shared[1].block_id, 2)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_registration_survives_stamped_destination(variant):
    """A CPU block already carrying its key as primary is still registered (reset_hash() first)."""
    h = Harness(variant)
    req = h.request(33)
    meta, _ = h.prefill((req, 33), complete=False)
    for g, c in zip(meta.store_gpu_blocks, meta.store_cpu_blocks):  # what pre-fix code did
        h.cpu.blocks[c]._block_hash = h.gpu.blocks[g].block_hash
    h.complete_store(meta.store_event)
    assert_variant(variant, h.in_cpu(req), [True, True], registration_bug=[False, False])


@pytest.mark.parametrize("variant", VARIANTS)
def test_finished_eager_store_is_reported_pending_before_metadata_build(variant):
    """has_pending_stores / has_pending_push_work are True from the finish until the flush completes."""
    h = Harness(variant)
    a = h.request(33)
    _prefill_then_finish(h, (a, 33))
    pending = lambda: (h.sched.has_pending_stores(), h.sched.has_pending_push_work())  # noqa: E731
    seen = [pending()]                      # queued, not yet sent
    meta = h.step()
    seen.append(pending())                  # sent, in flight
    if meta.store_event >= 0:
        h.complete_store(meta.store_event)
    seen.append(pending())                  # done
    assert_variant(variant, (seen, len(meta.store_gpu_blocks)),
                   ([(True, True), (True, True), (False, False)], 2),
                   flush_bug=([(False, False)] * 3, 0))


@pytest.mark.parametrize("variant", VARIANTS)
def test_finished_eager_store_covers_all_groups(variant):
    """The flush stores the remaining confirmed blocks of every KV-cache group."""
    h = Harness(variant, num_cpu_blocks=8, block_size=32, hash_block_size=16, group_block_sizes=[16, 32])
    a = h.request(65)
    (t,) = _prefill_then_finish(h, (a, 65))
    g0, g1 = ids(t)
    # confirmed 65: group 16 -> 4 full blocks, group 32 -> 2 full blocks = 6 (of 7 usable)
    queued = sorted(h.queued_flush_gpu_ids())
    meta = h.step()
    if meta.store_event >= 0:
        h.complete_store(meta.store_event)
    assert_variant(variant, (queued, h.probe(a)), (sorted(g0[:4] + g1[:2]), 64),
                   registration_bug=(sorted(g0[:4] + g1[:2]), 0), flush_bug=([], 0))


@pytest.mark.parametrize("variant", VARIANTS)
def test_finished_eager_store_respects_cpu_capacity(variant):
    """The flush stops at CPU capacity instead of raising: 2 usable CPU blocks -> 2 of 4 blocks."""
    h = Harness(variant, num_cpu_blocks=3)
    a = h.request(65)
    (ta,) = _prefill_then_finish(h, (a, 65))
    g = ids(ta)[0]
    assert_variant(variant, (h.queued_flush_gpu_ids(), h.cpu.get_num_free_blocks()),
                   (g[:2], 0), flush_bug=([], 2))


@pytest.mark.parametrize("variant", VARIANTS)
def test_reset_releases_pending_finished_eager_stores(variant):
    """reset() releases a queued (never sent) flush at once: GPU and CPU refs back, reset succeeds."""
    h = Harness(variant, num_gpu_blocks=16)
    a = h.request(33)
    (ta,) = _prefill_then_finish(h, (a, 33))
    queued = len(h.sched._pending_finished_stores)
    refs = [b.ref_cnt for b in ta[0]]  # flushed blocks keep only the store pin after the finish
    assert h.sched.reset() is True
    assert_variant(variant, (queued, refs), (1, [1, 1, 0]), flush_bug=(0, [0, 0, 0]))
    assert [b.ref_cnt for b in ta[0]] == [0, 0, 0]
    assert (h.gpu.get_num_free_blocks(), h.cpu.get_num_free_blocks()) == (15, 7)
    assert (len(h.cpu.cached_block_hash_to_block), h.sched.has_pending_push_work()) == (0, False)
    assert h.gpu.reset_prefix_cache()
    assert h.step().store_event == -1  # nothing left to send


# -----------------------------------------------------------------------------
# reset() with transfers in flight


def test_reset_waits_for_sent_store():
    """A sent store is abandoned: reset() is False until it completes, and it caches nothing."""
    h = Harness(num_gpu_blocks=16)
    req = h.request(33)
    meta, (table,) = h.prefill((req, 33), complete=False)
    h.gpu.free_blocks(table[0])  # preempted/finished by the engine: the store pin remains
    assert h.sched.reset() is False
    assert [b.ref_cnt for b in table[0]] == [1, 1, 0]  # DMA may still read these
    assert h.sched.has_pending_stores()
    assert h.sched.reset() is False
    h.complete_store(meta.store_event)
    assert [b.ref_cnt for b in table[0]] == [0, 0, 0]
    assert (h.in_cpu(req), h.cpu.get_num_free_blocks()) == ([False, False], 7)
    assert not h.sched.has_pending_stores()
    assert h.sched.reset() is True
    assert h.gpu.reset_prefix_cache()


def test_reset_waits_for_sent_load_and_releases_unsent_pins():
    """A sent load keeps its pins until finished_recving; an unsent load and a lookup pin go at once."""
    h = Harness(num_gpu_blocks=16)
    req = h.request(33)
    h.prefill((req, 33))
    sent, t_sent = _start_load(h, req)
    unsent = h.twin(req)
    assert h.sched.get_num_new_matched_tokens(unsent, 0) == (32, True)
    t_unsent = h.alloc(unsent, 33, cache=False, confirm=False)
    h.sched.update_state_after_alloc(unsent, t_unsent, 32)  # load prepared, never sent
    looked = h.twin(req)
    h.sched.get_num_new_matched_tokens(looked, 0)  # pin only
    assert [h.cpu.blocks[i].ref_cnt for i in (1, 2)] == [3, 3]
    assert h.sched.reset() is False
    assert [h.cpu.blocks[i].ref_cnt for i in (1, 2)] == [1, 1]  # only the sent load's
    assert [b.ref_cnt for b in t_unsent[0]] == [1, 1, 1]  # the load pin is gone
    h.complete_load(sent.request_id)
    assert [h.cpu.blocks[i].ref_cnt for i in (1, 2)] == [0, 0]
    assert [b.ref_cnt for b in t_sent[0]] == [1, 1, 1]
    assert h.sched.reset() is True
    assert len(h.cpu.cached_block_hash_to_block) == 0
    assert h.probe(req) == 0


def test_stale_completions_after_reset_are_ignored():
    """Repeated or unknown completions change nothing; event ids keep growing across reset()."""
    h = Harness(num_gpu_blocks=16)
    req = h.request(33)
    meta, (table,) = h.prefill((req, 33), complete=False)
    h.sched.reset()
    h.complete_store(meta.store_event)  # releases the abandoned store's pins
    before = h.state()
    h.complete_store(meta.store_event)  # the same event again
    h.complete_store(meta.store_event + 41)  # never issued
    h.complete_load("no-such-request")
    assert h.state() == before
    assert [b.ref_cnt for b in table[0]] == [1, 1, 1]  # only the request's own refs
    x = h.request(33)
    meta2, _ = h.prefill((x, 33))
    assert meta2.store_event > meta.store_event
    assert h.in_cpu(x) == [True, True]


# -----------------------------------------------------------------------------
# bad input: a ValueError naming the problem, and no state changed


def _raises_unchanged(h, match, fn, *args):
    before = h.state()
    with pytest.raises(ValueError, match=match):
        fn(*args)
    assert h.state() == before


def _pending_hit(h):
    req = h.request(33)
    h.prefill((req, 33))
    twin = h.twin(req)
    assert h.sched.get_num_new_matched_tokens(twin, 0) == (32, True)
    return twin, h.alloc(twin, 33, cache=False, confirm=False)


def test_misaligned_num_external_tokens_rejected():
    """num_external_tokens that is not a whole number of blocks is refused, the pin kept."""
    h = Harness()
    twin, table = _pending_hit(h)
    _raises_unchanged(h, r"(?i)num_external_tokens|align", h.sched.update_state_after_alloc, twin, table, 8)
    h.sched.update_state_after_alloc(twin, table, 32)  # the pinned hit is still usable
    assert h.step({twin.request_id: 1}, {twin.request_id: table}).load_cpu_blocks == [1, 2]


def test_external_tokens_without_pending_hit_rejected():
    """num_external_tokens > 0 with no hit from get_num_new_matched_tokens is refused."""
    h = Harness()
    req = h.request(33)
    h.prefill((req, 33))
    twin = h.twin(req)  # never looked up
    table = h.alloc(twin, 33, cache=False, confirm=False)
    _raises_unchanged(h, r"(?i)pending|hit|get_num_new_matched_tokens",
                      h.sched.update_state_after_alloc, twin, table, 32)


@pytest.mark.parametrize("kw", [
    dict(block_size=16, hash_block_size=12),                     # hash does not divide block
    dict(block_size=16, hash_block_size=32),                     # hash larger than block
    dict(block_size=32, hash_block_size=16, group_block_sizes=[24]),  # group does not divide 32
    dict(block_size=32, hash_block_size=16, group_block_sizes=[16, 64]),  # group larger than block
    dict(block_size=32, hash_block_size=16, group_block_sizes=[8]),   # hash does not divide group
])
def test_block_sizes_that_do_not_divide_rejected(kw):
    """Block sizes must nest: hash | every group size | scheduler block size."""
    with pytest.raises(ValueError, match=r"(?i)size"):
        ko.SimpleCPUOffloadScheduler(num_cpu_blocks=8, **kw)


@pytest.mark.parametrize("n", [0, 1])
def test_too_few_cpu_blocks_rejected(n):
    """num_cpu_blocks counts the null block, so fewer than 2 leaves no usable block."""
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        ko.SimpleCPUOffloadScheduler(num_cpu_blocks=n, block_size=BS)


@pytest.mark.parametrize("entry", ["build_connector_meta", "request_finished_all_groups"])
@pytest.mark.parametrize("bad", [64, -1])
def test_out_of_range_block_ids_rejected(bad, entry):
    """A GPU block id outside [0, num_gpu_blocks) is refused before any change, in a step's
    new_block_ids and in the finish hook's block_ids."""
    h = Harness(num_gpu_blocks=64)
    req = h.request(33)
    table = h.alloc(req, 33)
    h.sched.update_state_after_alloc(req, table, 0)
    bad_ids = ([ids(table)[0][0], bad],)
    if entry == "build_connector_meta":
        out = ko.SchedulerOutput(num_scheduled_tokens={req.request_id: 1},
                                 new_block_ids={req.request_id: bad_ids})
        _raises_unchanged(h, r"(?i)block", h.sched.build_connector_meta, out)
        meta = h.step({req.request_id: 1}, {req.request_id: table})  # the bad ids were not kept
        assert meta.store_gpu_blocks == ids(table)[0][:2]
    else:
        _raises_unchanged(h, r"(?i)block", h.sched.request_finished_all_groups, req, bad_ids)
        h.finish(req, table)  # the request is still known: its flush queues blocks 0, 1
        assert h.queued_flush_gpu_ids() == ids(table)[0][:2]


@pytest.mark.parametrize("pool", ["gpu", "cpu"])
def test_pool_refuses_more_blocks_than_free(pool):
    """get_new_blocks(n) with fewer than n free raises and pops nothing."""
    h = Harness(num_cpu_blocks=5, num_gpu_blocks=8)
    p = getattr(h, pool)
    p.get_new_blocks(2)
    _raises_unchanged(h, r"(?i)free", p.get_new_blocks, p.get_num_free_blocks() + 1)


# ===============================================================================================
# from test_notebook_part.py
NOTEBOOK = pathlib.Path(ko.__file__).resolve().parent / "walkthrough.ipynb"


def _nb_text(cell) -> str:
    """All stream and text/plain output of one executed code cell."""
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out["text"])
        elif "text/plain" in out.get("data", {}):
            parts.append(out["data"]["text/plain"])
    return "".join(parts)


def _nb_tagged(nb, tag: str) -> str:
    cells = [c for c in nb.cells if c.cell_type == "code" and tag in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"expected exactly one notebook cell tagged {tag!r}, found {len(cells)}"
    return _nb_text(cells[0])


@pytest.fixture(scope="module")
def executed_notebook():
    """walkthrough.ipynb executed headless, top to bottom (cwd = the repository root)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    pytest.importorskip("ipykernel")
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.skip("no python3 Jupyter kernel installed")
    if not NOTEBOOK.exists():
        pytest.fail(f"{NOTEBOOK} is missing")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # raises CellExecutionError (naming the cell and the traceback) as soon as a cell fails
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return nb


def test_notebook_executes_without_errors(executed_notebook):
    errors = [o for c in executed_notebook.cells if c.cell_type == "code"
              for o in c.outputs if o.get("output_type") == "error"]
    assert not errors, f"notebook cell raised: {errors[0].get('ename')}: {errors[0].get('evalue')}"
    pngs = sum("image/png" in o.get("data", {}) for c in executed_notebook.cells if c.cell_type == "code"
               for o in c.outputs)
    assert pngs >= 3, f"the notebook drew {pngs} pictures, expected at least 3"


def test_notebook_claims_in_its_outputs(executed_notebook):
    """The numbers the prose relies on, read from the freshly executed notebook."""
    nb = executed_notebook
    assert re.search(r"pre-fix lookup for the same prompt: 0 hit tokens", _nb_tagged(nb, "claim-bug1"))
    assert re.search(r"cached_block_hash_to_block\) = 0\b", _nb_tagged(nb, "claim-bug1"))
    fix = _nb_tagged(nb, "claim-fix")
    assert re.search(r"cached_block_hash_to_block\) = 6\b", fix)
    assert re.search(r"fixed lookup for the same prompt: 96 hit tokens", fix)
    fine = _nb_tagged(nb, "claim-fine")
    assert re.search(r"pre-fix .*fine-grained hit: 0 hit tokens", fine)
    assert re.search(r"fixed .*fine-grained hit: 12 hit tokens", fine)
    bug2 = _nb_tagged(nb, "claim-bug2")
    assert re.search(r"pre-fix \(flush bug\)\s+31 steps, 210 of 217", bug2)
    assert re.search(r"fixed\s+32 steps, 217 of 217", bug2)
    story = _nb_tagged(nb, "claim-story").splitlines()
    pre, fixed = (next(l for l in story if l.startswith(p)) for p in ("pre-fix", "fixed"))
    assert "4096 tokens computed, 0 loaded" in pre and "16 tokens computed, 4080 loaded" in fixed
    for line in (pre, fixed):
        assert "same output token as A: True" in line and "torch.equal(B's KV, expected_kv): True" in line


def test_notebook_is_committed_with_outputs():
    """Readers open it on the web before running anything: every code cell must carry its output."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code), "notebook saved without executing it"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "cells were not run top to bottom"
    pngs = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
    assert pngs >= 3, f"committed notebook has {pngs} pictures, expected at least 3"
    assert not any(o.get("output_type") == "error" for c in code for o in c.outputs)
    too_long = [len(c.source.splitlines()) for c in code if len(c.source.splitlines()) > 15]
    assert not too_long, f"code cells of {too_long} lines: keep notebook cells to 15 lines or fewer"
    assert "import kv_offload as ko" in code[0].source


def _store_through(sched, prompt, block_size, partial_at=None):
    """The notebook's `offload` helper: one request's store, driven in vLLM's call order."""
    gpu = ko.BlockPool(32, True, sched.hash_block_size)
    sched.bind_gpu_block_pool(gpu)
    req = ko.Request("A", prompt, sched.hash_block_size)
    blocks = gpu.get_new_blocks(len(prompt) // block_size)
    gpu.cache_full_blocks(req, blocks, 0, len(blocks), block_size, 0)
    if partial_at:
        gpu.cache_partial_block(req, blocks[partial_at // block_size], partial_at, 0)
    sched.update_state_after_alloc(req, (blocks,), 0)
    req.num_computed_tokens = len(prompt)
    meta = sched.build_connector_meta(ko.SchedulerOutput({"A": 1}, {"A": ([b.block_id for b in blocks],)}))
    sched.update_connector_output(ko.KVConnectorOutput(
        kv_connector_worker_meta=ko.SimpleCPUOffloadWorkerMetadata({meta.store_event: 1})))
    return meta


def test_notebook_claim_prefix_lookup_misses_fixed_hits():
    """Steps 5-6, independently of the notebook: 97 tokens = 6 full blocks of 16 + 1; the lookup is
    capped at num_tokens - 1 = 96 = 6 whole blocks. Pre-fix: 6 CPU blocks stamped, map empty, 0 hit."""
    prompt = torch.randint(0, 32000, (97,), generator=torch.Generator().manual_seed(0)).tolist()
    pre = ko.PreFixCPUOffloadScheduler(7, 16, registration_bug=True, flush_bug=False)
    fixed = ko.SimpleCPUOffloadScheduler(7, 16)
    for sched in (pre, fixed):
        meta = _store_through(sched, prompt, 16)
        assert len(meta.store_gpu_blocks) == 6
    assert sum(b.block_hash is not None for b in pre.cpu_block_pool.blocks) == 6
    assert len(pre.cpu_block_pool.cached_block_hash_to_block) == 0
    assert pre.get_num_new_matched_tokens(ko.Request("B", prompt, 16), 0) == (0, False)
    assert len(fixed.cpu_block_pool.cached_block_hash_to_block) == 6
    assert fixed.get_num_new_matched_tokens(ko.Request("B", prompt, 16), 0) == (96, True)


def test_notebook_claim_fine_grained_hit_needs_secondary_key():
    """Step 6: blocks of 8, hashes every 4; the GPU block 8..15 has a secondary key at 12. A probe
    sharing 12 tokens: whole-block phase hits block 0 (8 tokens), the fine phase hits 12 only through
    the secondary key copied to CPU; pre-fix copies nothing findable (0)."""
    prompt = list(range(16))
    probe = ko.Request("C", prompt[:12] + [999, 998, 997, 996], 4)
    hits = {}
    for cls, kw in [(ko.PreFixCPUOffloadScheduler, dict(flush_bug=False)), (ko.SimpleCPUOffloadScheduler, {})]:
        sched = cls(5, 8, hash_block_size=4, **kw)
        _store_through(sched, prompt, 8, partial_at=12)
        _, hits[cls] = ko.find_longest_cache_hit(probe.block_hashes, 16, [0], sched.cpu_block_pool, 8)
    assert hits == {ko.PreFixCPUOffloadScheduler: 0, ko.SimpleCPUOffloadScheduler: 12}


def test_notebook_claim_story_kv_bit_exact():
    """Step 8 at a smaller size: B loads every whole block but the last token's from CPU, computes
    one block, and its KV equals the oracle; pre-fix recomputes everything."""
    fixed = ko.run_story(ko.SimpleCPUOffloadScheduler, prompt_tokens=512, max_num_batched_tokens=128)
    pre = ko.run_story(ko.PreFixCPUOffloadScheduler, prompt_tokens=512, max_num_batched_tokens=128)
    assert (fixed["cpu_hit_tokens"], fixed["recomputed_tokens"]) == (496, 16)
    assert (pre["cpu_hit_tokens"], pre["recomputed_tokens"]) == (0, 512)
    for r in (fixed, pre):
        assert r["kv_exact"] and r["same_output"] and r["all_free"], json.dumps(r, default=str)


# ===============================================================================================
# Differential tests against vLLM 0.33 itself (skipped without it). To run them:
#   pip download --no-deps vllm==0.33.0; unzip its vllm/ folder outside the repo; put it on
#   PYTHONPATH; pip install the pure-Python modules its imports ask for (README: Comparing with vLLM).

try:  # vLLM 0.33's sources (a wheel unzipped on PYTHONPATH) and their few pure-Python deps
    from vllm.v1.core.block_pool import BlockPool as VBlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks as VKVCacheBlocks
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue as VFreeQueue
    from vllm.v1.core.kv_cache_utils import KVCacheBlock as VKVCacheBlock
    from vllm.v1.core.kv_cache_utils import init_none_hash as v_init_none_hash
    from vllm.v1.core.sched.output import CachedRequestData as VCachedRequestData
    from vllm.v1.core.sched.output import NewRequestData as VNewRequestData
    from vllm.v1.core.sched.output import SchedulerOutput as VSchedulerOutput
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager as VFullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec as VFullAttentionSpec
    from vllm.v1.kv_cache_interface import KVCacheConfig as VKVCacheConfig
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec as VKVCacheGroupSpec
    from vllm.v1.kv_cache_interface import KVCacheTensor as VKVCacheTensor
    from vllm.v1.outputs import KVConnectorOutput as VKVConnectorOutput
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler as VScheduler
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata as VWorkerMeta
    from vllm.utils.hashing import sha256 as v_sha256
    from vllm._version import __version__ as _vllm_version
    VLLM_MISSING = None if _vllm_version.startswith("0.33") else f"vLLM {_vllm_version} is not 0.33"
except Exception as exc:  # noqa: BLE001 - any import failure means "no vLLM here"
    VLLM_MISSING = f"vLLM 0.33 sources not importable ({type(exc).__name__}: {exc})"
if VLLM_MISSING is None:
    v_init_none_hash(v_sha256)  # vLLM requires it before hashing; our keys are opaque bytes
needs_vllm = pytest.mark.skipif(VLLM_MISSING is not None, reason=str(VLLM_MISSING))


def _bid(b):
    return None if b is None else b.block_id


def map_contents(m) -> dict:
    """key -> block ids in insertion order (vLLM stores a bare block or a dict of them)."""
    out = {}
    for key, v in m._cache.items():
        out[key] = [b.block_id for b in v.values()] if isinstance(v, dict) else [v.block_id]
    return out


def vpool_state(pool) -> dict:
    blocks = pool.blocks
    return {
        "num_free": pool.get_num_free_blocks(),
        "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "ref_cnt": [b.ref_cnt for b in blocks],
        "block_hash": [b.block_hash for b in blocks],
        "block_hash_num_tokens": [b.block_hash_num_tokens for b in blocks],
        "links": [(_bid(b.prev_free_block), _bid(b.next_free_block)) for b in blocks],
        "is_null": [b.is_null for b in blocks],
        "null_block": pool.null_block.block_id,
        "secondaries": {k: set(v) for k, v in pool.cached_block_hashes_by_block.items()},
        "hash_map": map_contents(pool.cached_block_hash_to_block),
        "hash_map_len": len(pool.cached_block_hash_to_block),
        "usage": round(pool.get_usage(), 9),
    }


def _short(v):
    if isinstance(v, bytes):
        return v.hex()[:12]
    if isinstance(v, (list, tuple)):
        return type(v)(_short(x) for x in v)
    if isinstance(v, (set, frozenset)):
        return sorted(_short(x) for x in v)
    if isinstance(v, dict):
        return {_short(k): _short(x) for k, x in v.items()}
    return v


def _describe(a, b) -> str:
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return "at index: " + repr({i: (_short(x), _short(y)) for i, (x, y) in enumerate(zip(a, b)) if x != y})
    return f"ours={_short(a)!r}\n      vllm={_short(b)!r}"


def assert_same(ours, theirs, what: str) -> None:
    """Equal, or an AssertionError naming the operation and each differing field."""
    if ours == theirs:
        return
    if isinstance(ours, dict) and isinstance(theirs, dict):
        keys = [k for k in dict.fromkeys([*ours, *theirs]) if ours.get(k, "<missing>") != theirs.get(k, "<missing>")]
        raise AssertionError(f"{what}: diverged\n" + "\n".join(
            f"  {k}: {_describe(ours.get(k, '<missing>'), theirs.get(k, '<missing>'))}" for k in keys))
    raise AssertionError(f"{what}: diverged\n  {_describe(ours, theirs)}")


def call_both(what: str, f_ours, f_vllm):
    """Run both; they must both return (results returned) or both raise the same type."""
    res, exc = [], []
    for f in (f_ours, f_vllm):
        try:
            res.append(f())
            exc.append(None)
        except Exception as e:  # noqa: BLE001
            res.append(None)
            exc.append(e)
    if (exc[0] is None) != (exc[1] is None) or (exc[0] is not None and type(exc[0]) is not type(exc[1])):
        raise AssertionError(f"{what}: exception mismatch: ours={exc[0]!r} vllm={exc[1]!r}")
    return res[0], res[1], exc[0]


# =============================================================================
# Hash chains with a lot of shared prefixes

def make_hashes(tokens: list[int], hbs: int) -> list[bytes]:
    out, parent = [], None
    for i in range(len(tokens) // hbs):
        parent = ko.hash_block_tokens(parent, tokens[i * hbs:(i + 1) * hbs])
        out.append(parent)
    return out


class TokenSource:
    """Prompts over a tiny alphabet built on a few shared stems, so prefixes collide often."""

    def __init__(self, rng: random.Random, alphabet: int = 2, n_stems: int = 3, stem_len: int = 24):
        self.rng, self.alphabet = rng, alphabet
        self.stems = [[rng.randrange(alphabet) for _ in range(stem_len)] for _ in range(n_stems)]

    def prompt(self, max_len: int) -> list[int]:
        rng = self.rng
        n = rng.randint(1, max_len)
        stem = rng.choice(self.stems)
        keep = rng.randint(0, min(n, len(stem)))
        return stem[:keep] + [rng.randrange(self.alphabet) for _ in range(n - keep)]


# =============================================================================
# a) FreeKVCacheBlockQueue and BlockPool

@needs_vllm
@pytest.mark.parametrize("seed", range(6))
def test_free_queue_differential(seed):
    rng = random.Random(1000 + seed)
    n = 10
    ob, vb = [ko.KVCacheBlock(i) for i in range(n)], [VKVCacheBlock(i) for i in range(n)]
    oq, vq = ko.FreeKVCacheBlockQueue(ob), VFreeQueue(vb)
    out: set[int] = set()  # ids not in the queue
    for step in range(150):
        inside = [i for i in range(n) if i not in out]
        op = rng.choice(["popleft", "popleft_n", "remove", "append", "append_n", "prepend_n"])
        what = f"seed={seed} step={step} {op}"
        if op == "popleft":
            r = call_both(what, oq.popleft, vq.popleft)
            if r[2] is None:
                assert_same(r[0].block_id, r[1].block_id, what)
                out.add(r[0].block_id)
        elif op == "popleft_n":
            k = rng.randint(0, len(inside))
            a, b = oq.popleft_n(k), vq.popleft_n(k)
            assert_same([x.block_id for x in a], [x.block_id for x in b], what)
            out.update(x.block_id for x in a)
        elif op == "remove" and inside:
            i = rng.choice(inside)
            oq.remove(ob[i])
            vq.remove(vb[i])
            out.add(i)
        elif op in ("append", "append_n", "prepend_n") and out:
            ids = rng.sample(sorted(out), 1 if op == "append" else rng.randint(0, len(out)))
            if op == "append":
                oq.append(ob[ids[0]])
                vq.append(vb[ids[0]])
            else:
                getattr(oq, op)([ob[i] for i in ids])
                getattr(vq, op)([vb[i] for i in ids])
            out.difference_update(ids)
        assert_same(oq.num_free_blocks, vq.num_free_blocks, what + " num_free_blocks")
        assert_same([b.block_id for b in oq.get_all_free_blocks()],
                    [b.block_id for b in vq.get_all_free_blocks()], what + " order")
        assert_same([(_bid(b.prev_free_block), _bid(b.next_free_block)) for b in ob],
                    [(_bid(b.prev_free_block), _bid(b.next_free_block)) for b in vb], what + " links")


def v_find_longest_cache_hit(block_hashes, max_length, group_ids, pool, block_size, alignment_tokens):
    spec = VFullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16)
    return VFullAttentionManager.find_longest_cache_hit(
        block_hashes=block_hashes, max_length=max_length, kv_cache_group_ids=group_ids,
        block_pool=pool, kv_cache_spec=spec, drop_eagle_block=False, alignment_tokens=alignment_tokens)


def compare_lookup(pair, hashes, max_length, group_ids, block_size, align, what):
    """ko.find_longest_cache_hit vs FullAttentionManager.find_longest_cache_hit (align=None: ko's
    default, compared with vLLM's fine-grained alignment = hash_block_size)."""
    v_align = pair.hbs if align is None else align
    kw = {} if align is None else {"alignment_tokens": align}
    (ob, oh), (vb, vh), _ = call_both(
        what,
        lambda: ko.find_longest_cache_hit(hashes, max_length, group_ids, pair.ours, block_size, **kw),
        lambda: v_find_longest_cache_hit(hashes, max_length, group_ids, pair.vllm, block_size, v_align))
    assert_same((oh, [[b.block_id for b in g] for g in ob]),
                (vh, [[b.block_id for b in g] for g in vb]), what)
    return oh, [[b.block_id for b in g] for g in ob]


class PoolPair:
    def __init__(self, n: int, caching: bool, hbs: int):
        self.hbs = hbs
        self.ours = ko.BlockPool(n, caching, hbs)
        self.vllm = VBlockPool(n, caching, hbs)

    def check(self, what: str) -> None:
        assert_same(vpool_state(self.ours), vpool_state(self.vllm), what)

    def ob(self, ids):
        return [self.ours.blocks[i] for i in ids]

    def vb(self, ids):
        return [self.vllm.blocks[i] for i in ids]


class PoolTrace:
    """A random but valid sequence of block-pool operations, the way vLLM's KV cache manager
    uses them: requests look up their prefix, touch the hit, allocate the rest, cache full
    blocks (and fine-grained partial entries), finish and free in reverse order; extra pins,
    raw allocations (over-allocation included), secondary keys, lookups and resets in between."""

    def __init__(self, seed: int, n: int, caching: bool, hbs: int, block_size: int):
        self.rng = rng = random.Random(seed)
        self.seed, self.caching, self.hbs, self.bs = seed, caching, hbs, block_size
        self.scale = block_size // hbs
        self.pair = PoolPair(n, caching, hbs)
        self.tokens = TokenSource(rng, alphabet=2, stem_len=6 * block_size)
        self.reqs: list[SimpleNamespace] = []  # live requests: hashes, block ids, num_cached, group
        self.pins: list[int] = []              # extra refs from touch / raw allocations
        self.known_keys: list[bytes] = []      # hashes seen, for get_cached_block / _insert_block_hash
        self.ops = 0
        self.lookups = 0

    def what(self, op: str) -> str:
        return (f"BlockPool seed={self.seed} caching={self.caching} hbs={self.hbs} bs={self.bs} "
                f"op#{self.ops} {op}")

    def new_hashes(self) -> list[bytes]:
        h = make_hashes(self.tokens.prompt(6 * self.bs), self.hbs)
        self.known_keys.extend(h)
        return h

    # --- operations ---------------------------------------------------------

    def op_new_request(self):
        rng, p = self.rng, self.pair
        hashes = self.new_hashes()
        group = rng.choice([0, 0, 1])
        hit_ids: list[int] = []
        if self.caching:
            max_len = max(0, len(hashes) * self.hbs - rng.choice([0, 1]))
            _, groups = compare_lookup(p, hashes, max_len, [group], self.bs, self.bs,
                                       self.what("new_request lookup"))
            hit_ids = groups[0]
            self.lookups += 1
        n_new = rng.randint(0, max(0, len(hashes) // self.scale + 1 - len(hit_ids)))
        if n_new > p.ours.get_num_free_blocks():
            return
        p.ours.touch(p.ob(hit_ids))
        p.vllm.touch(p.vb(hit_ids))
        p.check(self.what("new_request touch"))
        a, b, exc = call_both(self.what("new_request get_new_blocks"),
                              lambda: p.ours.get_new_blocks(n_new), lambda: p.vllm.get_new_blocks(n_new))
        if exc is not None:  # the touch took evictable hits out of the queue: no room after all
            assert isinstance(exc, ValueError), exc
            p.ours.free_blocks(p.ob(hit_ids))
            p.vllm.free_blocks(p.vb(hit_ids))
            return
        assert_same([x.block_id for x in a], [x.block_id for x in b], self.what("new_request ids"))
        self.reqs.append(SimpleNamespace(hashes=hashes, blocks=hit_ids + [x.block_id for x in a],
                                         num_cached=len(hit_ids), group=group))

    def op_cache_full_blocks(self):
        rng, p = self.rng, self.pair
        cands = [r for r in self.reqs
                 if min(len(r.blocks), len(r.hashes) // self.scale) > r.num_cached]
        if not cands or not self.caching:
            return
        r = rng.choice(cands)
        hi = min(len(r.blocks), len(r.hashes) // self.scale)
        num_full = rng.randint(r.num_cached + 1, hi)
        req = SimpleNamespace(block_hashes=r.hashes)
        call_both(self.what(f"cache_full_blocks({r.num_cached}->{num_full}, g{r.group})"),
                  lambda: p.ours.cache_full_blocks(req, p.ob(r.blocks), r.num_cached, num_full, self.bs, r.group),
                  lambda: p.vllm.cache_full_blocks(req, p.vb(r.blocks), r.num_cached, num_full, self.bs, r.group))
        r.num_cached = num_full

    def op_cache_partial_block(self):
        """A fine-grained partial entry inside block j (vLLM's cache_partial_block; the source of
        GPU secondary keys when the block already has its full key)."""
        rng, p = self.rng, self.pair
        if self.scale == 1 or not self.caching or not hasattr(p.ours, "cache_partial_block"):
            return
        cands = [(r, j) for r in self.reqs for j in range(len(r.blocks))
                 if j * self.scale + 1 <= len(r.hashes)]
        if not cands:
            return
        r, j = rng.choice(cands)
        m = rng.randint(1, min(self.scale - 1, len(r.hashes) - j * self.scale))
        num_tokens = (j * self.scale + m) * self.hbs
        req = SimpleNamespace(block_hashes=r.hashes, mm_features=[])
        ok, vk, _ = call_both(
            self.what(f"cache_partial_block(block#{j}, {num_tokens} tokens)"),
            lambda: p.ours.cache_partial_block(req, p.ours.blocks[r.blocks[j]], num_tokens, r.group),
            lambda: p.vllm.cache_partial_block(req, p.vllm.blocks[r.blocks[j]], num_tokens, r.group, self.bs))
        assert_same(ok, vk, self.what("cache_partial_block return"))

    def op_insert_block_hash(self):
        """_insert_block_hash on a block that already has a primary (-> secondary key, or guard 1
        with its own primary, or guard 2 when repeated), or on a free block (-> primary)."""
        rng, p = self.rng, self.pair
        if not self.caching or not self.known_keys:
            return
        blocks = p.ours.blocks
        cands = [b.block_id for b in blocks
                 if not b.is_null and (b.block_hash is not None or b.ref_cnt == 0)]
        if not cands:
            return
        bid = rng.choice(cands)
        if blocks[bid].block_hash is not None and rng.random() < 0.25:
            key = blocks[bid].block_hash  # guard 1
        elif p.ours.cached_block_hashes_by_block.get(bid) and rng.random() < 0.3:
            key = rng.choice(sorted(p.ours.cached_block_hashes_by_block[bid]))  # guard 2
        else:
            key = ko.make_block_hash_with_group_id(rng.choice(self.known_keys), rng.choice([0, 1]))
        ntok = rng.choice([None, self.hbs * rng.randint(1, 8)])
        call_both(self.what(f"_insert_block_hash(block {bid}, ntok={ntok})"),
                  lambda: p.ours._insert_block_hash(key, p.ours.blocks[bid], ntok),
                  lambda: p.vllm._insert_block_hash(key, p.vllm.blocks[bid], ntok))

    def op_finish_request(self):
        rng, p = self.rng, self.pair
        if not self.reqs:
            return
        r = self.reqs.pop(rng.randrange(len(self.reqs)))
        order = list(reversed(r.blocks)) if rng.random() < 0.8 else rng.sample(r.blocks, len(r.blocks))
        if rng.random() < 0.2:
            order.insert(rng.randint(0, len(order)), 0)  # the null block is skipped silently
        call_both(self.what(f"free_blocks(request {order})"),
                  lambda: p.ours.free_blocks(iter(p.ob(order))), lambda: p.vllm.free_blocks(p.vb(order)))

    def op_touch(self):
        rng, p = self.rng, self.pair
        cands = list(range(1, p.ours.num_gpu_blocks))
        ids = rng.sample(cands, rng.randint(0, min(4, len(cands))))
        if rng.random() < 0.2:
            ids.append(0)
        call_both(self.what(f"touch({ids})"), lambda: p.ours.touch(p.ob(ids)), lambda: p.vllm.touch(p.vb(ids)))
        self.pins.extend(i for i in ids if i != 0)

    def op_unpin(self):
        rng, p = self.rng, self.pair
        if not self.pins:
            return
        k = rng.randint(1, len(self.pins))
        rng.shuffle(self.pins)
        ids, self.pins = self.pins[:k], self.pins[k:]
        call_both(self.what(f"free_blocks(pins {ids})"),
                  lambda: p.ours.free_blocks(p.ob(ids)), lambda: p.vllm.free_blocks(p.vb(ids)))

    def op_get_new_blocks(self):
        rng, p = self.rng, self.pair
        k = rng.randint(0, p.ours.get_num_free_blocks() + 2)  # may over-allocate: ValueError on both
        a, b, exc = call_both(self.what(f"get_new_blocks({k})"),
                              lambda: p.ours.get_new_blocks(k), lambda: p.vllm.get_new_blocks(k))
        if exc is None:
            assert_same([x.block_id for x in a], [x.block_id for x in b], self.what("get_new_blocks ids"))
            self.pins.extend(x.block_id for x in a)
        else:
            assert isinstance(exc, ValueError), exc

    def op_get_cached_block(self):
        rng, p = self.rng, self.pair
        if not self.known_keys:
            return
        key = rng.choice(self.known_keys)
        gids = rng.choice([[0], [1], [0, 1], [1, 0]])
        a, b, _ = call_both(self.what("get_cached_block"), lambda: p.ours.get_cached_block(key, gids),
                            lambda: p.vllm.get_cached_block(key, gids))
        assert_same(None if a is None else [x.block_id for x in a],
                    None if b is None else [x.block_id for x in b], self.what("get_cached_block result"))

    def op_lookup(self):
        rng, p = self.rng, self.pair
        hashes = make_hashes(self.tokens.prompt(6 * self.bs), self.hbs)
        max_len = rng.randint(0, len(hashes) * self.hbs + self.hbs)
        aligns = [None, self.hbs, self.bs] if self.scale > 1 else [None, self.bs]
        compare_lookup(p, hashes, max_len, rng.choice([[0], [1], [0, 1]]), self.bs, rng.choice(aligns),
                       self.what(f"find_longest_cache_hit(max_length={max_len})"))
        self.lookups += 1

    def op_reset(self):
        rng, p = self.rng, self.pair
        if rng.random() < 0.5:  # free everything first so that the reset succeeds
            for r in self.reqs:
                p.ours.free_blocks(p.ob(reversed(r.blocks)))
                p.vllm.free_blocks(p.vb(list(reversed(r.blocks))))
            p.ours.free_blocks(p.ob(self.pins))
            p.vllm.free_blocks(p.vb(self.pins))
            self.reqs, self.pins = [], []
            p.check(self.what("free all"))
        a, b, _ = call_both(self.what("reset_prefix_cache"), p.ours.reset_prefix_cache,
                            p.vllm.reset_prefix_cache)
        assert_same(a, b, self.what("reset_prefix_cache result"))

    def run(self, n_ops: int) -> None:
        ops = [(self.op_new_request, 5), (self.op_cache_full_blocks, 5), (self.op_cache_partial_block, 2),
               (self.op_insert_block_hash, 2), (self.op_finish_request, 3), (self.op_touch, 2),
               (self.op_unpin, 2), (self.op_get_new_blocks, 1), (self.op_get_cached_block, 2),
               (self.op_lookup, 2), (self.op_reset, 0.3)]
        fns, weights = zip(*ops)
        self.pair.check(self.what("init"))
        for _ in range(n_ops):
            fn = self.rng.choices(fns, weights)[0]
            self.ops += 1
            fn()
            self.pair.check(self.what(fn.__name__))


POOL_CONFIGS = [  # (num blocks, enable_caching, hash_block_size, block_size)
    (12, True, 2, 2),
    (16, True, 2, 4),
    (20, True, 1, 4),
    (9, True, 4, 4),
    (12, False, 2, 2),
    (16, False, 2, 4),
]


@needs_vllm
@pytest.mark.parametrize("n,caching,hbs,bs", POOL_CONFIGS)
@pytest.mark.parametrize("seed", range(4))
def test_block_pool_differential(seed, n, caching, hbs, bs):
    trace = PoolTrace(seed * 7919 + n, n, caching, hbs, bs)
    trace.run(400)


# =============================================================================
# b) find_longest_cache_hit on random pools

@needs_vllm
@pytest.mark.parametrize("hbs,bs", [(2, 2), (2, 4), (1, 4), (2, 8)])
@pytest.mark.parametrize("seed", range(4))
def test_find_longest_cache_hit_differential(seed, hbs, bs):
    trace = PoolTrace(50_000 + seed * 31 + bs, 24, True, hbs, bs)
    rng = trace.rng
    for _ in range(6):  # build a pool with full keys, partial entries and secondaries ...
        trace.run(40)
        for _ in range(60):  # ... then probe it
            hashes = make_hashes(trace.tokens.prompt(6 * bs), hbs)
            if rng.random() < 0.3 and trace.reqs:  # a prefix that is in the pool for sure
                hashes = rng.choice(trace.reqs).hashes
            max_len = rng.randint(0, len(hashes) * hbs + bs)
            align = rng.choice([None, hbs, bs])
            gids = rng.choice([[0], [1], [0, 1]])
            compare_lookup(trace.pair, hashes, max_len, gids, bs, align,
                           f"find_longest_cache_hit seed={seed} hbs={hbs} bs={bs} "
                           f"max_length={max_len} align={align} groups={gids}")


# =============================================================================
# c) SimpleCPUOffloadScheduler, driven like vLLM's scheduler drives it

def make_vllm_scheduler(num_gpu_blocks, num_cpu_blocks, block_size, hash_block_size, group_block_sizes,
                        world_size):
    """vLLM's manager from a real KVCacheConfig and a stand-in VllmConfig holding just the
    attributes its constructor (eager mode) reads."""
    page = 1024
    groups = [VKVCacheGroupSpec([f"layer_{g}"], VFullAttentionSpec(block_size=s, num_kv_heads=1, head_size=8,
                                                                    dtype=torch.float16))
              for g, s in enumerate(group_block_sizes)]
    tensors = [VKVCacheTensor(size=num_gpu_blocks * page, layers=[f"layer_{g}" for g in range(len(groups))],
                              layer_stride=num_gpu_blocks * page, block_stride=page)]
    kv_cache_config = VKVCacheConfig(num_blocks=num_gpu_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)
    vllm_config = SimpleNamespace(
        kv_events_config=None,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, world_size=world_size),
        speculative_config=None,
        model_config=SimpleNamespace(max_model_len=1 << 20),
        max_in_flight_tokens=64,
        num_prefill_lookahead_tokens=0,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
    )
    return VScheduler(vllm_config, kv_cache_config, cpu_capacity_bytes=1 << 40,
                      scheduler_block_size=block_size, hash_block_size=hash_block_size,
                      lazy_offload=False, num_cpu_blocks=num_cpu_blocks)


def _ids(groups):
    return [[b.block_id for b in g] for g in groups]


def manager_state(m) -> dict:
    def store(s):
        return ([list(x) for x in s.block_ids], list(s.num_stored_blocks), sorted(s.store_events), s.finished)

    def load(s):
        return (list(s.transfer_meta.gpu_block_ids), list(s.transfer_meta.cpu_block_ids), s.load_event, s.finished)

    def tm(t):
        return (list(t.gpu_block_ids), list(t.cpu_block_ids))

    return {
        "reqs_to_store": [(k, store(v)) for k, v in m._reqs_to_store.items()],
        "reqs_to_load": [(k, load(v)) for k, v in m._reqs_to_load.items()],
        "abandoned_reqs_to_load": [(k, load(v)) for k, v in m._abandoned_reqs_to_load.items()],
        "pending_cpu_hits": [(k, (_ids(v[0]), v[1], v[2])) for k, v in m._pending_cpu_hits.items()],
        "load_event_to_reqs": [(k, list(v)) for k, v in m._load_event_to_reqs.items()],
        "store_event_to_blocks": [(k, tm(v)) for k, v in m._store_event_to_blocks.items()],
        "abandoned_store_event_to_blocks": [(k, tm(v)) for k, v in m._abandoned_store_event_to_blocks.items()],
        "store_event_to_reqs": [(k, list(v)) for k, v in m._store_event_to_reqs.items()],
        "in_flight_store_gpu_blocks": set(m._in_flight_store_gpu_blocks),
        "pending_finished_stores": [tm(t) for t in m._pending_finished_stores],
        "store_event_pending_counts": dict(m._store_event_pending_counts),
        "load_event_counter": m._load_event_counter,
        "store_event_counter": m._store_event_counter,
        "has_pending_stores": m.has_pending_stores(),
    }


def meta_fields(meta) -> dict:
    return {"load_event": meta.load_event, "load_gpu_blocks": list(meta.load_gpu_blocks),
            "load_cpu_blocks": list(meta.load_cpu_blocks),
            "load_event_to_reqs": {k: list(v) for k, v in meta.load_event_to_reqs.items()},
            "store_event": meta.store_event, "store_gpu_blocks": list(meta.store_gpu_blocks),
            "store_cpu_blocks": list(meta.store_cpu_blocks), "need_flush": meta.need_flush}


def local_hit(pool, hashes, max_len, sizes, sched_bs, hbs):
    """The GPU prefix-cache hit the engine finds before asking the connector (per group walk of
    whole blocks, min over groups, rounded down to the scheduler block size). Harness code, run
    identically on both libraries' GPU pools (their lookups are compared in test b)."""
    per_group = []
    hit = max_len
    for g, size in enumerate(sizes):
        scale = size // hbs
        blocks = []
        for i in range(min(max_len // size, len(hashes) // scale)):
            b = pool.get_cached_block(hashes[(i + 1) * scale - 1], [g])
            if not b:
                break
            blocks.append(b[0].block_id)
        per_group.append(blocks)
        hit = min(hit, len(blocks) * size)
    hit -= hit % sched_bs
    return hit, [blocks[:hit // size] for blocks, size in zip(per_group, sizes)]


class EngineReq:
    def __init__(self, req: ko.Request, max_tokens: int, n_groups: int):
        self.req = req
        self.rid = req.request_id
        self.max_tokens = max_tokens
        self.n_out = 0
        self.status = "waiting"  # waiting | loading | loaded | running | done
        self.table: list[list[int]] = [[] for _ in range(n_groups)]
        self.num_cached: list[int] = [0] * n_groups  # GPU cache_full_blocks progress per group
        self.preempted = False


class ManagerTrace:
    """Both managers, each bound to its own library's GPU BlockPool, driven in lockstep through
    request lifecycles: GPU prefix lookup, get_num_new_matched_tokens (retries, declines, aborts,
    misaligned probes), allocation, update_state_after_alloc, async loads, chunked prefill and
    decode, preemption, build_connector_meta, store/load completions from world_size workers in
    any interleaving, request_finished_all_groups, request_finished, reset()."""

    def __init__(self, seed, num_gpu_blocks, num_cpu_blocks, block_size, hash_block_size, group_block_sizes,
                 world_size=1, budget=8, max_prompt=40, ours_cls=None, **ours_kwargs):
        self.rng = rng = random.Random(seed)
        self.seed = seed
        self.bs, self.hbs, self.sizes, self.world_size = block_size, hash_block_size, group_block_sizes, world_size
        self.budget, self.max_prompt = budget, max_prompt
        self.cfg = (f"seed={seed} gpu={num_gpu_blocks} cpu={num_cpu_blocks} bs={block_size} hbs={hash_block_size} "
                    f"groups={group_block_sizes} world={world_size}")
        self.ours = (ours_cls or ko.SimpleCPUOffloadScheduler)(
            num_cpu_blocks, block_size, hash_block_size, group_block_sizes=list(group_block_sizes),
            world_size=world_size, **ours_kwargs)
        self.vllm = make_vllm_scheduler(num_gpu_blocks, num_cpu_blocks, block_size, hash_block_size,
                                        group_block_sizes, world_size)
        self.gpu = PoolPair(num_gpu_blocks, True, hash_block_size)
        self.ours.bind_gpu_block_pool(self.gpu.ours)
        self.vllm.bind_gpu_block_pool(self.gpu.vllm)
        self.tokens = TokenSource(rng, alphabet=2, stem_len=max_prompt)
        self.waiting: list[EngineReq] = []
        self.running: list[EngineReq] = []
        self.loading: list[EngineReq] = []
        self.store_events: dict[int, int] = {}  # event -> workers that still have to report
        self.load_events: dict[int, list[str]] = {}
        self.next_id = 0
        self.prompts: list[list[int]] = []
        self.step_no = 0
        self.calls = 0
        self.finished_total = 0
        self.stats = {"cpu_hits": 0, "stores": 0, "loads": 0, "preemptions": 0, "resets": 0, "resets_refused": 0,
                      "flushes": 0, "cpu_secondaries": 0, "declined_or_partial_hits": 0, "stale_pins": 0,
                      "aborts_waiting": 0, "aborts_loading": 0}

    # --- plumbing -------------------------------------------------------------

    def what(self, op):
        return f"manager {self.cfg} step={self.step_no} call#{self.calls} {op}"

    def check(self, op):
        w = self.what(op)
        assert_same(manager_state(self.ours), manager_state(self.vllm), w + " [manager state]")
        assert_same(vpool_state(self.ours.cpu_block_pool), vpool_state(self.vllm.cpu_block_pool), w + " [CPU pool]")
        self.gpu.check(w + " [GPU pool]")

    def both(self, op, f_ours, f_vllm):
        self.calls += 1
        a, b, exc = call_both(self.what(op), f_ours, f_vllm)
        self.check(op)
        return a, b, exc

    def gpu_alloc(self, n):
        a, b, _ = call_both(self.what(f"gpu get_new_blocks({n})"),
                            lambda: self.gpu.ours.get_new_blocks(n), lambda: self.gpu.vllm.get_new_blocks(n))
        ids = [x.block_id for x in a]
        assert_same(ids, [x.block_id for x in b], self.what("gpu get_new_blocks ids"))
        return ids

    def gpu_free_request(self, er):
        for g in range(len(self.sizes)):  # vLLM: each group's manager frees its blocks in reverse
            ids = list(reversed(er.table[g]))
            self.gpu.ours.free_blocks(self.gpu.ob(ids))
            self.gpu.vllm.free_blocks(self.gpu.vb(ids))
        er.table = [[] for _ in self.sizes]
        er.num_cached = [0] * len(self.sizes)

    def gpu_cache(self, er, num_tokens):
        """vLLM caches (hashes) the blocks a step will fill at allocation time, before the forward."""
        req = er.req
        for g, size in enumerate(self.sizes):
            num_full = min(num_tokens // size, len(req.block_hashes) // (size // self.hbs), len(er.table[g]))
            if num_full > er.num_cached[g]:
                self.gpu.ours.cache_full_blocks(req, self.gpu.ob(er.table[g]), er.num_cached[g], num_full, size, g)
                self.gpu.vllm.cache_full_blocks(req, self.gpu.vb(er.table[g]), er.num_cached[g], num_full, size, g)
                er.num_cached[g] = num_full
            # vLLM's FullAttentionManager._cache_partial_tail_block: a group whose blocks are
            # bigger than a hash block also registers the prompt's last hash boundary inside a
            # block (a secondary key when that block already has its full key, e.g. a local hit)
            boundary = min((req.num_prompt_tokens - 1) // self.hbs, len(req.block_hashes)) * self.hbs
            j = boundary // size
            if size > self.hbs and 0 < boundary <= num_tokens and boundary % size and j < len(er.table[g]):
                self.gpu.ours.cache_partial_block(req, self.gpu.ours.blocks[er.table[g][j]], boundary, g)
                self.gpu.vllm.cache_partial_block(req, self.gpu.vllm.blocks[er.table[g][j]], boundary, g, size)
        self.gpu.check(self.what(f"gpu cache_full_blocks {er.rid}"))

    def blocks_needed(self, er, num_tokens):
        return sum(max(0, -(-num_tokens // size) - len(er.table[g])) for g, size in enumerate(self.sizes))

    def grow(self, er, num_tokens):
        new = []
        for g, size in enumerate(self.sizes):
            n = max(0, -(-num_tokens // size) - len(er.table[g]))
            ids = self.gpu_alloc(n)
            er.table[g].extend(ids)
            new.append(ids)
        return new

    def outputs(self, new_reqs, cached_reqs, preempted):
        """One step's SchedulerOutput for each library. new_reqs: [(rid, n, full table)];
        cached_reqs: [(rid, n, new ids or None, resumed)]."""
        ns = {rid: n for rid, n, *_ in new_reqs}
        ns.update({rid: n for rid, n, *_ in cached_reqs})
        ours = ko.SchedulerOutput(
            num_scheduled_tokens=dict(ns),
            new_block_ids={**{rid: tuple(list(x) for x in t) for rid, _, t in new_reqs},
                           **{rid: tuple(list(x) for x in t) for rid, _, t, _ in cached_reqs if t is not None}},
            resumed_req_ids={rid for rid, _, _, resumed in cached_reqs if resumed},
            preempted_req_ids=set(preempted))
        cached = VCachedRequestData(
            req_ids=[c[0] for c in cached_reqs],
            resumed_req_ids={rid for rid, _, _, resumed in cached_reqs if resumed},
            new_token_ids=[[] for _ in cached_reqs], all_token_ids={},
            new_block_ids=[None if t is None else tuple(list(x) for x in t) for _, _, t, _ in cached_reqs],
            num_computed_tokens=[0] * len(cached_reqs), num_output_tokens=[0] * len(cached_reqs))
        vllm = VSchedulerOutput(
            scheduled_new_reqs=[VNewRequestData(req_id=rid, prompt_token_ids=None, mm_features=[],
                                                sampling_params=None, pooling_params=None,
                                                block_ids=tuple(list(x) for x in t), num_computed_tokens=0,
                                                lora_request=None) for rid, _, t in new_reqs],
            scheduled_cached_reqs=cached, num_scheduled_tokens=dict(ns),
            total_num_scheduled_tokens=sum(ns.values()), scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[],
            preempted_req_ids=set(preempted), kv_connector_block_state=None)
        return ours, vllm

    # --- request lifecycle ------------------------------------------------------

    def add_request(self):
        rid = f"r{self.next_id}"
        self.next_id += 1
        if self.prompts and self.rng.random() < 0.3:  # a resend, or a longer sibling, of an earlier prompt
            prompt = list(self.rng.choice(self.prompts))
            prompt += [self.rng.randrange(2) for _ in range(self.rng.choice([0, 0, 1, 5]))]
        else:
            prompt = self.tokens.prompt(self.max_prompt)
        self.prompts.append(prompt)
        req = ko.Request(rid, prompt, self.hbs, max_tokens=1)
        req.skip_reading_prefix_cache = self.rng.random() < 0.05
        self.waiting.append(EngineReq(req, self.rng.randint(1, 6), len(self.sizes)))

    def finish(self, er, how="finished_all_groups"):
        ids = tuple(list(x) for x in er.table)
        if how == "finished_all_groups":
            a, b, _ = self.both(f"request_finished_all_groups({er.rid})",
                                lambda: self.ours.request_finished_all_groups(er.req, ids),
                                lambda: self.vllm.request_finished_all_groups(er.req, ids))
        else:
            a, b, _ = self.both(f"request_finished({er.rid})",
                                lambda: self.ours.request_finished(er.req, []),
                                lambda: self.vllm.request_finished(er.req, []))
        assert_same(tuple(a), tuple(b), self.what("request_finished return"))
        self.gpu_free_request(er)
        self.gpu.check(self.what(f"free {er.rid}"))
        er.status = "done"
        self.finished_total += 1

    def preempt(self, er):
        self.running.remove(er)
        self.gpu_free_request(er)  # vLLM frees a preempted request's blocks without telling the connector
        er.req.num_computed_tokens = 0
        er.status, er.preempted = "waiting", True
        self.waiting.insert(0, er)
        self.stats["preemptions"] += 1

    def lookup(self, er):
        """Local GPU hit, then the connector's CPU hit. Returns (local tokens, local blocks, hit)."""
        rng, req = self.rng, er.req
        lh_o, lb_o = local_hit(self.gpu.ours, req.block_hashes, req.num_tokens - 1, self.sizes, self.bs, self.hbs)
        lh_v, lb_v = local_hit(self.gpu.vllm, req.block_hashes, req.num_tokens - 1, self.sizes, self.bs, self.hbs)
        assert_same((lh_o, lb_o), (lh_v, lb_v), self.what(f"local GPU hit {er.rid}"))
        if rng.random() < 0.1 and req.num_tokens > 1:  # a misaligned probe: (0, False), drops a stale pin
            nc = rng.randint(1, req.num_tokens - 1)
            if nc % self.bs:
                a, b, _ = self.both(f"get_num_new_matched_tokens({er.rid}, {nc}) misaligned",
                                    lambda: self.ours.get_num_new_matched_tokens(req, nc),
                                    lambda: self.vllm.get_num_new_matched_tokens(req, nc))
                assert_same(tuple(a), tuple(b), self.what("get_num_new_matched_tokens misaligned"))
        a, b, _ = self.both(f"get_num_new_matched_tokens({er.rid}, {lh_o})",
                            lambda: self.ours.get_num_new_matched_tokens(req, lh_o),
                            lambda: self.vllm.get_num_new_matched_tokens(req, lh_o))
        assert_same(tuple(a), tuple(b), self.what("get_num_new_matched_tokens"))
        return lh_o, lb_o, a[0]

    def step(self):
        rng = self.rng
        self.step_no += 1
        budget = self.budget
        new_reqs, cached_reqs, preempted, scheduled = [], [], set(), []

        # 1. running requests, in order; preempt from the tail when the GPU pool is full
        i = 0
        while i < len(self.running) and budget > 0:
            er = self.running[i]
            req = er.req
            n = min(budget, req.num_tokens - req.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            while self.blocks_needed(er, req.num_computed_tokens + n) > self.gpu.ours.get_num_free_blocks():
                if len(self.running) - 1 > i:
                    victim = self.running[-1]
                    self.preempt(victim)
                    preempted.add(victim.rid)
                else:
                    n = 0
                    break
            if n == 0:
                i += 1
                continue
            new = self.grow(er, req.num_computed_tokens + n)
            self.gpu_cache(er, req.num_computed_tokens + n)
            cached_reqs.append((er.rid, n, new if any(new) else None, False))
            scheduled.append((er, n))
            budget -= n
            i += 1

        # 2. waiting requests (new, preempted, or with a finished load)
        for er in list(self.waiting):
            if budget <= 0:
                break
            req = er.req
            if er.status == "loaded":  # its load finished: now scheduled with its whole table
                n = min(budget, req.num_tokens - req.num_computed_tokens)
                if self.blocks_needed(er, req.num_computed_tokens + n) > self.gpu.ours.get_num_free_blocks():
                    continue
                self.grow(er, req.num_computed_tokens + n)
                self.gpu_cache(er, req.num_computed_tokens + n)
                new_reqs.append((er.rid, n, [list(x) for x in er.table]))
            else:
                if rng.random() < 0.04:  # aborted while waiting (maybe with a pin from an earlier lookup)
                    self.waiting.remove(er)
                    self.finish(er, how=rng.choice(["finished", "finished_all_groups"]))
                    self.stats["aborts_waiting"] += 1
                    continue
                lh, lblocks, hit = self.lookup(er)
                if hit:
                    self.stats["cpu_hits"] += 1
                if rng.random() < 0.08:  # allocation "failed": retry next step (the pin goes stale)
                    self.stats["stale_pins"] += bool(hit)
                    continue
                ext = 0
                if hit:
                    ext = rng.choice([hit, hit, hit, 0, (hit // self.bs - rng.randint(0, hit // self.bs)) * self.bs])
                self.stats["declined_or_partial_hits"] += 0 < hit != ext
                n = 0 if ext else min(budget, req.num_tokens - lh)
                total = lh + ext + n
                need = sum(max(0, -(-total // size) - len(lb)) for lb, size in zip(lblocks, self.sizes))
                need += len({b for lb in lblocks for b in lb if self.gpu.ours.blocks[b].ref_cnt == 0})
                if need > self.gpu.ours.get_num_free_blocks():
                    continue  # no room: stays waiting, its pin is dropped by the next lookup
                for g in range(len(self.sizes)):
                    self.gpu.ours.touch(self.gpu.ob(lblocks[g]))
                    self.gpu.vllm.touch(self.gpu.vb(lblocks[g]))
                    er.table[g] = list(lblocks[g])
                    er.num_cached[g] = len(lblocks[g])
                self.grow(er, total)
                req.num_computed_tokens = lh + ext
                ob = tuple(self.gpu.ob(t) for t in er.table)
                vb = VKVCacheBlocks(blocks=tuple(self.gpu.vb(t) for t in er.table))
                self.both(f"update_state_after_alloc({er.rid}, local={lh}, ext={ext})",
                          lambda: self.ours.update_state_after_alloc(req, ob, ext),
                          lambda: self.vllm.update_state_after_alloc(req, vb, ext))
                if ext:  # async load: not scheduled until it completes
                    self.waiting.remove(er)
                    er.status = "loading"
                    self.loading.append(er)
                    continue
                self.gpu_cache(er, total)
                if er.preempted:  # vLLM (MRV1): a resumed request, whole table, in the cached list
                    cached_reqs.append((er.rid, n, [list(x) for x in er.table], True))
                else:
                    new_reqs.append((er.rid, n, [list(x) for x in er.table]))
            self.waiting.remove(er)
            er.status = "running"
            self.running.append(er)
            scheduled.append((er, n))
            budget -= n

        # 3. the connector's metadata for this step (new requests first, as vLLM yields them)
        so_o, so_v = self.outputs(new_reqs, cached_reqs, preempted)
        for er, _ in scheduled:  # async scheduling: a token in flight is computed but not confirmed
            if er.req.num_computed_tokens > 0 and rng.random() < 0.15:
                er.req.num_output_placeholders = 1
        mo, mv, _ = self.both("build_connector_meta", lambda: self.ours.build_connector_meta(so_o),
                              lambda: self.vllm.build_connector_meta(so_v))
        for er, _ in scheduled:
            er.req.num_output_placeholders = 0
        assert_same(meta_fields(mo), meta_fields(mv), self.what("build_connector_meta result"))
        if mo.store_event >= 0:
            self.store_events[mo.store_event] = self.world_size
            self.stats["stores"] += 1
        if mo.load_event >= 0:
            self.load_events[mo.load_event] = list(mo.load_event_to_reqs[mo.load_event])
            self.stats["loads"] += 1

        # 4. the forward pass: computed tokens become confirmed; prompts done sample a token
        for er, n in scheduled:
            req = er.req
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                req.append_output_token_ids(rng.randrange(2))
                er.n_out += 1
                if er.n_out >= er.max_tokens:
                    self.running.remove(er)
                    self.finish(er)

        # 5. the workers report completions (any subset, any order, world_size reports each)
        done_stores: dict[int, int] = {}
        for e in list(self.store_events):
            if rng.random() < 0.6:
                c = rng.randint(1, self.store_events[e])
                done_stores[e] = c
                self.store_events[e] -= c
                if not self.store_events[e]:
                    del self.store_events[e]
        stale = [e for e in range(self.ours._store_event_counter)
                 if e not in self.store_events and e not in done_stores]
        if stale and rng.random() < 0.05:  # a stale / duplicate report: ignored by both
            done_stores[rng.choice(stale)] = 1
        recv: set[str] = set()
        for e in list(self.load_events):
            if rng.random() < 0.6:
                recv.update(self.load_events.pop(e))
        if done_stores or recv or rng.random() < 0.3:
            oo = ko.KVConnectorOutput(finished_recving=set(recv),
                                      kv_connector_worker_meta=ko.SimpleCPUOffloadWorkerMetadata(dict(done_stores))
                                      if done_stores else None)
            vo = VKVConnectorOutput(finished_recving=set(recv),
                                    kv_connector_worker_meta=VWorkerMeta(dict(done_stores)) if done_stores else None)
            self.both(f"update_connector_output(stores={done_stores}, recv={sorted(recv)})",
                      lambda: self.ours.update_connector_output(oo), lambda: self.vllm.update_connector_output(vo))
        for er in list(self.loading):
            if er.rid in recv:
                self.loading.remove(er)
                if er.status == "loading":
                    er.status = "loaded"
                    self.gpu_cache(er, er.req.num_computed_tokens)  # the loaded prefix is now cached
                    self.waiting.insert(0, er)

        # 6. occasionally: abort a loading or running request, reset the CPU cache
        if self.loading and rng.random() < 0.03:
            er = rng.choice(self.loading)
            self.loading.remove(er)
            self.finish(er)  # load in flight: the manager defers the cleanup to its completion
            self.stats["aborts_loading"] += 1
        if self.running and rng.random() < 0.03:
            er = rng.choice(self.running)
            self.running.remove(er)
            self.finish(er, how=rng.choice(["finished", "finished_all_groups"]))
        if rng.random() < 0.35:  # another tenant churns the GPU pool: evicts cached GPU blocks (LRU)
            free = self.gpu.ours.get_num_free_blocks()
            k = free if rng.random() < 0.5 else rng.randint(0, free)
            ids = self.gpu_alloc(k)
            rng.shuffle(ids)
            self.gpu.ours.free_blocks(self.gpu.ob(ids))
            self.gpu.vllm.free_blocks(self.gpu.vb(ids))
            self.gpu.check(self.what(f"gpu churn {k}"))
        if rng.random() < 0.03:
            a, b, _ = self.both("reset", self.ours.reset, self.vllm.reset)
            assert_same(a, b, self.what("reset result"))
            self.stats["resets" if a else "resets_refused"] += 1
        if self.ours._pending_finished_stores:
            self.stats["flushes"] += 1
        if self.ours.cpu_block_pool.cached_block_hashes_by_block:  # secondaries copied GPU -> CPU
            self.stats["cpu_secondaries"] += 1

    def run(self, n_steps):
        self.check("init")
        for _ in range(n_steps):
            while len(self.waiting) + len(self.running) + len(self.loading) < 4 and self.rng.random() < 0.7:
                self.add_request()
            self.step()
        # drain: no new requests; finish everything, let every transfer complete
        for _ in range(200):
            if not (self.waiting or self.running or self.loading or self.store_events or self.load_events
                    or self.ours.has_pending_stores()):
                break
            self.step()
        assert not (self.waiting or self.running or self.loading), self.what("drain did not finish")
        assert_same(self.ours.has_pending_stores(), False, self.what("pending stores after drain"))


MANAGER_CONFIGS = [  # (num_gpu_blocks, num_cpu_blocks, block_size, hash_block_size, group sizes, world)
    (24, 6, 4, 4, [4], 1),        # CPU much smaller than the traffic: capacity stops, CPU LRU eviction
    (24, 3, 4, 4, [4], 2),        # 2 usable CPU blocks, two workers per store event
    (16, 48, 4, 4, [4], 1),       # CPU larger than GPU (the normal case): many CPU hits and loads
    (40, 64, 4, 4, [4, 4], 1),    # two groups of one block size, looked up together
    (40, 64, 8, 4, [4, 8], 1),    # two block sizes, hash_block_size < a group's block size
    (40, 12, 8, 4, [8, 4], 2),
    (40, 64, 16, 4, [8, 16, 4], 1),  # three groups, three block sizes
]


@needs_vllm
@pytest.mark.parametrize("gpu,cpu,bs,hbs,sizes,world", MANAGER_CONFIGS)
@pytest.mark.parametrize("seed", range(4))
def test_manager_differential(seed, gpu, cpu, bs, hbs, sizes, world):
    trace = ManagerTrace(seed * 104729 + gpu + cpu, gpu, cpu, bs, hbs, sizes, world_size=world)
    trace.run(100)
    assert trace.finished_total > 0 and trace.stats["stores"] > 0, trace.stats
    _COVERAGE[(seed, gpu, cpu, bs, hbs, tuple(sizes), world)] = dict(trace.stats, calls=trace.calls)


_COVERAGE: dict[tuple, dict[str, int]] = {}


def test_manager_rejects_a_group_finer_than_the_scheduler_block():
    """vLLM's scheduler block size is the LCM of the group block sizes, so one group of 4 under a
    scheduler block of 8 never exists there; ours refuses to build it instead of diverging."""
    with pytest.raises(ValueError, match="LCM"):
        ko.SimpleCPUOffloadScheduler(16, 8, hash_block_size=4, group_block_sizes=[4])


@needs_vllm
def test_manager_traces_cover_the_paths():
    """The manager traces together hit CPU loads, finish flushes, preemptions and resets."""
    if len(_COVERAGE) < 4 * len(MANAGER_CONFIGS):
        pytest.skip("needs every test_manager_differential trace to have run first")
    totals = {k: sum(c[k] for c in _COVERAGE.values()) for k in next(iter(_COVERAGE.values()))}
    print("manager trace totals:", totals)
    assert all(v > 0 for v in totals.values()), totals


# =============================================================================
# The pre-fix variant: the differential test must see each bug, and nothing else

@needs_vllm
@pytest.mark.parametrize("registration_bug,flush_bug", [(False, False), (True, False), (False, True)])
def test_prefix_variant_diverges_exactly_by_its_bugs(registration_bug, flush_bug):
    """With both flags off, PreFixCPUOffloadScheduler is the fixed manager and matches vLLM; with
    either bug on, the lockstep comparison catches it (vLLM 0.33 has both fixes)."""
    cfg = MANAGER_CONFIGS[2]
    diverged = []
    for seed in range(3):
        trace = ManagerTrace(seed * 104729 + cfg[0] + cfg[1], *cfg[:5], world_size=cfg[5],
                             ours_cls=ko.PreFixCPUOffloadScheduler,
                             registration_bug=registration_bug, flush_bug=flush_bug)
        try:
            trace.run(100)
        except AssertionError as e:
            diverged.append(str(e).splitlines()[0])
    if registration_bug or flush_bug:
        assert len(diverged) == 3, diverged
    else:
        assert diverged == []
