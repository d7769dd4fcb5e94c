# SPDX-License-Identifier: Apache-2.0
"""
kv_offload: vLLM's simple CPU KV-cache offload (eager mode) in one file.

A runnable, tested reference of the offload manager, the prefix-cache block pool under it, the
GPU<->CPU copy worker and a toy engine that drives them as vLLM's scheduler does, so that vLLM
issue #53498 and its fix (pull request #53532) can be run. It follows vLLM 0.34 (the pre-fix
variant: 0.29) with vLLM's names, ref counts, allocation and eviction order, guards and asserts:
  vllm/v1/core/{kv_cache_utils,block_pool,single_type_kv_cache_manager}.py
  vllm/v1/simple_kv_offload/{metadata,manager,worker,copy_backend}.py
But it leaves out: lazy mode, the disk backend, KV-cache events and metrics; sliding-window,
Mamba and other non-full-attention groups; cuMemcpyBatchAsync in the worker (torch copies; the
bench times it beside them); vLLM's config objects; most of vLLM's scheduler (MiniEngine).

Sections, bottom-up (every name is defined before it is used):
  1. hashing and requests            6. copy worker
  2. block pool, cache-hit lookup    7. beyond vLLM: prefix-aware eviction
  3. connector messages              8. beyond vLLM: a fix for a crash vLLM 0.34 still has
  4. scheduler-side manager          9. toy model and MiniEngine
  5. the pre-fix variant            10. demo, --bench, --gpu-check
Sections 1-4 and 6: vLLM 0.34's code and the fix (6's copy backend is ours: torch copies);
5: the methods the fix changed, as vLLM 0.29 had them; subclasses use hooks. Tags:
  # PR #53532      a line the fix added or changed; on a `def` line: the whole function
  # vLLM 0.3x      a later upstream change (0.30-0.34)
  # not in vLLM:   this module's own (checks, hooks, the simulated device)
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import enum
import hashlib
import itertools
import logging
import math
import os
import random
import struct
import subprocess
import sys
import time
import types
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, NewType


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (section 10's `main`), parsed before torch loads: --help and a bad flag
    answer at once. The numbers below are section 10's defaults (a test holds them equal)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0].strip() + "\n\n"
        "With no flag, the demo: request A runs a prompt (blocks of 16 tokens, 1,024 tokens a\n"
        "step, one output token), the GPU prefix cache is dropped, request B repeats the prompt.\n"
        "Per configuration, vLLM 0.29's code beside the fix (and, in the small-pool row, the\n"
        "prefix-aware class, not in vLLM): MiB stored to CPU / tokens B loaded from CPU.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", action="store_true",
                        help="time the copy worker's two paths, vLLM's batched DMA (CUDA) and one "
                        "plain copy of the same bytes, on CPU and, when torch sees one, on CUDA; "
                        "prints a row per measurement")
    parser.add_argument("--gpu-check", action="store_true",
                        help="on a CUDA machine: every CUDA test case, 200 random schedules on "
                        "CUDA (fuzz seed 20261204, or $KV_OFFLOAD_FUZZ_SEED), then the CUDA copy "
                        "bench; the tests are stopped after 300 s, and the check fails past "
                        "360 s in all; last line GPU CHECK: PASS or FAIL, exit status 0 only on "
                        "PASS (the bench's bandwidth goal is printed, not part of it)")
    parser.add_argument("--prompt-tokens", type=int, default=8192, metavar="N",
                        help="tokens of the chunked prompt and of the small-pool row, whose CPU "
                        "pool has 7/8 as many blocks as the prompt (blocks of 16; one is "
                        "the null block); the one-step row keeps "
                        "1,000 tokens (default: %(default)s; from 1,025 to 1,048,576)")
    args = parser.parse_args(argv)
    # more than one 1,024-token step, so the prompt is chunked; the toy model's KV takes 4 KiB a
    # token on each side, so 2**20 tokens take 4 GiB of GPU cache and 4 of CPU mirror
    if not 1025 <= args.prompt_tokens <= 2**20:
        parser.error(f"--prompt-tokens {args.prompt_tokens}: from 1,025 (more than one step, so "
                     f"the prompt is chunked) to 1,048,576")
    return args


if __name__ == "__main__":
    _parse_args(sys.argv[1:])  # --help or a bad flag exits here, before torch is imported

import numpy as np  # noqa: E402 - as torch (which imports it)
import torch  # noqa: E402 - after the command line's check (torch takes seconds to import)

logger = logging.getLogger(__name__)

# -----------------------------------------------------------------------------
# 1. Hashing and requests

BlockHash = NewType("BlockHash", bytes)

# `BlockHashWithGroupId` combines a `BlockHash` with its KV cache group ID.
# It is represented as raw bytes for compactness and efficiency. The helper
# functions below pack/unpack the `BlockHash` and group id into/from the key.
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """Pack a `BlockHash` and group id into a `BlockHashWithGroupId`.

    The group id is encoded using 4 bytes in big-endian order and appended to
    the block hash bytes.  This representation avoids creating tuples while
    still allowing us to recover both components when needed."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big", signed=False))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """Extract the `BlockHash` from a `BlockHashWithGroupId`."""
    return BlockHash(key[:-4])


def get_group_id(key: BlockHashWithGroupId) -> int:
    """Extract the group id from a `BlockHashWithGroupId`."""
    return int.from_bytes(key[-4:], "big", signed=False)


# The hash seed for the first block of any prefix block sequence: fixed, so that every process
# computes the same hashes for the same tokens (vLLM derives it from a seed string too).
# not in vLLM: sha256 of a constant (vLLM: init_none_hash(hash_fn))
NONE_HASH: BlockHash = BlockHash(hashlib.sha256(b"kv_offload-none-hash").digest())


def hash_block_tokens(parent_block_hash: BlockHash | None, curr_block_token_ids: Sequence[int],
                      extra_keys: tuple[Any, ...] | None = None) -> BlockHash:
    """Computes a hash value corresponding to the contents of a block and the contents of the
    preceding block(s): sha256 over the parent hash, the token ids (fixed width and byte order)
    and the extra keys. vLLM takes the hash function as an argument (sha256_cbor by default)."""
    if not parent_block_hash:
        parent_block_hash = NONE_HASH
    # not in vLLM: the hash function, inlined (vLLM: hash_function((parent, tokens, extras)))
    h = hashlib.sha256(parent_block_hash)
    # not in vLLM
    h.update(struct.pack(f"<{len(curr_block_token_ids)}q", *curr_block_token_ids))
    if extra_keys is not None:  # not in vLLM
        h.update(repr(extra_keys).encode())  # not in vLLM
    return BlockHash(h.digest())  # not in vLLM


class BlockHashListWithBlockSize:  # vLLM 0.30
    """Convert block-hash granularity from `hash_block_size` to `target_block_size`.
    Used when KV cache groups have different block sizes. Each `hash_block_size` hash is
    already chained over its entire prefix, so the hash at the last `hash_block_size` boundary
    of a `target_block_size` block uniquely fingerprints that block's prefix."""

    def __init__(self, block_hashes: list[BlockHash], hash_block_size: int,
                 target_block_size: int):
        self.block_hashes = block_hashes
        assert target_block_size % hash_block_size == 0
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def __getitem__(self, idx):
        if isinstance(idx, int):
            return self._get_value_at(idx)

        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            return [self._get_value_at(i) for i in range(start, stop, step)]

        raise TypeError(f"Invalid index type: {type(idx)!r}")

    def __iter__(self) -> Iterator[BlockHash]:
        for i in range(len(self)):
            yield self._get_value_at(i)

    def _get_value_at(self, idx: int) -> BlockHash:
        # The last hash_block_size hash within the target block already chains
        # over the whole prefix, so it is the target block's hash.
        return self.block_hashes[(idx + 1) * self.scale_factor - 1]


BlockHashList = list[BlockHash] | BlockHashListWithBlockSize


def resolve_block_hashes(block_hashes: BlockHashList, hash_block_size: int,  # vLLM 0.30
                         block_size: int, *, supports_fine_grained_hash_lookup: bool = False,
                         alignment_tokens: int | None = None) -> BlockHashList:
    """Resolve the block-hash view at ``block_size``.

    When ``block_size`` equals ``hash_block_size``, reuse the precomputed block
    hashes directly; otherwise view them at ``block_size`` granularity.
    Fine-grained lookup keeps the original hashes for partial cache hits."""
    if block_size == hash_block_size:
        return block_hashes
    if isinstance(block_hashes, BlockHashListWithBlockSize):
        # Already a block-size view
        assert block_hashes.scale_factor == block_size // hash_block_size
        return block_hashes
    # Fine-grained partial hits keep the raw hashes. The caller passes
    # alignment_tokens = hash_block_size to enable them, else >= block_size.
    if (
        supports_fine_grained_hash_lookup
        and alignment_tokens is not None
        and alignment_tokens < block_size
        and block_size % alignment_tokens == 0
    ):
        return block_hashes
    assert block_size % hash_block_size == 0
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)


class RequestStatus(enum.IntEnum):
    """vLLM's request states (those the engine uses); anything after PREEMPTED is finished."""
    WAITING = enum.auto()
    # its load is in flight: holds GPU blocks, not scheduled
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    # GPU blocks freed, back in the waiting queue; resumed later
    PREEMPTED = enum.auto()
    # max_tokens reached
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


class Request:
    """The parts of vLLM's Request the pool and the connector read. `block_hashes[i]` covers
    tokens [0, (i+1) * hash_block_size), kept up to date (vLLM's request_block_hasher)."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], hash_block_size: int,
                 max_tokens: int = 1):
        # not in vLLM (its input processor refuses it): the engine would find nothing to
        # compute
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty")
        # not in vLLM: a size <= 0 hashes nothing or loops forever; max_tokens <= 0 would still
        # produce one token (vLLM's SamplingParams refuses both)
        if hash_block_size <= 0 or max_tokens <= 0:
            raise ValueError(f"request {request_id!r}: hash_block_size ({hash_block_size}) and "
                             f"max_tokens ({max_tokens}) must be positive")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.hash_block_size = hash_block_size
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0
        # this and the next three: set by the engine
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        # scheduled, not yet produced (async scheduling): 0 here
        self.num_output_placeholders = 0
        # vLLM: no connector reads (e.g. prompt logprobs)
        self.skip_reading_external_kv = False
        self.block_hashes: list[bytes] = []
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        hash_block_size = self.hash_block_size
        # the chunks full since the last call
        start = len(self.block_hashes) * hash_block_size
        while start + hash_block_size <= len(self.all_token_ids):
            parent = self.block_hashes[-1] if self.block_hashes else None
            chunk = self.all_token_ids[start:start + hash_block_size]
            self.block_hashes.append(hash_block_tokens(parent, chunk))
            start += hash_block_size


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(a // -b)


# -----------------------------------------------------------------------------
# 2. Block pool

@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """KV-cache block metadata (GPU or CPU: both pools use this class)."""

    # Block ID, ranging from 0 to num_gpu_blocks - 1.
    block_id: int
    # Reference count.
    ref_cnt: int = 0
    # The hash key (block hash + group id) of the block, only available
    # when the block is full and cached.
    block_hash: BlockHashWithGroupId | None = None
    # Number of prefix tokens covered by block_hash. For full blocks this is
    # the full block boundary; partial entries can end inside a cache block.
    block_hash_num_tokens: int | None = None

    # Used to construct a doubly linked list for free blocks.
    # These two attributes should only be manipulated by FreeKVCacheBlockQueue.
    prev_free_block: "KVCacheBlock | None" = None
    next_free_block: "KVCacheBlock | None" = None

    # Whether the block is a null block that should never be cached.
    is_null: bool = False

    def set_block_hash(self, block_hash: BlockHashWithGroupId,
                       num_tokens: int | None = None) -> None:
        assert self.block_hash is None and self.block_hash_num_tokens is None, (
            "The block already has a hash. This should not happen."
        )
        self.block_hash = block_hash
        self.block_hash_num_tokens = num_tokens

    def reset_hash(self):
        """Reset the block hash when the block is evicted."""
        self.block_hash = None
        self.block_hash_num_tokens = None

    def __repr__(self) -> str:
        # Use block_id instead of KVCacheBlock object to avoid calling __repr__
        # on KVCacheBlock object recursively.
        prev_block_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_block_id = self.next_free_block.block_id if self.next_free_block else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, "
            f"ref_cnt={self.ref_cnt}, "
            f"block_hash={self.block_hash!r}, "
            f"block_hash_num_tokens={self.block_hash_num_tokens}, "
            f"prev_free_block={prev_block_id}, "
            f"next_free_block={next_block_id})"
        )


class FreeKVCacheBlockQueue:
    """This class organizes a list of KVCacheBlock objects to a doubly linked
    list of free blocks. We implement this class instead of using Python
    builtin deque to support removing a block in the middle of the queue
    in O(1) time. To close the performance gap to the builtin deque which is
    implemented in C++, this class does not allocate any Python objects when
    manipulating the linked list. Instead, this class manipulates the
    prev_free_block and next_free_block attributes of the given blocks.

    The queue is ordered by block ID in the beginning. When a block is allocated
    and then freed, it will be appended back with the eviction order:
    1. The least recent used block is at the front (LRU).
    2. If two blocks have the same last accessed time (allocated by the
       same sequence), the one with more hash tokens (the tail of a block
       chain) is at the front.
    Note that we maintain this order by reversing the block order when free
    blocks of a request. This operation is outside of this class."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)

        # Initialize doubly links of consecutive blocks
        for i in range(self.num_free_blocks):
            if i > 0:
                blocks[i].prev_free_block = blocks[i - 1]
            if i < self.num_free_blocks - 1:
                blocks[i].next_free_block = blocks[i + 1]

        # Create a fake head and a tail block for the doubly linked list to
        # reduce branching in the code
        #
        # The implementation guaranteed that the fake head and tail
        # are NEVER got popped, so we could safely assume each real blocks
        # in the queue has prev and next blocks.
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        if self.num_free_blocks > 0:
            # Connect fake_head and fake_tail to the first and last block
            # respectively.
            self.fake_free_list_head.next_free_block = blocks[0]
            blocks[0].prev_free_block = self.fake_free_list_head
            self.fake_free_list_tail.prev_free_block = blocks[-1]
            blocks[-1].next_free_block = self.fake_free_list_tail
        else:
            # For empty list, simply connect the fake head and tail.
            self.fake_free_list_head.next_free_block = self.fake_free_list_tail
            self.fake_free_list_tail.prev_free_block = self.fake_free_list_head

    def popleft(self) -> KVCacheBlock:
        """Pop the first free block and reduce num_free_blocks by 1."""
        head = self.fake_free_list_head
        first_block = head.next_free_block
        if first_block is self.fake_free_list_tail or first_block is None:
            assert self.num_free_blocks == 0, (
                f"num_free_blocks ({self.num_free_blocks}) is out of sync "
                "with the free list."
            )
            raise ValueError("No free blocks available")

        next_block = first_block.next_free_block
        if next_block is None:
            # This should not happen if the block is from the free list.
            # It indicates a bug in the caller's logic.
            raise RuntimeError(
                "Invalid block found in popleft() "
                "which doesn't have a valid next_free_block"
            )

        # Connect fake_head and the next block of first_block (i.e. second block
        # or fake tail).
        head.next_free_block = next_block
        next_block.prev_free_block = head

        # Remove the block from the linked list.
        first_block.prev_free_block = first_block.next_free_block = None

        self.num_free_blocks -= 1
        return first_block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop the first n free blocks and reduce num_free_blocks by n."""
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        self.num_free_blocks -= n

        curr_block = self.fake_free_list_head.next_free_block
        if n == 1:
            assert curr_block is not None
            next_block = curr_block.next_free_block
            curr_block.prev_free_block = None
            curr_block.next_free_block = None
            if next_block is not None:
                self.fake_free_list_head.next_free_block = next_block
                next_block.prev_free_block = self.fake_free_list_head
            return [curr_block]

        # Pop n blocks from the head of the list
        ret = []
        for _ in range(n):
            assert curr_block is not None
            ret.append(curr_block)
            last_block = curr_block
            curr_block = curr_block.next_free_block
            # Reset prev_free_block and next_free_block of all popped blocks
            last_block.prev_free_block = None
            last_block.next_free_block = None

        if curr_block is not None:
            # The queue is not empty, connect the fake head to
            # the new first block.
            self.fake_free_list_head.next_free_block = curr_block
            curr_block.prev_free_block = self.fake_free_list_head
        return ret

    def remove(self, block: KVCacheBlock) -> None:
        """Remove a block in the free list and reduce num_free_blocks by 1."""
        prev_block = block.prev_free_block
        next_block = block.next_free_block
        if prev_block is None or next_block is None:
            # This should not happen if the block is from the free list.
            # It indicates a bug in the caller's logic.
            raise RuntimeError(f"remove() called on an invalid block: {block}")

        # Link the previous block to the next block.
        prev_block.next_free_block = next_block
        # Link the next block to the previous block.
        next_block.prev_free_block = prev_block

        # Remove the block from the linked list.
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block back into the free list and increase num_free_blocks by 1."""
        tail = self.fake_free_list_tail
        last_block = tail.prev_free_block
        if last_block is None:
            raise RuntimeError(
                "prev_free_block of fake_free_list_tail should always exist"
            )
        # Connect the new block after the last block.
        last_block.next_free_block = block
        block.prev_free_block = last_block

        # Connect the fake tail after the new block.
        block.next_free_block = tail
        tail.prev_free_block = block

        self.num_free_blocks += 1

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put a list of blocks at the front of the free list."""
        if len(blocks) == 0:
            return

        first_block = self.fake_free_list_head.next_free_block
        assert first_block is not None, (
            "next_free_block of fake_free_list_head should always exist"
        )

        prev_block = self.fake_free_list_head
        for block in blocks:
            block.prev_free_block = prev_block
            prev_block.next_free_block = block
            prev_block = block

        prev_block.next_free_block = first_block
        first_block.prev_free_block = prev_block

        self.num_free_blocks += len(blocks)

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put a list of blocks back into the free list."""
        if not blocks:
            return

        tail = self.fake_free_list_tail
        last_block = tail.prev_free_block
        assert last_block is not None, (
            "prev_free_block of fake_free_list_tail should always exist"
        )
        # Add inter-connections between consecutive blocks
        for block in blocks:
            block.prev_free_block = last_block
            last_block.next_free_block = block
            last_block = block

        # Connect the last block of <blocks> to the fake tail
        last_block.next_free_block = tail
        tail.prev_free_block = last_block

        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Get all free blocks in the free list. Mainly used for testing."""
        ret = []
        if self.fake_free_list_head.next_free_block is None:
            raise RuntimeError(
                "next_free_block of fake_free_list_head should always exist"
            )
        # Start from the first block
        curr_block: KVCacheBlock = self.fake_free_list_head.next_free_block
        # As long as next_free_block is available, we haven't reached to
        # the fake tail yet.
        while curr_block.next_free_block is not None:
            ret.append(curr_block)
            curr_block = curr_block.next_free_block
        return ret


class BlockHashToBlockMap:
    """Cache of blocks that are used for prefix caching, from block hash to
    one or more cached blocks of the pool.

    A cached block is a full block with a block hash that can be used
    for prefix caching.
    The cached block may be used by running requests or in the
    free_block_queue that could potentially be evicted.

    NOTE #1: We currently don't de-duplicate the blocks in the cache,
    meaning that if a block becomes full and is cached, we don't check
    if there is already an identical block in the cache. This is because
    we want to make sure the allocated block IDs won't change so that
    block tables are append-only.
    NOTE #2: Entries hold block ids, not blocks: the cyclic GC does not track a
    dict of only bytes and ints, so cached blocks add nothing to each collection."""

    def __init__(self, blocks: list[KVCacheBlock]):
        self._blocks = blocks
        # Block id of one block per key.
        # not in vLLM: a plain dict (vLLM: gc_untrack({}), for Python 3.14's GC)
        self._cache: dict[BlockHashWithGroupId, int] = {}
        # All block ids, in insertion order, of keys cached by several blocks.
        # Kept apart so that `_cache` holds no containers.
        self._dup_ids: dict[BlockHashWithGroupId, dict[int, None]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """Gets any block with the given block hash key."""
        block_id = self._cache.get(key)
        return None if block_id is None else self._blocks[block_id]

    def contain(self, key: BlockHashWithGroupId, block_id: int) -> bool:
        """Checks whether the key maps to the given block ID."""
        dup_ids = self._dup_ids.get(key)
        if dup_ids is not None:
            return block_id in dup_ids
        return self._cache.get(key) == block_id

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        """Inserts the KVCacheBlock to the cache"""
        block_id = self._cache.setdefault(key, block.block_id)
        if block_id != block.block_id:
            self._dup_ids.setdefault(key, {block_id: None})[block.block_id] = None

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Pops block_id from the blocks cached under key, if it is there."""
        dup_ids = self._dup_ids.get(key)
        if dup_ids is None:
            if self._cache.get(key) != block_id:
                return None
            del self._cache[key]
        else:
            if dup_ids.pop(block_id, False) is False:
                return None
            self._cache[key] = next(iter(dup_ids))
            if len(dup_ids) == 1:
                del self._dup_ids[key]
        return self._blocks[block_id]

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        self._cache.clear()
        self._dup_ids.clear()


class BlockPool:
    """BlockPool that manages KVCacheBlocks (GPU and CPU alike).
    It provides methods to allocate, free and cache the kv cache blocks. The
    free_block_queue stores the free blocks in eviction order to enable
    allocation, free, and cache eviction. The cached_block_hash_to_block
    maps between block hash and cached block to support finding cached blocks
    by their block hash.
    NOTE: a block but the null one is in free_block_queue iff ref_cnt == 0; a hashed block is
    found under its primary key and every secondary key in cached_block_hashes_by_block;
    eviction is lazy: a free cached block stays a hit until get_new_blocks() hands it out."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int):
        assert isinstance(num_gpu_blocks, int) and num_gpu_blocks > 0
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        # All kv-cache blocks.
        # not in vLLM: no pool back-reference (vLLM 0.34's deferred frees across pools)
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(idx) for idx in range(num_gpu_blocks)]
        # Free block queue that constructs and manipulates a doubly linked
        # list of free blocks (including eviction candidates when caching is
        # enabled).
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)

        # Cache for block lookup
        self.cached_block_hash_to_block: BlockHashToBlockMap = BlockHashToBlockMap(
            self.blocks
        )
        self.cached_block_hashes_by_block: dict[int, set[BlockHashWithGroupId]] = {}

        # To represent a placeholder block with block_id=0.
        # The ref_cnt of null_block is not maintained, needs special care to
        # avoid freeing it.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_ids: list[int]
                         ) -> list[KVCacheBlock] | None:
        """Get the cached block by the block hash for each group in
        `kv_cache_group_ids`, or None if cache miss for any group.
        If there are duplicated blocks, we return the first block in the cache."""
        cached_blocks = []
        for group_id in kv_cache_group_ids:
            block_hash_with_group_id = make_block_hash_with_group_id(
                block_hash, group_id
            )
            block = self.cached_block_hash_to_block.get_one_block(
                block_hash_with_group_id
            )
            if not block:
                return None
            cached_blocks.append(block)
        return cached_blocks

    def cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          kv_cache_group_id: int) -> None:
        """Cache a list of full blocks for prefix caching: blocks[num_cached_blocks:
        num_full_blocks], each under the last fine hash inside it (a fine hash chains over its
        whole prefix). The block hashes are computed by the Request object."""
        if num_cached_blocks >= num_full_blocks:
            return
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        block_hashes = resolve_block_hashes(
            request.block_hashes, self.hash_block_size, block_size
        )

        new_block_hashes = block_hashes[num_cached_blocks:]
        # Appended per block below: much cheaper than packing the group id each time.
        group_suffix = make_block_hash_with_group_id(BlockHash(b""), kv_cache_group_id)
        for i, blk in enumerate(new_full_blocks):
            # Some blocks may be null or masked out when enabling sparse attention
            # like sliding window attention, or Mamba models with prefix-caching
            # in align mode. We skip null blocks here.
            if blk.is_null:  # not in vLLM: `or` the block mask (left out)
                continue
            block_hash = new_block_hashes[i]
            num_hash_tokens = (num_cached_blocks + i + 1) * block_size

            # Update and added the full block to the cache.
            block_hash_with_group_id = BlockHashWithGroupId(block_hash + group_suffix)
            if blk.block_hash is not None:
                # The only valid case where a "new full block" already has a
                # hash is partial->full promotion of the same cache block.
                assert (
                    blk.block_hash_num_tokens is not None
                    and blk.block_hash_num_tokens < num_hash_tokens
                )
                # not in vLLM: the removed keys feed vLLM's events (left out)
                self._remove_cached_block_hashes(blk)
            self._insert_block_hash(
                block_hash_with_group_id,
                blk,
                num_tokens=num_hash_tokens,
            )

    def cache_partial_block(self, request: Request, block: KVCacheBlock, num_tokens: int,
                            kv_cache_group_id: int) -> BlockHashWithGroupId | None:
        """Register a partial prefix-cache entry for an existing block: make `block` reachable
        from the fine-grained boundary at `num_tokens` inside it. A block with a longer (e.g.
        full) key gets a *secondary* key: the origin of the GPU pool's secondaries."""
        if block.is_null:
            return None

        block_hash = self._get_partial_block_hash(request, num_tokens)
        num_hash_blocks = num_tokens // self.hash_block_size
        block_hash_with_group_id = make_block_hash_with_group_id(
            block_hash, kv_cache_group_id
        )
        already_cached = block.block_hash == block_hash_with_group_id or (
            self.cached_block_hash_to_block.contain(
                block_hash_with_group_id, block.block_id
            )
        )
        if (
            not already_cached
            and block.block_hash is not None
            and block.block_hash_num_tokens is not None
            and block.block_hash_num_tokens < num_hash_blocks * self.hash_block_size
        ):
            # not in vLLM: the removed keys feed vLLM's events (left out)
            self._remove_cached_block_hashes(block)
        self._insert_block_hash(
            block_hash_with_group_id,
            block,
            num_tokens=num_hash_blocks * self.hash_block_size,
        )
        return block_hash_with_group_id

    def _get_partial_block_hash(self, request: Request, num_tokens: int) -> BlockHash:
        assert num_tokens % self.hash_block_size == 0
        num_hash_blocks = num_tokens // self.hash_block_size
        assert 0 < num_hash_blocks <= len(request.block_hashes)

        # Each hash_block_size hash chains over its full prefix, so the partial
        # entry for any group block size is the hash at that prefix boundary.
        return request.block_hashes[num_hash_blocks - 1]

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        # A block only has secondary hashes alongside a primary one.
        if block.block_hash is None:
            return []

        block_hashes = [block.block_hash]
        block_hashes.extend(self.cached_block_hashes_by_block.pop(block.block_id, ()))

        removed_hashes: list[BlockHashWithGroupId] = []
        for block_hash in block_hashes:
            if (
                self.cached_block_hash_to_block.pop(block_hash, block.block_id)
                is not None
            ):
                removed_hashes.append(block_hash)
        block.reset_hash()
        return removed_hashes

    def _insert_block_hash(self, block_hash_with_group_id: BlockHashWithGroupId,
                           block: KVCacheBlock, num_tokens: int | None) -> None:
        if block.block_hash is None:
            # A block without a hash has no entries in the cache yet.
            block.set_block_hash(block_hash_with_group_id, num_tokens=num_tokens)
        # NOTE: the first guard assumes a block carrying this key as its primary is registered
        # under it. A block *stamped* with it (vLLM 0.29) but never inserted returns here too:
        # the trap the fix's first version had to call reset_hash() around.
        elif (
            block.block_hash == block_hash_with_group_id
            or self.cached_block_hash_to_block.contain(
                block_hash_with_group_id, block.block_id
            )
        ):
            return
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(
                block_hash_with_group_id
            )
        self.cached_block_hash_to_block.insert(block_hash_with_group_id, block)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Get new blocks from the free block pool (LRU first), evicting their cached keys now
        (lazy eviction). Note that we do not check block cache in this function."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")

        ret: list[KVCacheBlock] = self.free_block_queue.popleft_n(num_blocks)

        # In order to only iterate the list once, we duplicated code a bit
        if self.enable_caching:
            for block in ret:
                # Most blocks were never cached, so skip the call when possible.
                if block.block_hash is not None:
                    self._maybe_evict_cached_block(block)
                assert block.ref_cnt == 0
                block.ref_cnt = 1
        else:
            for block in ret:
                assert block.ref_cnt == 0
                block.ref_cnt = 1
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """If a block is cached in `cached_block_hash_to_block`, we reset its hash
        metadata and evict it from the cache. True if the block is evicted."""
        evicted_hashes = self._remove_cached_block_hashes(block)
        if not evicted_hashes:
            # The block doesn't have hash, eviction is not needed
            return False
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Touch a block increases its reference count by 1, and may remove
        the block from the free queue. This is used when a block is hit by
        another request with the same prefix."""
        for block in blocks:
            if block.is_null:
                continue
            # ref_cnt=0 means this block is in the free list (i.e. eviction
            # candidate), so remove it.
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock],
                    evict_first: bool = False) -> None:
        """Free a list of blocks. The blocks should be ordered by their
        eviction priority, where the first block will be evicted first.
        evict_first: also put freed cached blocks at the front of the free
        queue, for blocks whose contents another tier already holds."""
        # Identify blocks with hash (LRU cache) and without it (never match APC)
        blocks_to_evict_last = []
        blocks_to_evict_first = []
        for block in ordered_blocks:
            if block.is_null:  # never pooled; its ref_cnt is not maintained
                continue
            block.ref_cnt -= 1
            # not in vLLM: a block freed twice would be handed out twice (two requests, one
            # KV)
            assert block.ref_cnt >= 0, f"free_blocks: block {block.block_id} is freed twice"
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching or evict_first:
                    # LIFO reuse of non-cached blocks for better GPU locality,
                    # and of cached ones when asked to evict them first.
                    blocks_to_evict_first.append(block)
                else:
                    # FIFO reuse of cached blocks for LRU eviction behavior.
                    blocks_to_evict_last.append(block)

        # Blocks to reuse first are prepended to the front of the free queue.
        self.free_block_queue.prepend_n(blocks_to_evict_first)
        # Blocks to reuse last are appended to the end of the free queue.
        self.free_block_queue.append_n(blocks_to_evict_last)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Evict blocks from the prefix cache by their block IDs (vLLM 0.34: the engine's
        _handle_invalid_blocks, after a failed KV load). Cached blocks lose their keys,
        whatever their ref_cnt: a block in use stays allocated, a pinned copy's source too."""
        for block_id in block_ids:
            assert block_id < len(self.blocks), (
                f"Invalid block_id {block_id} >= {len(self.blocks)}. "
                f"This indicates a bug in the KV connector - workers should "
                f"only report block IDs that were allocated by the scheduler."
            )
            block = self.blocks[block_id]
            self._maybe_evict_cached_block(block)

    def reset_prefix_cache(self) -> bool:
        """Reset prefix cache. This function may be used in RLHF
        flows to invalidate prefix caching after the weights are updated,
        or used for resetting prefix caching status for benchmarking.
        Refused (False) while any block but the null block is in use."""
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:  # The null block is always marked as used
            logger.warning(
                "Failed to reset prefix cache because some "
                "blocks (%d) are not freed yet",
                num_used_blocks - 1,
            )
            return False

        # Remove all hashes so that no new blocks will hit. Clear in place: a
        # new map created after the startup gc.freeze() would not be frozen.
        self.cached_block_hash_to_block.clear()
        self.cached_block_hashes_by_block.clear()

        # Remove all hashes from all blocks.
        for block in self.blocks:
            block.reset_hash()

        logger.info("Successfully reset prefix cache")

        return True

    def get_num_free_blocks(self) -> int:
        """Get the number of free blocks in the pool."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Get the KV cache usage (between 0.0 and 1.0)."""
        # Subtract 1 to account for null block.
        total_gpu_blocks = self.num_gpu_blocks - 1
        if not total_gpu_blocks:
            return 0
        return 1.0 - (self.get_num_free_blocks() / total_gpu_blocks)


def find_longest_cache_hit(block_hashes: BlockHashList, max_length: int,
                           kv_cache_group_ids: list[int], block_pool: BlockPool, block_size: int,
                           alignment_tokens: int | None = None
                           ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
    """vLLM's FullAttentionManager.find_longest_cache_hit: the longest cached prefix of at most
    `max_length` tokens for every group at once, as (blocks per group, hit tokens). Hashes are
    per hash_block_size; the hit is rounded down to `alignment_tokens` (default:
    hash_block_size). vLLM takes the group's KV-cache spec for the block size."""
    # not in vLLM: the default (vLLM's callers always pass it)
    if alignment_tokens is None:
        alignment_tokens = block_pool.hash_block_size
    block_hashes = resolve_block_hashes(
        block_hashes,
        block_pool.hash_block_size,
        block_size,
        # not in vLLM: vLLM reads the class's supports_fine_grained_hash_lookup (True here)
        supports_fine_grained_hash_lookup=True,
        alignment_tokens=alignment_tokens,
    )

    # Fine-grained mode (alignment_tokens == hash_block_size <
    # block_size): resolve_block_hashes kept the raw hash-granularity
    # list so interior boundaries can be probed.
    fine_grained = (
        alignment_tokens < block_size and block_size % alignment_tokens == 0
    )
    if fine_grained:
        full_block_hashes: BlockHashList = BlockHashListWithBlockSize(
            block_hashes, alignment_tokens, block_size
        )
    else:
        full_block_hashes = block_hashes

    computed_blocks: tuple[list[KVCacheBlock], ...] = tuple(
        [] for _ in range(len(kv_cache_group_ids))
    )
    # Phase 1: longest run of cached full blocks from the start. A missing
    # block implies every later block misses too (chained hashes).
    # not in vLLM: one group (the CPU hit's hot path) looked up without get_cached_block's
    # list and the zip: the same blocks, in a third less time
    if len(kv_cache_group_ids) == 1:
        get_one_block = block_pool.cached_block_hash_to_block.get_one_block  # not in vLLM
        group_suffix = make_block_hash_with_group_id(BlockHash(b""), kv_cache_group_ids[0])
        # not in vLLM: the fast path's loop
        for block_hash in itertools.islice(full_block_hashes, max_length // block_size):
            block = get_one_block(BlockHashWithGroupId(block_hash + group_suffix))
            if block is None:
                break
            computed_blocks[0].append(block)
    # not in vLLM: vLLM's loop is this branch
    else:
        for block_hash in itertools.islice(full_block_hashes, max_length // block_size):
            cached_block = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if not cached_block:
                break
            for computed, cached in zip(computed_blocks, cached_block):
                computed.append(cached)
    hit_length = len(computed_blocks[0]) * block_size

    # Phase 2 (fine-grained only): extend into the first non-full block by
    # probing its interior hash boundaries high-to-low (longest hit first).
    if fine_grained:
        scale_factor = block_size // alignment_tokens
        first_partial_idx = len(computed_blocks[0]) * scale_factor
        max_partial_idx = min(
            first_partial_idx + scale_factor - 1,
            max_length // alignment_tokens,
            len(block_hashes),
        )
        for fine_idx in range(max_partial_idx - 1, first_partial_idx - 1, -1):
            cached_tail = block_pool.get_cached_block(
                block_hashes[fine_idx], kv_cache_group_ids
            )
            if not cached_tail:
                continue
            for computed, cached in zip(computed_blocks, cached_tail):
                computed.append(cached)
            hit_length = (fine_idx + 1) * alignment_tokens
            break

    # Round down to the alignment; a no-op when fine-grained (hits land on
    # hash boundaries by construction) and when alignment_tokens ==
    # block_size. Then trim blocks past the new tail.
    hit_length -= hit_length % alignment_tokens
    num_blocks = cdiv(hit_length, block_size)
    for computed in computed_blocks:
        del computed[num_blocks:]
    return computed_blocks, hit_length


def check_block_sizes(num_blocks: int, block_size: int,  # not in vLLM: a person's sizes
                      hash_block_size: int, group_block_sizes: list[int] | None) -> None:
    """Sizes that do not nest would key blocks wrongly, and a pool of the null block alone
    would never offload: a ValueError naming them (vLLM derives the sizes from its config, and
    its coordinator asserts they nest)."""
    if num_blocks < 2:
        raise ValueError(f"num_cpu_blocks ({num_blocks}): at least 2, block 0 is the null block")
    group_block_sizes = group_block_sizes or [block_size]
    if min(block_size, hash_block_size, *group_block_sizes) <= 0:
        raise ValueError(f"block sizes must be positive: block_size {block_size}, "
                         f"hash_block_size {hash_block_size}, groups {group_block_sizes}")
    nested = all(size % hash_block_size == 0 for size in group_block_sizes)
    if not nested or block_size != math.lcm(*group_block_sizes):
        raise ValueError(f"block sizes must nest: hash_block_size ({hash_block_size}) must "
                         f"divide every group block size ({group_block_sizes}), and "
                         f"block_size ({block_size}) must be their LCM")


class CPUKVCacheCoordinator:  # not in vLLM: a stand-in for vLLM's KV-cache coordinator
    """What the CPU tier asks of vLLM's KV-cache coordinator (kv_cache_coordinator.py), for
    full-attention groups: its pool, its groups' block sizes, the prefix a group may cache, and
    the cache hit that holds in every group."""

    def __init__(self, num_blocks: int, group_block_sizes: list[int] | None,
                 hash_block_size: int, scheduler_block_size: int):
        self.block_pool = BlockPool(num_blocks, True, hash_block_size)
        # one group by default
        self.group_block_sizes = list(group_block_sizes or [scheduler_block_size])
        self.scheduler_block_size = scheduler_block_size
        # groups of one block size are looked up together (vLLM's SpecGroup); dict keeps order
        self._group_ids_by_block_size: dict[int, list[int]] = {}
        for g, size in enumerate(self.group_block_sizes):
            self._group_ids_by_block_size.setdefault(size, []).append(g)

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        """The prefix eligible for hashing: a hybrid coordinator's is scheduler-block aligned."""
        if len(self.group_block_sizes) > 1:
            return num_computed_tokens - num_computed_tokens % self.scheduler_block_size
        return num_computed_tokens

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
                               ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """(hit blocks per group, hit tokens, 0): the hit every group holds. For full attention
        one pass is the fixed point vLLM's hybrid coordinator loops to; the third value (a
        sparse-retention group's uncached shared prefix) is always 0 here."""
        hits: list[list[KVCacheBlock]] = [[] for _ in self.group_block_sizes]
        hit_length = max_cache_hit_length
        for size, group_ids in self._group_ids_by_block_size.items():
            blocks, hit_length = find_longest_cache_hit(
                block_hashes, hit_length, group_ids, self.block_pool, size,
                alignment_tokens=self.scheduler_block_size)
            for g, group_blocks in zip(group_ids, blocks):
                hits[g] = group_blocks
        # trim the groups looked up before the cap fell
        for g, size in enumerate(self.group_block_sizes):
            del hits[g][cdiv(hit_length, size):]
        return tuple(hits), hit_length, 0


# -----------------------------------------------------------------------------
# 3. Connector messages (scheduler <-> worker)

@dataclass
class TransferMeta:
    gpu_block_ids: list[int]
    cpu_block_ids: list[int]


# not in vLLM: the parts of vLLM's SchedulerOutput the connector reads, in a shape of this
# module's (vLLM: scheduled_new_reqs and scheduled_cached_reqs, each with its block ids)
@dataclass
class SchedulerOutput:
    # req_id -> tokens computed this step. Its order decides who is stored when the CPU is
    # short
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # not in vLLM
    # req_id -> GPU block ids allocated this step, per KV-cache group (whole table if resumed)
    # not in vLLM
    new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    # new_block_ids holds a whole new table (vLLM lists these in scheduled_new_reqs)
    resumed_req_ids: set[str] = field(default_factory=set)  # not in vLLM
    # its blocks may be reused at once
    preempted_req_ids: set[str] = field(default_factory=set)  # not in vLLM


# not in vLLM: vLLM's yield_req_data over this module's SchedulerOutput (new and resumed
# requests first, then running ones, as the engine fills num_scheduled_tokens)
def yield_req_data(scheduler_output: SchedulerOutput
                   ) -> Iterator[tuple[str, tuple[list[int], ...] | None, bool]]:
    """Yields: (req_id, block_id_groups, is_full_table)."""
    for req_id in scheduler_output.num_scheduled_tokens:
        yield (req_id, scheduler_output.new_block_ids.get(req_id),
               req_id in scheduler_output.resumed_req_ids)
    for req_id, ids in scheduler_output.new_block_ids.items():
        if req_id not in scheduler_output.num_scheduled_tokens:
            yield req_id, ids, req_id in scheduler_output.resumed_req_ids


INVALID_JOB_ID = -1


@dataclass
class SimpleCPUOffloadMetadata:
    """Metadata passed from scheduler to worker for CPU offload operations.

    The worker receives flat block lists keyed by a monotonic event_idx.
    Job->req_id translation is handled by the scheduler-side manager
    (via inverse maps), so the worker never knows about request identities.
    """

    # Load event per step. INVALID_JOB_ID means no blocks to load this step.
    load_event: int = INVALID_JOB_ID
    load_gpu_blocks: list[int] = field(default_factory=list)
    load_cpu_blocks: list[int] = field(default_factory=list)
    # Reverse map: load_event->req_ids, for tracking requests with finished load events
    load_event_to_reqs: dict[int, list[str]] = field(default_factory=dict)

    # Store event per step. INVALID_JOB_ID means no blocks to store this step.
    store_event: int = INVALID_JOB_ID
    store_gpu_blocks: list[int] = field(default_factory=list)
    store_cpu_blocks: list[int] = field(default_factory=list)

    # Whether any requests were preempted this step and need flush pending transfers.
    need_flush: bool = False


@dataclass
class SimpleCPUOffloadWorkerMetadata:
    """Worker -> Scheduler metadata for completed store events.

    Each worker reports {event_idx: 1} for newly completed stores.
    ``aggregate()`` sums counts across workers within a step.
    The scheduler-side manager accumulates across steps and processes
    a store completion only when count reaches ``world_size``.
    """

    completed_store_events: dict[int, int]

    def aggregate(self, other: SimpleCPUOffloadWorkerMetadata
                  ) -> SimpleCPUOffloadWorkerMetadata:
        assert isinstance(other, SimpleCPUOffloadWorkerMetadata)
        merged = dict(self.completed_store_events)
        for k, v in other.completed_store_events.items():
            merged[k] = merged.get(k, 0) + v
        return SimpleCPUOffloadWorkerMetadata(completed_store_events=merged)


@dataclass
class KVConnectorOutput:
    # [req_ids]
    finished_recving: set[str] | None = None
    # not in vLLM: the simple connector's metadata (vLLM: its base KVConnectorWorkerMetadata)
    kv_connector_worker_meta: SimpleCPUOffloadWorkerMetadata | None = None
    # IDs of externally computed KV blocks that failed to load.
    # Requests referencing these blocks should be rescheduled to recompute them
    invalid_block_ids: set[int] = field(default_factory=set)


# -----------------------------------------------------------------------------
# 4. Scheduler-side manager (eager mode)

@dataclass
class LoadRequestState:
    request: "Request"
    # CPU sources -> GPU destinations, both sides pinned until the load completes
    transfer_meta: TransferMeta
    # None: not sent to a worker yet, so no copy can be running
    load_event: int | None = None
    # finished with its load in flight: cleaned up when the load completes
    finished: bool = False


# NOTE: This per-request state is only used in eager mode.
@dataclass
class StoreRequestState:
    request: "Request"
    # Accumulated block IDs from scheduler_output via yield_req_data.
    block_ids: tuple[list[int], ...]
    # Per-group cursors tracking how many blocks have been stored/skipped.
    num_stored_blocks: list[int]
    store_events: set[int] = field(default_factory=set)
    finished: bool = False


class _StoreAdmission(Enum):
    """Why a confirmed GPU block is or is not copied to CPU."""
    READY = auto()
    NULL_BLOCK = auto()
    # not in the GPU prefix cache: its KV has no key
    NOT_HASHED = auto()
    # a store of this very block is running
    IN_FLIGHT = auto()
    # its primary key already hits on CPU
    ALREADY_CACHED = auto()


class SimpleCPUOffloadScheduler:
    """Scheduler-side manager for CPU offloading, eager mode (vLLM's manager.py).
    Stores: a scheduled request's *confirmed* blocks (computed by a finished forward pass) not
    yet on CPU are copied GPU->CPU, pinned until the copy completes, then join the CPU prefix
    cache: one step late, a finished request's last ones by the final flush (the fix).
    Loads: a new request's prefix past its GPU hit is looked up on CPU, pinned, copied CPU->GPU.
    Each ref taken on a pool is dropped exactly once (completion, finish or reset). Hooks (not
    in vLLM, at the end): vLLM's own calls, so a subclass changes one step only."""

    def __init__(self, num_cpu_blocks: int, block_size: int, hash_block_size: int | None = None,
                 group_block_sizes: list[int] | None = None, world_size: int = 1):
        # not in vLLM: the sizes are arguments (vLLM derives them from its config objects)
        if hash_block_size is None:
            hash_block_size = block_size
        # not in vLLM: a person's sizes, checked before vLLM's assert below
        check_block_sizes(num_cpu_blocks, block_size, hash_block_size, group_block_sizes)
        # the scheduler block size: loads start on its multiples
        # not in vLLM: vLLM's argument is scheduler_block_size
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        assert self.block_size % self.hash_block_size == 0
        # counts the CPU pool's null block
        # not in vLLM: vLLM derives it from the config
        self.num_cpu_blocks = num_cpu_blocks
        # not in vLLM: vLLM builds its coordinator from the CPU KV-cache config
        self.cpu_coordinator = CPUKVCacheCoordinator(
            num_cpu_blocks, group_block_sizes, hash_block_size, self.block_size)
        self.group_block_sizes = self.cpu_coordinator.group_block_sizes
        self.cpu_block_pool: BlockPool = self.cpu_coordinator.block_pool
        # GPU block pool reference - bound after scheduler builds kv_cache_manager
        self._gpu_block_pool: BlockPool | None = None

        # Load metadata
        self._reqs_to_load: dict[str, LoadRequestState] = {}
        # Inverse map: load_event_idx -> req_ids. Keyed by load_event_idx because
        # the worker reports completions by event index, not request id.
        self._load_event_to_reqs: dict[int, list[str]] = {}

        # Pending (cpu_hit_blocks, hit_length, num_computed_tokens) tuples from
        # find_longest_cache_hit, kept pinned via touch() while awaiting
        # update_state_after_alloc().
        self._pending_cpu_hits: dict[
            str, tuple[tuple[list[KVCacheBlock], ...], int, int]
        ] = {}
        # Eager mode: local prefix length from get_num_new_matched_tokens(),
        # whose CPU copy update_state_after_alloc() refreshes.
        self._pending_local_hits: dict[str, int] = {}  # vLLM 0.34

        # Store metadata
        self._store_event_to_blocks: dict[int, TransferMeta] = {}
        self._abandoned_store_event_to_blocks: dict[int, TransferMeta] = {}
        # Eager mode only
        self._reqs_to_store: dict[str, StoreRequestState] = {}
        self._store_event_to_reqs: dict[int, list[str]] = {}
        self._in_flight_store_gpu_blocks: set[int] = set()
        self._pending_finished_stores: list[TransferMeta] = []  # PR #53532
        self._abandoned_reqs_to_load: dict[str, LoadRequestState] = {}

        # Event counters (monotonic, never reset: the workers' high-water marks must never see
        # an index twice)
        self._load_event_counter: int = 0
        self._store_event_counter: int = 0

        # For TP/PP: track partial store completions across steps.
        # Events must be reported by all world_size workers before considered complete.
        # not in vLLM: vLLM reads its config
        self._expected_worker_count = world_size
        self._store_event_pending_counts: dict[int, int] = {}

    @property
    def world_size(self) -> int:
        """not in vLLM: the worker reports a store needs (the engine checks its workers)."""
        return self._expected_worker_count

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """Bind GPU block pool so that we can touch blocks during stores.
        Called by Scheduler after kv_cache_manager is ready."""
        # not in vLLM: a pool keyed at another granularity would serve another prefix's KV
        assert gpu_block_pool.hash_block_size == self.hash_block_size, (
            f"GPU pool hash_block_size {gpu_block_pool.hash_block_size} != connector's "
            f"{self.hash_block_size}")
        self._gpu_block_pool = gpu_block_pool

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Return (num_new_tokens, is_async) from consecutive CPU cache hits."""
        # Pins found CPU blocks so they survive LRU eviction until
        # update_state_after_alloc() consumes them. Any pin from an earlier
        # call on the same request (e.g. retry after a failed allocate_slots)
        # is dropped first.
        if stale := self._pending_cpu_hits.pop(request.request_id, None):
            self._free_pending_cpu_hit(stale)
        self._pending_local_hits.pop(request.request_id, None)  # vLLM 0.34

        if request.skip_reading_external_kv:  # vLLM 0.30
            return 0, False

        # Refreshed at admission: a request waiting for blocks repeats this lookup every step.
        # vLLM 0.34 (`and not self._lazy_mode`: lazy mode left out)
        if num_computed_tokens:
            self._pending_local_hits[request.request_id] = num_computed_tokens  # vLLM 0.34

        # Transfers are whole-block copies, so an external suffix cannot start in the middle
        # of a destination block (vLLM also logs a warning once here).
        if num_computed_tokens % self.block_size != 0:  # vLLM 0.30
            return 0, False  # vLLM 0.30

        num_skipped_hashes = num_computed_tokens // self.hash_block_size
        remaining_hashes = request.block_hashes[num_skipped_hashes:]

        if not remaining_hashes:
            return 0, False
        # Must recompute at least the last token, matching the logic in
        # kv_cache_manager.get_computed_blocks().
        max_hit_len = request.num_tokens - 1 - num_computed_tokens
        if max_hit_len <= 0:
            return 0, False
        cpu_hit_blocks, hit_length, _ = self.cpu_coordinator.find_longest_cache_hit(
            remaining_hashes, max_hit_len
        )

        if hit_length > 0:
            pin_blocks = [
                blk for grp in cpu_hit_blocks for blk in grp if not blk.is_null
            ]
            self.cpu_block_pool.touch(pin_blocks)
            self._pending_cpu_hits[request.request_id] = (
                cpu_hit_blocks,
                hit_length,
                num_computed_tokens,
            )
            return hit_length, True
        return 0, False

    # TODO(yifan): this API now only matches the suffix part of the prefix cache. A more
    # general API should scan blocks in both GPU and CPU block pool in a single pass.
    def update_state_after_alloc(self, request: "Request",
                                 blocks: tuple[list[KVCacheBlock], ...],
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        # not in vLLM: the blocks come as one list per group (vLLM: KVCacheBlocks)
        block_ids_by_group = tuple([b.block_id for b in group] for group in blocks)
        num_groups = len(block_ids_by_group)

        # Store tracking (eager mode only). Register the request;
        # block IDs are accumulated from scheduler_output in
        # _prepare_eager_store_specs via yield_req_data.
        # not in vLLM: `not self._lazy_mode and` left out
        if req_id not in self._reqs_to_store:
            self._reqs_to_store[req_id] = StoreRequestState(
                request=request,
                block_ids=tuple([] for _ in range(num_groups)),
                num_stored_blocks=[0] * num_groups,
            )

        if num_local_tokens := self._pending_local_hits.pop(req_id, None):  # vLLM 0.34
            # Eager CPU is inclusive: a GPU prefix hit also uses the CPU copy,
            # but eager stores skip it, so move it to the MRU end here.
            prefix_hit, _, _ = self.cpu_coordinator.find_longest_cache_hit(
                request.block_hashes, num_local_tokens
            )
            prefix_blocks = [b for grp in prefix_hit for b in grp if not b.is_null]  # vLLM 0.34
            # not in vLLM: a hook (vLLM's touch, then free_blocks of the reversed blocks)
            self._refresh_cpu_lru(prefix_blocks)

        # Pop the CPU hit cached by get_num_new_matched_tokens(). The
        # found blocks were pinned there to survive LRU eviction in the window
        # between get_num_new_matched_tokens() and this matching call.
        pending = self._pending_cpu_hits.pop(req_id, None)

        if num_external_tokens == 0:
            if pending is not None:
                logger.warning(
                    "SimpleCPUOffloadScheduler: update_state_after_alloc "
                    "called for req_id=%s with no external tokens but "
                    "get_num_new_matched_tokens() unexpectedly recorded "
                    "a pending CPU hit; releasing the stale pin.",
                    req_id,
                )
                self._free_pending_cpu_hit(pending)
            return

        if pending is None:
            logger.warning(
                "SimpleCPUOffloadScheduler: update_state_after_alloc called "
                "for req_id=%s with num_external_tokens=%d but no pending "
                "CPU hit from get_num_new_matched_tokens(); skipping load.",
                req_id,
                num_external_tokens,
            )
            return

        # not in vLLM: hit_length kept, for the check below (vLLM: `_`)
        cpu_hit_blocks_full, hit_length, num_computed_tokens = pending
        # not in vLLM: accepting more than the hit would count unloaded blocks as computed
        assert num_external_tokens <= hit_length, (
            f"{req_id}: {num_external_tokens} external tokens > the {hit_length}-token hit")

        assert num_computed_tokens % self.block_size == 0, (
            "SimpleCPU external loads must start at a scheduler-block boundary"
        )
        # Fine-grained hits are hash-block aligned, not group-block aligned, so
        # the per-group block count below rounds up instead of dividing exactly.
        # Hash alignment is still required: it is what makes the accepted
        # external suffix start on a boundary every group can address.
        assert num_external_tokens % self.hash_block_size == 0, (
            f"num_external_tokens={num_external_tokens} is not aligned to "
            f"hash_block_size={self.hash_block_size}"
        )

        # The scheduler may have accepted fewer blocks than
        # get_num_new_matched_tokens() reported.
        # Take only the leading N blocks per group matching num_external_tokens;
        # the rest will be released along with the temp pin below.
        cpu_hit_blocks: list[list[KVCacheBlock]] = []
        for g in range(num_groups):
            g_block_size = self.group_block_sizes[g]
            n_take_g = cdiv(num_external_tokens, g_block_size)
            cpu_hit_blocks.append(cpu_hit_blocks_full[g][:n_take_g])

        gpu_block_ids: list[int] = []
        cpu_block_ids: list[int] = []
        cpu_blocks_to_touch: list[KVCacheBlock] = []

        for g in range(num_groups):
            cpu_blocks_g = cpu_hit_blocks[g]
            n_ext_g = len(cpu_blocks_g)
            if n_ext_g == 0:
                continue

            g_block_size = self.group_block_sizes[g]
            gpu_ext_start = num_computed_tokens // g_block_size
            group_gpu_ids = block_ids_by_group[g]

            for i, cpu_blk in enumerate(cpu_blocks_g):
                # Skip null blocks (e.g. sliding window or mamba padding).
                if cpu_blk.is_null:
                    continue
                gpu_block_ids.append(group_gpu_ids[gpu_ext_start + i])
                cpu_block_ids.append(cpu_blk.block_id)
                cpu_blocks_to_touch.append(cpu_blk)

        # Touch CPU blocks to prevent eviction during async load.
        self.cpu_block_pool.touch(cpu_blocks_to_touch)
        # Release the temporary pin held since get_num_new_matched_tokens().
        self._free_pending_cpu_hit(pending)

        # Touch GPU blocks to prevent freeing during async load
        assert self._gpu_block_pool is not None
        self._gpu_block_pool.touch(
            [self._gpu_block_pool.blocks[bid] for bid in gpu_block_ids]
        )

        assert self._reqs_to_load.get(req_id) is None
        self._reqs_to_load[req_id] = LoadRequestState(
            request=request, transfer_meta=TransferMeta(gpu_block_ids, cpu_block_ids)
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> SimpleCPUOffloadMetadata:
        # --- Stores ---
        store_event = -1
        # not in vLLM: eager mode only, so vLLM's prepare_store_specs is called by its branch
        store_gpu, store_cpu, store_req_ids = self._prepare_eager_store_specs(scheduler_output)
        for transfer in self._pending_finished_stores:  # PR #53532
            store_gpu.extend(transfer.gpu_block_ids)  # PR #53532
            store_cpu.extend(transfer.cpu_block_ids)  # PR #53532
        self._pending_finished_stores.clear()  # PR #53532

        if store_gpu:
            store_event = self._store_event_counter
            self._store_event_counter += 1
            # not in vLLM: no KV-cache event metadata (vLLM's third field)
            self._store_event_to_blocks[store_event] = TransferMeta(store_gpu, store_cpu)
            # For eager mode only, track req->blocks mapping
            if store_req_ids:
                self._store_event_to_reqs[store_event] = store_req_ids
                for req_id in store_req_ids:
                    store_state = self._reqs_to_store.get(req_id)
                    if store_state is not None:
                        store_state.store_events.add(store_event)

        # --- Loads ---
        load_event = -1
        load_gpu: list[int] = []
        load_cpu: list[int] = []
        load_req_ids: list[str] = []
        for req_id, load_state in self._reqs_to_load.items():
            if load_state.load_event is not None:
                continue
            assert load_state.transfer_meta is not None
            load_gpu.extend(load_state.transfer_meta.gpu_block_ids)
            load_cpu.extend(load_state.transfer_meta.cpu_block_ids)
            load_req_ids.append(req_id)
        if load_req_ids:
            load_event = self._load_event_counter
            self._load_event_counter += 1
            for req_id in load_req_ids:
                self._reqs_to_load[req_id].load_event = load_event
            self._load_event_to_reqs[load_event] = load_req_ids

        result = SimpleCPUOffloadMetadata(
            load_event=load_event,
            load_gpu_blocks=load_gpu,
            load_cpu_blocks=load_cpu,
            load_event_to_reqs={
                event_idx: list(req_ids)
                for event_idx, req_ids in self._load_event_to_reqs.items()
            },
            store_event=store_event,
            store_gpu_blocks=store_gpu,
            store_cpu_blocks=store_cpu,
            need_flush=bool(scheduler_output.preempted_req_ids),
        )
        return result

    # PR #53532 also dropped the stamp in _prepare_lazy_store_specs (lazy mode, left out here):
    # its `cpu_blk._block_hash = bhash` loop after `cpu_pool.get_new_blocks(len(gpu_ids))` went.
    def _prepare_eager_store_specs(self, scheduler_output: SchedulerOutput
                                   ) -> tuple[list[int], list[int], list[str]]:
        """Identify newly computed blocks to offload from scheduler requests.

        Only considers blocks whose KV data has been **confirmed computed** by
        the GPU. Blocks from the current step are stored on a later step, or by
        the finish-time flush if the request completes first."""
        merged_gpu_block_ids: list[int] = []
        merged_cpu_block_ids: list[int] = []
        req_ids: list[str] = []

        gpu_block_pool = self._gpu_block_pool
        if gpu_block_pool is None:
            # not in vLLM: no event metadata (vLLM's fourth value)
            return [], [], []
        # not in vLLM: vLLM reads its CPU config
        num_groups = len(self.group_block_sizes)
        # Dedup against blocks already scheduled.
        in_flight = self._in_flight_store_gpu_blocks

        # Preemption frees the request's blocks. It resumes with a full new
        # block table in its NewRequestData.
        preempted_req_ids = scheduler_output.preempted_req_ids or ()  # vLLM 0.32
        for req_id in preempted_req_ids:  # vLLM 0.32
            state = self._reqs_to_store.get(req_id)  # vLLM 0.32
            if state is not None:  # vLLM 0.32
                state.block_ids = tuple([] for _ in range(num_groups))  # vLLM 0.32
                state.num_stored_blocks = [0] * num_groups  # vLLM 0.32

        for req_id, block_id_groups, is_full_table in yield_req_data(scheduler_output):
            state = self._reqs_to_store.get(req_id)
            if state is None or state.finished:
                continue

            if is_full_table:
                state.block_ids = tuple([] for _ in range(num_groups))

            if block_id_groups:
                for g in range(min(num_groups, len(block_id_groups))):
                    if block_id_groups[g] is not None:
                        # Accumulate new block IDs.
                        state.block_ids[g].extend(block_id_groups[g])

            num_new_tokens = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if num_new_tokens == 0:
                continue

            block_ids_by_group = state.block_ids
            if not block_ids_by_group:
                continue

            # PR #53532: the selection the finish flush shares (vLLM 0.34 adds event metadata)
            gpu_block_ids, advanced_per_group = (
                self._select_eager_blocks_to_store(state, block_ids_by_group)
            )

            # Batch allocate the CPU destinations.
            n_to_alloc = len(gpu_block_ids)
            if n_to_alloc > 0:
                # PR #53532 dropped 0.29's stamp after this allocation (cpu_blk._block_hash = bhash)
                # not in vLLM: a hook (vLLM's cpu_block_pool.get_new_blocks(n_to_alloc))
                cpu_blocks_alloc = self._allocate_cpu_blocks(gpu_block_ids, state.request)
                cpu_block_ids = [blk.block_id for blk in cpu_blocks_alloc]
            else:
                cpu_block_ids = []

            if cpu_block_ids:
                req_ids.append(req_id)
                merged_gpu_block_ids.extend(gpu_block_ids)
                merged_cpu_block_ids.extend(cpu_block_ids)
                in_flight.update(gpu_block_ids)

                # Touch GPU blocks to prevent freeing during async copy
                gpu_block_pool.touch(
                    [gpu_block_pool.blocks[bid] for bid in gpu_block_ids]
                )

            # Advance per-group cursors (includes cached hits + newly stored)
            for g in range(num_groups):
                state.num_stored_blocks[g] += advanced_per_group[g]

        # Completion tracking is set-based, so keep one request ID.
        req_ids = list(dict.fromkeys(req_ids))
        # not in vLLM: no event metadata (vLLM's fourth value)
        return merged_gpu_block_ids, merged_cpu_block_ids, req_ids

    def _cached_gpu_block(self, resolved_hashes: Sequence[bytes], block_idx: int,  # vLLM 0.30
                          group_id: int) -> KVCacheBlock | None:
        """Return the GPU block still cached under this group's block hash."""
        if block_idx >= len(resolved_hashes):
            return None
        assert self._gpu_block_pool is not None
        blocks = self._gpu_block_pool.get_cached_block(
            resolved_hashes[block_idx], [group_id]
        )
        return blocks[0] if blocks else None

    # the fix moved this selection out of the per-step scan, so that the finish flush shares
    # it; the lines tagged vLLM 0.3x changed after it
    def _select_eager_blocks_to_store(self, state: StoreRequestState,  # PR #53532
                                      block_ids_by_group: tuple[list[int], ...]
                                      ) -> tuple[list[int], list[int]]:
        """Return confirmed eager blocks and cursor advances."""
        assert self._gpu_block_pool is not None
        gpu_block_ids: list[int] = []
        # not in vLLM: vLLM's config
        advanced_per_group = [0] * len(self.group_block_sizes)
        request = state.request
        confirmed_tokens = request.num_computed_tokens - request.num_output_placeholders
        # not in vLLM: a hook (vLLM's cpu_block_pool.get_num_free_blocks())
        num_free = self._num_free_for_store(state)

        for g, group_gpu_ids in enumerate(block_ids_by_group):
            if len(gpu_block_ids) >= num_free:
                break
            group_size = self.group_block_sizes[g]
            # Mimic the GPU KV cache manager's cacheable prefix.
            cacheable_tokens = self.cpu_coordinator.get_num_cacheable_tokens(  # vLLM 0.32
                confirmed_tokens, g
            )
            cacheable_tokens = min(  # vLLM 0.34
                cacheable_tokens, len(request.block_hashes) * self.hash_block_size
            )
            ready = min(len(group_gpu_ids), cacheable_tokens // group_size)  # vLLM 0.32
            resolved_hashes = resolve_block_hashes(  # vLLM 0.30
                request.block_hashes, self.hash_block_size, group_size
            )
            start = state.num_stored_blocks[g]
            for i, gpu_block_id in enumerate(group_gpu_ids[start:ready], start=start):
                gpu_block = self._gpu_block_pool.blocks[gpu_block_id]
                if gpu_block.is_null:  # vLLM 0.30
                    # Sliding-window groups null pages that left the window
                    # before the connector sees the block table, but the
                    # retained prefix-cache tail stays hashed in the GPU free
                    # queue; store it from there.
                    recovered = self._cached_gpu_block(resolved_hashes, i, g)  # vLLM 0.30
                    if recovered is None:  # vLLM 0.30
                        advanced_per_group[g] += 1  # vLLM 0.30
                        continue  # vLLM 0.30
                    gpu_block = recovered  # vLLM 0.30
                    gpu_block_id = gpu_block.block_id  # vLLM 0.30
                if (  # vLLM 0.30
                    self._classify_store_candidate(gpu_block)
                    is not _StoreAdmission.READY
                ):
                    advanced_per_group[g] += 1
                    continue
                if len(gpu_block_ids) >= num_free:
                    break
                primary_block_hash = gpu_block.block_hash
                assert primary_block_hash is not None
                gpu_block_ids.append(gpu_block_id)
                advanced_per_group[g] += 1

        # not in vLLM: no event metadata
        return gpu_block_ids, advanced_per_group

    def _classify_store_candidate(self, gpu_block: KVCacheBlock) -> _StoreAdmission:  # vLLM 0.30
        if gpu_block.is_null:
            return _StoreAdmission.NULL_BLOCK
        if gpu_block.block_hash is None:
            return _StoreAdmission.NOT_HASHED
        if gpu_block.block_id in self._in_flight_store_gpu_blocks:
            return _StoreAdmission.IN_FLIGHT
        if (
            self.cpu_block_pool.cached_block_hash_to_block.get_one_block(
                gpu_block.block_hash
            )
            is not None
        ):
            return _StoreAdmission.ALREADY_CACHED
        return _StoreAdmission.READY

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Handle async transfer completions from worker.

        Load completions arrive via finished_recving (real req_ids).
        Store completions arrive via kv_connector_worker_meta as
        per-event worker counts. We accumulate across steps and process
        a store event only when all workers have reported completion.
        """
        # --- Load completions ---
        for req_id in list(connector_output.finished_recving or []):
            # not in vLLM: no load counter (metrics)
            self._cleanup_load_request(req_id)

        # --- Store completions ---
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, SimpleCPUOffloadWorkerMetadata):
            return
        # NOTE: an unknown event's counts (a repeat, from before a reset) wait, then are
        # dropped
        for event_idx, count in meta.completed_store_events.items():
            total = self._store_event_pending_counts.get(event_idx, 0) + count
            if total >= self._expected_worker_count:
                self._store_event_pending_counts.pop(event_idx, None)
                self._process_store_event(event_idx)
            else:
                self._store_event_pending_counts[event_idx] = total

    def _process_store_event(self, event_idx: int) -> None:
        """Process a fully-completed store event."""
        transfer = self._store_event_to_blocks.pop(event_idx, None)
        if transfer is None:
            transfer = self._abandoned_store_event_to_blocks.pop(event_idx, None)
            if transfer is None:
                # guard stale events from before a reset() call
                return
            self._release_transfer_refs(transfer)
            return

        # not in vLLM: `if not self._lazy_mode:` (lazy mode left out)
        self._in_flight_store_gpu_blocks.difference_update(transfer.gpu_block_ids)

        # not in vLLM: no event metadata (vLLM's third argument)
        self._process_store_completion(transfer.gpu_block_ids, transfer.cpu_block_ids)

        # Eager only: update per-req state
        for req_id in self._store_event_to_reqs.pop(event_idx, []):
            state = self._reqs_to_store.get(req_id)
            if state is None:
                continue
            state.store_events.discard(event_idx)
            if state.finished and not state.store_events:
                self._cleanup_store_request(req_id)

    def _process_store_completion(self, gpu_block_ids: list[int], cpu_block_ids: list[int]
                                  ) -> None:
        """Register copied blocks in the CPU prefix cache and release refs."""
        assert len(cpu_block_ids) == len(gpu_block_ids)

        cpu_blocks = [self.cpu_block_pool.blocks[bid] for bid in cpu_block_ids]

        # PR #53532 moved this assert up from after the loop: the loop reads the GPU pool now
        assert self._gpu_block_pool is not None
        for gpu_block_id, cpu_block in zip(gpu_block_ids, cpu_blocks):  # PR #53532
            gpu_block = self._gpu_block_pool.blocks[gpu_block_id]  # PR #53532
            primary_hash = gpu_block.block_hash  # PR #53532
            assert primary_hash is not None  # PR #53532
            # not in vLLM: the fix's first version reset the hash first, since guard 1 of
            # _insert_block_hash() returns on a block stamped with the key (0.29 stamped at
            # allocation); the merged fix has neither. A no-op here, kept so no stamp can return.
            cpu_block.reset_hash()
            self.cpu_block_pool._insert_block_hash(  # PR #53532
                primary_hash,
                cpu_block,
                num_tokens=gpu_block.block_hash_num_tokens,
            )
            # the GPU block's fine-grained secondary keys, which 0.29 never copied
            secondary_hashes = self._gpu_block_pool.cached_block_hashes_by_block.get(  # PR #53532
                gpu_block_id, ()
            )
            for block_hash in secondary_hashes:  # PR #53532
                self.cpu_block_pool._insert_block_hash(  # PR #53532
                    block_hash, cpu_block, num_tokens=None
                )

        # Free CPU and GPU blocks' ref counts to turn them into prefix cache.
        # not in vLLM: a hook (vLLM's cpu_block_pool.free_blocks(cpu_blocks))
        self._free_cpu_blocks(cpu_blocks)
        # not in vLLM: `evict_first=self._lazy_mode` (lazy mode left out)
        self._gpu_block_pool.free_blocks(
            (self._gpu_block_pool.blocks[bid] for bid in gpu_block_ids)
        )

    def _release_transfer_refs(self, transfer: TransferMeta) -> None:
        """Release transfer refs without making copied data cacheable."""
        cpu_blocks = [self.cpu_block_pool.blocks[bid] for bid in transfer.cpu_block_ids]
        # PR #53532 dropped 0.29's reset_hash() of each block here: nothing is stamped
        # not in vLLM: a hook (vLLM's cpu_block_pool.free_blocks(cpu_blocks))
        self._free_cpu_blocks(cpu_blocks)
        assert self._gpu_block_pool is not None
        self._gpu_block_pool.free_blocks(
            self._gpu_block_pool.blocks[bid] for bid in transfer.gpu_block_ids
        )

    def has_pending_stores(self) -> bool:
        """Return True if a store transfer is queued or in flight."""
        return bool(
            self._pending_finished_stores  # PR #53532
            or self._store_event_to_blocks
            or self._abandoned_store_event_to_blocks
        )

    def has_pending_loads(self) -> bool:
        """not in vLLM: True while an accepted load (an aborted one's too) is not reported."""
        return bool(self._reqs_to_load or self._abandoned_reqs_to_load)

    # PR #53532 renamed the connector's has_pending_transfers() (simple_cpu_offload_connector.py)
    # to has_pending_push_work(); it returns the manager's has_pending_stores()
    def has_pending_push_work(self) -> bool:
        """not in vLLM's manager: the connector's method, so that an engine asks the manager."""
        return self.has_pending_stores()

    def request_finished(self, request: "Request", block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Always returns (False, None). GPU blocks are protected by ref_cnt,
        so the scheduler can free blocks immediately."""
        req_id = request.request_id

        # Release any temp CPU hit pin from get_num_new_matched_tokens()
        # if request is canceled or preempted before update_state_after_alloc()
        pending = self._pending_cpu_hits.pop(req_id, None)
        if pending is not None:
            self._free_pending_cpu_hit(pending)
        self._pending_local_hits.pop(req_id, None)  # vLLM 0.34

        # Handle load: defer cleanup if load is in-flight
        load_state = self._reqs_to_load.get(req_id)
        if load_state is not None:
            if load_state.load_event is not None:
                # Defer: load in-flight
                load_state.finished = True
            else:
                self._cleanup_load_request(req_id)

        # Handle store (eager mode only): defer cleanup if stores in-flight
        store_state = self._reqs_to_store.get(req_id)
        if store_state is not None:
            if store_state.store_events:
                # Defer: stores in-flight
                store_state.finished = True
            else:
                self._cleanup_store_request(req_id)

        return False, None

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        self._queue_finished_eager_store(request, block_ids)  # PR #53532
        return self.request_finished(request, block_ids=[])

    def _queue_finished_eager_store(self, request: "Request",  # PR #53532
                                    block_ids: tuple[list[int], ...]) -> None:
        """Queue confirmed eager blocks omitted after a request enters decode."""
        state = self._reqs_to_store.get(request.request_id)
        gpu_pool = self._gpu_block_pool
        if state is None or gpu_pool is None:
            return
        gpu_ids, _ = self._select_eager_blocks_to_store(state, block_ids)
        if not gpu_ids:
            return
        # not in vLLM: a hook (vLLM's cpu_block_pool.get_new_blocks(len(gpu_ids)))
        cpu_blocks = self._allocate_cpu_blocks(gpu_ids, request)
        self._pending_finished_stores.append(
            TransferMeta(gpu_ids, [b.block_id for b in cpu_blocks])
        )
        self._in_flight_store_gpu_blocks.update(gpu_ids)
        gpu_pool.touch([gpu_pool.blocks[bid] for bid in gpu_ids])

    def _free_pending_cpu_hit(self, pending: tuple[tuple[list[KVCacheBlock], ...], int, int]
                              ) -> None:
        """Release the temporary CPU block pin taken in get_num_new_matched_tokens()."""
        cpu_hit_blocks, _hit_length, _num_computed_tokens = pending
        blocks_to_free = [
            blk for grp in cpu_hit_blocks for blk in grp if not blk.is_null
        ]
        if blocks_to_free:
            # not in vLLM: a hook (vLLM's cpu_block_pool.free_blocks(blocks_to_free))
            self._free_cpu_blocks(blocks_to_free)

    def _cleanup_load_request(self, req_id: str) -> None:
        """Release all load resources for a request.

        Shared between request_finished() and update_connector_output() paths.
        Removes the request from _reqs_to_load, cleans up event mappings,
        and frees CPU/GPU touch refs."""
        state = self._reqs_to_load.pop(req_id, None)
        if state is None:
            state = self._abandoned_reqs_to_load.pop(req_id, None)
        if state is None:
            # not in vLLM: no count to return (vLLM's metrics)
            return
        # Remove from load event mapping (only this req, not whole event)
        if state.load_event is not None:
            reqs = self._load_event_to_reqs.get(state.load_event)
            if reqs is not None:
                with contextlib.suppress(ValueError):
                    reqs.remove(req_id)
                if not reqs:
                    self._load_event_to_reqs.pop(state.load_event, None)

        if state.transfer_meta is not None:
            # Free CPU touch refs
            # not in vLLM: a hook (vLLM's cpu_block_pool.free_blocks of the same blocks)
            self._free_cpu_blocks(
                [self.cpu_block_pool.blocks[bid] for bid in state.transfer_meta.cpu_block_ids]
            )
            # Free GPU touch refs
            assert self._gpu_block_pool is not None
            self._gpu_block_pool.free_blocks(
                self._gpu_block_pool.blocks[bid]
                for bid in state.transfer_meta.gpu_block_ids
            )

    def _cleanup_store_request(self, req_id: str) -> None:
        """Release store metadata for a request.

        Metadata-only cleanup but no block freeing. Job completion handles
        block caching and GPU ref freeing via _process_store_completion()."""
        state = self._reqs_to_store.pop(req_id, None)
        if state is None:
            return
        for event_idx in list(state.store_events):
            if (reqs := self._store_event_to_reqs.get(event_idx)) is not None:
                with contextlib.suppress(ValueError):
                    reqs.remove(req_id)
                if not reqs:
                    self._store_event_to_reqs.pop(event_idx, None)
        state.store_events.clear()

    def reset(self) -> bool:
        """Abandon pending transfers and reset the CPU cache when safe.

        Worker-side DMA may still be using blocks after reset is requested.
        Keep those block refs pinned until the existing completion path reports
        the transfer finished, then release refs without caching abandoned
        store results."""
        for pending in self._pending_cpu_hits.values():  # vLLM 0.32
            self._free_pending_cpu_hit(pending)  # vLLM 0.32
        self._pending_cpu_hits.clear()  # vLLM 0.32
        self._pending_local_hits.clear()  # vLLM 0.34

        self._abandoned_store_event_to_blocks.update(self._store_event_to_blocks)
        for transfer in self._pending_finished_stores:  # PR #53532
            self._release_transfer_refs(transfer)  # PR #53532
        self._pending_finished_stores.clear()  # PR #53532

        self._store_event_to_blocks.clear()
        self._in_flight_store_gpu_blocks.clear()

        # Loads that have not been sent to the worker cannot have running DMA.
        # In-flight loads stay pinned and are cleaned up on completion.
        for req_id in list(self._reqs_to_load):
            state = self._reqs_to_load.pop(req_id)
            if state.load_event is None:
                self._reqs_to_load[req_id] = state
                self._cleanup_load_request(req_id)
            else:
                self._abandoned_reqs_to_load[req_id] = state

        self._reqs_to_store.clear()
        self._store_event_to_reqs.clear()
        self._store_event_pending_counts = {
            event_idx: count
            for event_idx, count in self._store_event_pending_counts.items()
            if event_idx in self._abandoned_store_event_to_blocks
        }
        # NOTE: _load_event_counter / _store_event_counter are not
        # reset as they are monotonic and must stay ahead of the workers
        # high-water marks to avoid event index collisions

        if self._abandoned_store_event_to_blocks or self._abandoned_reqs_to_load:
            return False

        return self.cpu_block_pool.reset_prefix_cache()

    # --- hooks (not in vLLM): each body is vLLM's own call -------------------------
    def _allocate_cpu_blocks(self, gpu_block_ids: list[int], request: Request
                             ) -> list[KVCacheBlock]:
        """CPU destinations for a selection of GPU blocks (may evict LRU CPU blocks)."""
        return self.cpu_block_pool.get_new_blocks(len(gpu_block_ids))

    def _free_cpu_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Every CPU free but the LRU refresh's."""
        self.cpu_block_pool.free_blocks(blocks)

    def _num_free_for_store(self, state: StoreRequestState) -> int:
        """CPU blocks a store may take."""
        return self.cpu_block_pool.get_num_free_blocks()

    def _refresh_cpu_lru(self, prefix_blocks: list[KVCacheBlock]) -> None:
        """Move a GPU hit's CPU copies to the MRU end (touch + free); reversed: tail goes first."""
        self.cpu_block_pool.touch(prefix_blocks)
        self.cpu_block_pool.free_blocks(reversed(prefix_blocks))


# -----------------------------------------------------------------------------
# 5. The pre-fix variant (vLLM 0.29, before the fix), kept runnable so each bug can be shown

class PreFixCPUOffloadScheduler(SimpleCPUOffloadScheduler):
    """The manager as vLLM 0.29 had it (the last release before the fix): the methods the fix
    changed, 0.29's; the rest, 0.34's (the differential neutralises 0.29's other differences on
    vLLM's side). Each flag turns one bug back on; with both on, a differential test drives it
    in lockstep with vLLM 0.29's.
    registration_bug: stamp at allocation, insert the stamped primary key straight into the map
        at completion. Whole-block lookups hit; fine-grained secondary keys are never copied.
    skip_reset_hash (no release: the fix's first version *without* its reset_hash(), the trap):
        stamp at allocation; guard 1 of _insert_block_hash() keeps the key out of the map.
    flush_bug: blocks confirmed in a request's last step(s) are never stored."""

    def __init__(self, *args: Any, registration_bug: bool = True, flush_bug: bool = True,
                 skip_reset_hash: bool = False, **kwargs: Any):
        # the trap lives in the fix's registration, which the pre-fix registration never calls
        if registration_bug and skip_reset_hash:
            raise ValueError("skip_reset_hash=True needs registration_bug=False")
        super().__init__(*args, **kwargs)
        self.registration_bug = registration_bug
        self.flush_bug = flush_bug
        self.skip_reset_hash = skip_reset_hash
        self.stamps = registration_bug or skip_reset_hash

    def _allocate_cpu_blocks(self, gpu_block_ids: list[int], request: Request
                             ) -> list[KVCacheBlock]:
        cpu_blocks = super()._allocate_cpu_blocks(gpu_block_ids, request)
        if self.stamps:
            # vLLM 0.29, _prepare_eager_store_specs: `cpu_blk._block_hash = bhash` right after
            # get_new_blocks(), around the pool: on the block, not in the map yet.
            assert self._gpu_block_pool is not None
            for gpu_id, cpu_block in zip(gpu_block_ids, cpu_blocks):
                cpu_block.block_hash = self._gpu_block_pool.blocks[gpu_id].block_hash
        return cpu_blocks

    def _process_store_completion(self, gpu_block_ids: list[int], cpu_block_ids: list[int]) -> None:
        if not self.stamps:
            return super()._process_store_completion(gpu_block_ids, cpu_block_ids)
        cpu_blocks = [self.cpu_block_pool.blocks[b] for b in cpu_block_ids]
        assert self._gpu_block_pool is not None
        for gpu_block_id, cpu_block in zip(gpu_block_ids, cpu_blocks):
            if self.registration_bug:
                # vLLM 0.29: `cached_block_hash_to_block.insert(bhash, cpu_block)`, the stamped
                # primary key straight into the map; the GPU block's secondaries are never read
                self.cpu_block_pool.cached_block_hash_to_block.insert(cpu_block.block_hash,
                                                                      cpu_block)
                continue
            # the trap: the fix's calls without its reset_hash(); the stamp stops at guard 1
            gpu_block = self._gpu_block_pool.blocks[gpu_block_id]
            self.cpu_block_pool._insert_block_hash(gpu_block.block_hash, cpu_block,
                                                   gpu_block.block_hash_num_tokens)
            for key in self._gpu_block_pool.cached_block_hashes_by_block.get(gpu_block_id, ()):
                self.cpu_block_pool._insert_block_hash(key, cpu_block, None)
        self._free_cpu_blocks(cpu_blocks)
        self._gpu_block_pool.free_blocks(self._gpu_block_pool.blocks[b] for b in gpu_block_ids)

    def _release_transfer_refs(self, transfer: TransferMeta) -> None:
        if self.stamps:
            # vLLM 0.29: uncached blocks drop their stamps
            for cpu_id in transfer.cpu_block_ids:
                self.cpu_block_pool.blocks[cpu_id].reset_hash()
        super()._release_transfer_refs(transfer)

    def _select_eager_blocks_to_store(self, state: StoreRequestState,
                                      block_ids_by_group: tuple[list[int], ...]
                                      ) -> tuple[list[int], list[int]]:
        if not self.flush_bug:
            return super()._select_eager_blocks_to_store(state, block_ids_by_group)
        # vLLM 0.29's per-step scan (the fix replaced it). With the CPU pool full it walks past
        # blocks it skips anyway, stopping at the first that needs one: only the cursor differs.
        req = state.request
        confirmed_tokens = req.num_computed_tokens - req.num_output_placeholders
        aligned_tokens = confirmed_tokens // self.block_size * self.block_size
        num_free = self.cpu_block_pool.get_num_free_blocks()
        assert self._gpu_block_pool is not None
        gpu_blocks = self._gpu_block_pool.blocks
        out: list[int] = []
        advanced = [0] * len(block_ids_by_group)
        for g, ids in enumerate(block_ids_by_group):
            ready_blocks = aligned_tokens // self.group_block_sizes[g]
            for gpu_id in ids[state.num_stored_blocks[g]:ready_blocks]:
                candidate = self._classify_store_candidate(gpu_blocks[gpu_id])
                if candidate is _StoreAdmission.READY:
                    if len(out) >= num_free:
                        # out of space: 0.29 leaves every group here
                        return out, advanced
                    out.append(gpu_id)
                advanced[g] += 1
        return out, advanced

    def _queue_finished_eager_store(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> None:
        if not self.flush_bug:
            return super()._queue_finished_eager_store(request, block_ids)
        # vLLM 0.29: request_finished_all_groups() went straight to request_finished()
        # (`TODO: flush on finish`): the request's state was dropped, nothing queued


# -----------------------------------------------------------------------------
# 6. Copy worker (vLLM's worker.py; the copy backend is ours: torch, not cuMemcpyBatchAsync)

# not in vLLM: the copy rule's threshold (TorchCopyBackend). A copy_ call costs 10-17 µs
# of host time on CUDA, in which one pinned copy moves about 1 MiB (55 GB/s): below that,
# the calls set the speed, not the link. An estimate from --gpu-check's copy_ rows, not a
# measured crossover.
_GATHER_BELOW_BYTES = 1 << 20


def _coalesce_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for runs consecutive on *both* sides: one slice copy each."""
    runs: list[list[int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def _device_rows(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous t [num_blocks, ...] as [num_blocks, row_words] over the same memory (no
    copy), addressable from `device`: 8-byte words (bytes if a row is not a whole number of
    them). On CUDA through __cuda_array_interface__: with unified addressing, a pinned host
    address is valid on the GPU, so kernels read and write the mirror across the link. On
    CPU through numpy's __array_interface__: the same address arithmetic, checked in CI."""
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        raise ValueError("a CPU mirror of CUDA caches must be pinned: the GPU reads it")
    row_bytes = t[0].nbytes
    word = 8 if row_bytes % 8 == 0 else 1
    interface = {"shape": (t.shape[0], row_bytes // word), "typestr": f"<i{word}",
                 "data": (t.data_ptr(), False), "strides": None, "version": 3}
    if device.type == "cuda":
        cuda_array = types.SimpleNamespace(__cuda_array_interface__=interface)
        return torch.as_tensor(cuda_array, device=device)
    return torch.from_numpy(np.asarray(types.SimpleNamespace(__array_interface__=interface)))


class TorchCopyBackend:
    """Not in vLLM: DmaCopyBackend's calls (init, launch_copy) with torch copies, issued in
    the calling thread (vLLM: cuMemcpyBatchAsync from a background thread). Two paths, one
    rule: a launch's ids are split into runs consecutive on both sides (_coalesce_runs); if
    its copy_ calls (runs x regions) would move at least _GATHER_BELOW_BYTES on average, one
    slice copy_ per run and region (the readable reference: DMA at the link's speed for
    large runs); otherwise one index_select + index_copy_ per region over zero-copy device
    views of both sides (_device_rows), two kernels per region however many runs, the
    mirror's side read or written across the link. Both copy whole rows as integer words:
    the same bytes, NaN payloads too. `dev` is torch.cuda, the tests' simulated device, or
    torch.cpu (whose streams and events do nothing: a CPU copy is done when it returns)."""

    def __init__(self, dev: Any) -> None:
        self.dev = dev

    def init(self, gpu_caches: dict[str, torch.Tensor], cpu_caches: dict[str, torch.Tensor],
             device: torch.device, load_stream: Any, store_stream: Any) -> None:
        self._caches = (cpu_caches, gpu_caches)  # a load's (source, destination)
        # [num_blocks, row_words] views, made once: an unpinned mirror on CUDA fails here
        cpu_rows = {name: _device_rows(t, device) for name, t in cpu_caches.items()}
        gpu_rows = {name: _device_rows(t, device) for name, t in gpu_caches.items()}
        self._rows = (cpu_rows, gpu_rows)
        self._device = device
        self._load_stream = load_stream
        self._store_stream = store_stream
        # the rule's threshold (a benchmark sets it to force a path)
        self.gather_below_bytes = _GATHER_BELOW_BYTES

    def launch_copy(self, src_blocks: list[int], dst_blocks: list[int], is_store: bool,
                    event_idx: int, events_list: list[tuple[int, Any]],
                    wait_event: Any = None) -> None:
        stream = self._store_stream if is_store else self._load_stream
        if wait_event is not None:
            stream.wait_event(wait_event)
        if not is_store:
            # a load waits for the compute stream's work so far (the worker's docstring), read
            # here: inside the copy stream's context the current stream is the copy stream
            stream.wait_stream(self.dev.current_stream())
        with self.dev.stream(stream):
            self.copy_blocks(src_blocks, dst_blocks, is_store)
        event = self.dev.Event()
        event.record(stream)
        events_list.append((event_idx, event))

    def copy_blocks(self, src_blocks: list[int], dst_blocks: list[int], is_store: bool) -> None:
        """Issue one launch's copies on the current stream, by the rule (class docstring)."""
        runs = _coalesce_runs(src_blocks, dst_blocks)
        cpu_caches = self._caches[0]
        row_bytes = sum(t[0].nbytes for t in cpu_caches.values())
        bytes_per_copy = len(src_blocks) * row_bytes / (len(runs) * len(cpu_caches))
        if bytes_per_copy >= self.gather_below_bytes:
            src, dst = self._caches
            if is_store:
                src, dst = dst, src
            for name, s in src.items():
                d = dst[name]
                for s0, d0, n in runs:
                    d[d0:d0 + n].copy_(s[s0:s0 + n], non_blocking=True)
            return
        src, dst = self._rows
        if is_store:
            src, dst = dst, src
        # the ids go up pinned, so that their upload is queued on this stream like the kernels
        pin = self._device.type == "cuda"
        src_ids = torch.tensor(src_blocks, pin_memory=pin).to(self._device, non_blocking=True)
        dst_ids = torch.tensor(dst_blocks, pin_memory=pin).to(self._device, non_blocking=True)
        for name, s in src.items():
            # gather the rows (len(ids), row_words) on the device, then scatter them: 2 kernels
            # (into an allocated output: torch's CPU index_select is 20x slower without one)
            rows = s.new_empty((len(src_blocks), s.shape[1]))
            torch.index_select(s, 0, src_ids, out=rows)
            dst[name].index_copy_(0, dst_ids, rows)


def _split_regions(kv_caches: dict[str, torch.Tensor], num_gpu_blocks: int,
                   block_dim: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, region) of every cache, checked: block_dim 0 gives the cache itself, 1 its K
    and V halves ("name.k", "name.v"). Block i must be row i of a contiguous region (a run of
    ids is then one slice), and no region may take the name of another cache."""
    for name, cache in kv_caches.items():
        if block_dim and cache.shape[0] != 2:  # a third part would never be copied
            raise ValueError(f"KV cache {name!r} of shape {tuple(cache.shape)} is not "
                             "(2, num_gpu_blocks, ...)")
        parts = {f"{name}.k": cache[0], f"{name}.v": cache[1]} if block_dim else {name: cache}
        for key_name, region in parts.items():
            if region.shape[0] != num_gpu_blocks or not region.is_contiguous():
                raise ValueError(f"KV cache region {key_name!r} of shape "
                                 f"{tuple(region.shape)} is not a contiguous "
                                 f"[num_gpu_blocks={num_gpu_blocks}, ...]")
            if key_name != name and key_name in kv_caches:
                raise ValueError(f"KV cache region name {key_name!r} is used twice")
            yield key_name, region


class SimpleCPUOffloadWorker:
    """Worker-side handler for CPU offloading transfers.

    Not in vLLM: the CPU pool's size and the block dimension are given (vLLM sizes the pool from
    its byte budget and reads the regions from the KV-cache config), copies go through
    TorchCopyBackend, and a load waits for the compute stream. Two copy paths, one rule: a
    launch whose slice copies (a run of ids consecutive on both sides, per region) would move
    _GATHER_BELOW_BYTES (1 MiB) or more on average is copied run by run with copy_; any other
    is gathered and scattered (two kernels per region) over zero-copy views of the mirrors.
    CUDA: loads (CPU->GPU) run on `load_stream`, stores (GPU->CPU) on `store_stream`, both at
    torch.cuda.Stream.priority_range()[0] as in vLLM: the lowest, also the default stream's
    (0), so they do not yield to compute on it. A store waits on a compute-done event recorded
    on the compute stream at every store: it must not read KV a kernel has not finished
    writing. A load waits for the compute stream's work so far at every load (not in vLLM):
    its GPU destination may be a block that a finished request's kernels still read. Both
    read the compute stream outside the copy stream's context (inside it, the current stream
    is the copy stream). Completion is polled (event.query(), never a sync) in FIFO order, one
    high-water mark per direction (event i done => every event <= i done): indices must grow.
    CPU: the same calls, copies done when they return. A `copy_engine` (torch.cuda's names,
    e.g. the tests' DeferredCopyEngine) stands in for torch.cuda."""

    def __init__(self, num_cpu_blocks: int, copy_engine: Any = None):
        self.gpu_kv_caches: dict[str, torch.Tensor] | None = None
        self.cpu_kv_caches: dict[str, torch.Tensor] | None = None
        self.device: torch.device | None = None
        # not in vLLM: given (vLLM sizes the pool from cpu_capacity_bytes at registration)
        self.num_cpu_blocks = num_cpu_blocks
        # not in vLLM: torch.cuda's stand-in (None: torch.cuda on CUDA, synchronous on CPU)
        self.copy_engine = copy_engine

        # CUDA streams for the async transfers
        self.load_stream: torch.cuda.Stream | None = None
        self.store_stream: torch.cuda.Stream | None = None

        # not in vLLM: DmaCopyBackend's stand-in
        self._backend: TorchCopyBackend | None = None

        # Ordered (event_idx, Event). Events pre-allocated on main thread.
        self._load_events: list[tuple[int, torch.Event]] = []
        self._store_events: list[tuple[int, torch.Event]] = []
        # High-water marks: highest event_idx completed per stream.
        # When the event list is empty, the hwm covers all prior events.
        self._load_hwm: int = -1
        self._store_hwm: int = -1

        # Metadata for the current step
        self._connector_metadata: SimpleCPUOffloadMetadata | None = None

        # Compute-done event recorded before each store; reused across steps
        # (get_finished runs once per step, copy queue is FIFO).
        self._store_compute_done: torch.Event | None = None

        # Pending event index sets, populated in bind_connector_metadata
        self._pending_load_event_indices: set[int] = set()
        self._pending_store_event_indices: set[int] = set()
        # Completed store events to report via build_connector_worker_meta
        self._completed_store_events: dict[int, int] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_gpu_blocks: int,
                           block_dim: int) -> None:
        """Register GPU KV caches and allocate pinned CPU tensors.

        Not in vLLM: `block_dim` (vLLM reads it from the KV-cache spec) is 0 for
        [num_gpu_blocks, ...] and 1 for FlashAttention's (2, num_gpu_blocks, ...), split into K
        and V regions. All or nothing: after an error (a failed pin too) a retry can succeed.
        """
        # not in vLLM: new mirrors would lose the served KV (and free pinned memory in use)
        assert not self.cpu_kv_caches, "register_kv_caches: once per worker"
        unique_gpu_caches: dict[str, torch.Tensor] = {}
        seen: set[tuple[torch.device, int]] = set()
        # not in vLLM: the regions from block_dim, checked (vLLM: the KV-cache config's
        # placement of each tensor)
        for key_name, region in _split_regions(kv_caches, num_gpu_blocks, block_dim):
            key = (region.device, region.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            unique_gpu_caches[key_name] = region
        # not in vLLM: a local, set on the worker last (vLLM sets self.device first)
        device = next(iter(kv_caches.values())).device
        # not in vLLM: torch.cuda, or its stand-in (the tests'), or torch.cpu's no-op streams
        dev = self.copy_engine or (torch.cuda if device.type == "cuda" else torch.cpu)

        low_pri = 0  # not in vLLM: CPU streams have no priorities
        if device.type == "cuda":  # not in vLLM
            # Use lowest priority so KV cache I/O yields to compute streams.
            low_pri, _ = torch.cuda.Stream.priority_range()
        self.load_stream = dev.Stream(priority=low_pri)  # not in vLLM: `dev`
        self.store_stream = dev.Stream(priority=low_pri)  # not in vLLM: `dev`

        # not in vLLM: before anything else is set, so that a failed allocation (a pinned one
        # can fail) leaves the worker unregistered; vLLM allocates last
        self._init_cpu_mode(unique_gpu_caches, device, dev)
        # vLLM's first line, here last: nothing can fail any more
        self.device = next(iter(kv_caches.values())).device
        self.gpu_kv_caches = unique_gpu_caches

    def _init_cpu_mode(self, unique_gpu_caches: dict[str, torch.Tensor], device: torch.device,
                       dev: Any) -> None:
        # not in vLLM: pinned on CUDA, always (vLLM warns and copies pageable memory)
        pin_memory = device.type == "cuda"
        self.cpu_kv_caches = self._alloc_cpu_caches(unique_gpu_caches, pin_memory)

        self._backend = TorchCopyBackend(dev)  # not in vLLM: DmaCopyBackend's stand-in
        self._backend.init(
            unique_gpu_caches,
            self.cpu_kv_caches,
            device,
            self.load_stream,
            self.store_stream,
        )

    def _alloc_cpu_caches(self, unique_gpu_caches: dict[str, torch.Tensor],
                          pin_memory: bool) -> dict[str, torch.Tensor]:
        """One mirror per region: the same row layout, num_cpu_blocks rows (not in vLLM: one
        allocation each, zeroed; vLLM carves them out of one mapping, pinned in chunks)."""
        cpu_kv_caches = {}
        for name, gpu_tensor in unique_gpu_caches.items():  # not in vLLM: no byte sizes
            cpu_shape = (self.num_cpu_blocks,) + gpu_tensor.shape[1:]
            cpu_kv_caches[name] = torch.zeros(  # not in vLLM: see the docstring
                cpu_shape, dtype=gpu_tensor.dtype, pin_memory=pin_memory)
        return cpu_kv_caches

    def bind_connector_metadata(self, metadata: SimpleCPUOffloadMetadata) -> None:
        self._check_metadata(metadata)  # not in vLLM
        self._connector_metadata = metadata
        if metadata.load_event >= 0:
            self._pending_load_event_indices.add(metadata.load_event)
        if metadata.store_event >= 0:
            self._pending_store_event_indices.add(metadata.store_event)
        self._complete_empty_events(metadata)  # not in vLLM

    def _check_metadata(self, metadata: SimpleCPUOffloadMetadata) -> None:
        """Not in vLLM: an event that does not grow would be reported done by an earlier one's
        high-water mark; copies under event -1 are never reported; unpaired lists mispair.
        An event bound earlier is pending or at most the high-water mark."""
        last_load_event = max([self._load_hwm, *self._pending_load_event_indices])
        last_store_event = max([self._store_hwm, *self._pending_store_event_indices])
        assert metadata.load_event < 0 or metadata.load_event > last_load_event, (
            f"load_event {metadata.load_event} after {last_load_event}: must grow")
        assert metadata.store_event < 0 or metadata.store_event > last_store_event, (
            f"store_event {metadata.store_event} after {last_store_event}: must grow")
        assert (metadata.load_event >= 0 or not metadata.load_cpu_blocks) and (
            metadata.store_event >= 0 or not metadata.store_gpu_blocks), "blocks under event -1"
        assert len(metadata.load_cpu_blocks) == len(metadata.load_gpu_blocks) and len(
            metadata.store_gpu_blocks) == len(metadata.store_cpu_blocks), "unpaired block ids"

    def _complete_empty_events(self, metadata: SimpleCPUOffloadMetadata) -> None:
        """Not in vLLM: an event with nothing to copy gets a done event (no copy would give it
        one), reported in FIFO order with the others."""
        if metadata.load_event >= 0 and not metadata.load_cpu_blocks:
            self._load_events.append((metadata.load_event, torch.cpu.Event()))
        if metadata.store_event >= 0 and not metadata.store_gpu_blocks:
            self._store_events.append((metadata.store_event, torch.cpu.Event()))

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None

    def start_load_kv(self) -> None:
        # Invoked after the forward launch on steps without sync loads
        # (SchedulerOutput.has_sync_kv_loads), so the CPU-side block copy
        # op overhead (~5ms) stays hidden behind GPU compute. Stores are
        # issued in wait_for_save().
        metadata = self._connector_metadata
        if metadata is not None and metadata.load_cpu_blocks:
            backend = self._backend
            assert backend is not None
            backend.launch_copy(
                metadata.load_cpu_blocks,
                metadata.load_gpu_blocks,
                is_store=False,
                event_idx=metadata.load_event,
                events_list=self._load_events,
            )

    def wait_for_save(self) -> None:
        """Submit async stores.

        Stores (GPU->CPU) read the live KV cache, which the compute stream may
        still be writing under v1 overlapped execution, so they are ordered
        after a compute-done event recorded on the current stream. See
        #45704 for the bug and #39306 for the srcAccessOrder rationale.
        """
        metadata = self._connector_metadata
        if metadata is not None and metadata.store_gpu_blocks:
            backend = self._backend
            assert backend is not None
            if self._store_compute_done is None:
                # not in vLLM: torch.Event(), or the stand-in's
                self._store_compute_done = backend.dev.Event()
            # not in vLLM: torch.cuda.current_stream(), or the stand-in's
            self._store_compute_done.record(backend.dev.current_stream())
            backend.launch_copy(
                metadata.store_gpu_blocks,
                metadata.store_cpu_blocks,
                is_store=True,
                event_idx=metadata.store_event,
                events_list=self._store_events,
                wait_event=self._store_compute_done,
            )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, set[str] | None]:
        """Report completed transfer events to the scheduler (non-blocking).

        Returns (None, req_ids whose loads have completed): stores report as worker metadata.
        """
        metadata = self._connector_metadata
        finished_recving: set[str] = set()

        if self._pending_load_event_indices:
            load_wm = self._poll_stream_events(is_store=False)
            for j in [j for j in self._pending_load_event_indices if j <= load_wm]:
                self._pending_load_event_indices.discard(j)
                req_ids = (
                    metadata.load_event_to_reqs.get(j) if metadata is not None else None
                )
                if req_ids:
                    finished_recving.update(req_ids)

        if self._pending_store_event_indices:
            store_wm = self._poll_stream_events(is_store=True)
            for j in [j for j in self._pending_store_event_indices if j <= store_wm]:
                self._pending_store_event_indices.discard(j)
                self._completed_store_events[j] = 1

        return None, finished_recving or None

    def build_connector_worker_meta(self) -> SimpleCPUOffloadWorkerMetadata | None:
        """Return completed store events since the last call."""
        if not self._completed_store_events:
            return None
        meta = SimpleCPUOffloadWorkerMetadata(
            completed_store_events=self._completed_store_events,
        )
        self._completed_store_events = {}
        return meta

    def handle_preemptions(self, kv_connector_metadata: SimpleCPUOffloadMetadata) -> None:
        """Sync all in-flight transfers before preempted blocks are reused."""
        if not kv_connector_metadata.need_flush:
            return
        self._flush_and_sync_all()

    def _flush_and_sync_all(self) -> None:
        """Synchronize all in-flight transfer events."""
        for event_idx, event in self._load_events:
            # note: a CPU-GPU sync point, only on preemption
            event.synchronize()
            self._load_hwm = event_idx
        self._load_events.clear()

        for event_idx, event in self._store_events:
            event.synchronize()
            self._store_hwm = event_idx
        self._store_events.clear()

    def _poll_stream_events(self, is_store: bool) -> int:
        """Non-blocking poll for completed events and return the high-water mark."""
        events = self._store_events if is_store else self._load_events
        hwm = self._store_hwm if is_store else self._load_hwm
        while events:
            event_idx, event = events[0]
            if not event.query():
                break
            hwm = event_idx
            events.pop(0)
        if is_store:
            self._store_hwm = hwm
        else:
            self._load_hwm = hwm
        return hwm


# -----------------------------------------------------------------------------
# 7. Beyond vLLM: prefix-aware eviction in the CPU tier (opt-in)

def _move_run_before(first: KVCacheBlock, last: KVCacheBlock, anchor: KVCacheBlock) -> None:
    """Move the run first..last of a free queue to just ahead of `anchor` (outside it), O(1)."""
    before = first.prev_free_block
    after = last.next_free_block
    before.next_free_block = after
    after.prev_free_block = before
    prev = anchor.prev_free_block
    prev.next_free_block = first
    first.prev_free_block = prev
    last.next_free_block = anchor
    anchor.prev_free_block = last


class PrefixAwareCPUOffloadScheduler(SimpleCPUOffloadScheduler):
    """not in vLLM. A store never evicts the prefix it extends (judged by the hash chain), nor
    the parent of a copy in flight, and the CPU pool evicts a chain's children before its
    parents. vLLM's LRU evicts a chain's root first, stranding every block after it: a pool a
    block smaller than a prompt serves nothing once a later store evicts after an earlier one
    completed; here n blocks serve n - 1. How: each CPU block records its parent's key; a freed
    run goes just ahead of its parent, O(1) a block; a second copy of a cached block goes to
    the front. Among chains, LRU, except that a store stops short of a block predicted to be
    used again before the chain it stores: a block's next use is its last one plus the gap
    between its last two (in ticks, scheduler steps that select stores; one at least); a
    chain's, by its evicted key's gap (a short memory of evicted keys, twice the pool), else by
    its cached parent's. So prompts in rotation keep a share each where LRU keeps little or
    none. Limits (workload_table and the fuzz measure them): a chain never reused is stored as
    by LRU; sibling branches and a lookup after a GPU hit (it pins a child, not its parent) can
    still put a parent first; a prediction made on one reuse can keep a block never used again.
    Besides the hooks, build_connector_meta starts a step (a tick)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # CPU block id -> the key of its parent in the prefix chain (None: a chain's root)
        self._cpu_parent_keys: list[bytes | None] = [None] * self.num_cpu_blocks
        # CPU block id -> the roots of runs freed while it was in use: they wait for it
        self._waiting_runs: dict[int, list[KVCacheBlock]] = {}
        # the clock: one tick per scheduler step that selects stores; CPU block id -> the tick
        # of its last use (-1 - tick: stored at tick, not registered yet) and the ticks between
        # its last two uses (None: used once); evicted keys -> their last use, oldest first
        self._clock = 0
        self._ticked = False
        self._last_use = [0] * self.num_cpu_blocks
        self._reuse_gap: list[int | None] = [None] * self.num_cpu_blocks
        self._evicted_last_use: OrderedDict[bytes, int] = OrderedDict()
        # parent key -> its children whose stores are in flight: the parent must stay. Only a
        # run's first copy counts (the others' parents are in flight with them): CPU block id
        # -> its parent key, while in flight
        self._in_flight_children: dict[bytes, int] = {}
        self._in_flight_run_parents: dict[int, bytes] = {}

    def _allocate_cpu_blocks(self, gpu_block_ids: list[int], request: Request
                             ) -> list[KVCacheBlock]:
        """Also record each destination's parent key (the previous source's in a run of one
        group, else cache_full_blocks' formula), each victim's last use under its evicted key,
        and each destination's reuse gap. Bound locals: this is the store path's loop."""
        evicted = self._evicted_last_use
        last_uses = self._last_use
        victim = self.cpu_block_pool.free_block_queue.fake_free_list_head.next_free_block
        for _ in gpu_block_ids:
            if victim.block_hash is not None:
                evicted[victim.block_hash] = last_uses[victim.block_id]
                evicted.move_to_end(victim.block_hash)
            victim = victim.next_free_block
        cpu_blocks = super()._allocate_cpu_blocks(gpu_block_ids, request)
        assert self._gpu_block_pool is not None
        gpu_blocks = self._gpu_block_pool.blocks
        parent_keys = self._cpu_parent_keys
        in_flight = self._in_flight_children
        gaps = self._reuse_gap
        clock = self._clock
        one_group = len(self.group_block_sizes) == 1
        block_size = self.block_size
        prev_block = None  # the previous source: in a run of one group, the parent
        for gpu_block_id, cpu_block in zip(gpu_block_ids, cpu_blocks):
            gpu_block = gpu_blocks[gpu_block_id]
            block_id = cpu_block.block_id
            num_tokens = gpu_block.block_hash_num_tokens or 0
            if one_group:
                parent_num_tokens = num_tokens - block_size
            else:
                group_id = get_group_id(gpu_block.block_hash)
                parent_num_tokens = num_tokens - self.group_block_sizes[group_id]
            if one_group and prev_block is not None and (
                    prev_block.block_hash_num_tokens == parent_num_tokens):
                parent_keys[block_id] = prev_block.block_hash  # no hashing
            elif parent_num_tokens > 0:  # a run's first copy: its parent may be in the queue
                parent_fine_idx = parent_num_tokens // self.hash_block_size - 1
                parent_key = request.block_hashes[parent_fine_idx] + gpu_block.block_hash[-4:]
                parent_keys[block_id] = parent_key
                self._in_flight_run_parents[block_id] = parent_key
                in_flight[parent_key] = in_flight.get(parent_key, 0) + 1
            else:
                parent_keys[block_id] = None  # a chain's root
            # stored again after an eviction: a reuse, whose gap predicts the next one
            last_use = evicted.pop(gpu_block.block_hash, None)
            gaps[block_id] = None if last_use is None else clock - last_use
            # negative until the copy registers: the request's use, not one yet
            last_uses[block_id] = -1 - clock
            prev_block = gpu_block
        # a short memory: as many evicted keys as the pool has blocks, twice
        while len(evicted) > 2 * self.num_cpu_blocks:
            evicted.popitem(last=False)
        return cpu_blocks

    def _num_free_for_store(self, state: StoreRequestState) -> int:
        """The free queue's front up to the first block to keep: one of the request's own chain,
        wherever its cursor is (evicting it would strand this store's copies), the parent of a
        copy in flight, or one due again before the chain stored; no further than it could take.
        The step's first selection ticks the clock."""
        request = state.request
        block_hashes = request.block_hashes
        cursors = zip(state.block_ids, state.num_stored_blocks)
        num_wanted = sum(len(ids) - num_stored for ids, num_stored in cursors)
        num_free = self.cpu_block_pool.get_num_free_blocks()
        if not self._ticked:  # the step's first store selection: one tick
            self._clock += 1
            self._ticked = True
        incoming_reuse = self._predicted_reuse(state)
        block = self.cpu_block_pool.free_block_queue.fake_free_list_head.next_free_block
        for i in range(min(num_free, num_wanted)):
            key = block.block_hash
            if key is None:  # nothing cached in it: free to take
                block = block.next_free_block
                continue
            # the parent of a copy in flight: evicting it would orphan the copy when it lands
            if key in self._in_flight_children:
                return i
            # a block due again (not overdue) before the chain stored here is kept: stop short
            gap = self._reuse_gap[block.block_id]
            due = self._last_use[block.block_id] + (gap or 0)
            if gap is not None and incoming_reuse is not None and (
                    self._clock <= due + 1 and due < incoming_reuse):
                return i
            num_tokens = block.block_hash_num_tokens
            if num_tokens is not None:
                fine_idx = num_tokens // self.hash_block_size - 1
                if fine_idx < len(block_hashes) and key.startswith(block_hashes[fine_idx]):
                    return i
            block = block.next_free_block
        return num_free

    def _predicted_reuse(self, state: StoreRequestState) -> int | None:
        """The tick at which the chain `state` stores is predicted to be used again: by the
        gap since its first uncached block's last use (remembered when it was evicted), else by
        the reuse gap of the cached block before it; None when neither was ever reused (a new
        chain: stored as by LRU)."""
        request = state.request
        scale = self.group_block_sizes[0] // self.hash_block_size
        num_blocks = len(request.block_hashes) // scale
        gap = None
        for i in range(max(state.num_stored_blocks[0] - 1, 0), num_blocks):
            key = make_block_hash_with_group_id(request.block_hashes[(i + 1) * scale - 1], 0)
            block = self.cpu_block_pool.cached_block_hash_to_block.get_one_block(key)
            if block is None:
                last_use = self._evicted_last_use.get(key)
                if last_use is not None:
                    gap = self._clock - last_use
                break
            gap = self._reuse_gap[block.block_id]
        return None if gap is None else self._clock + gap

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> SimpleCPUOffloadMetadata:
        """A new step: its first store selection ticks the clock."""
        self._ticked = False
        return super().build_connector_meta(scheduler_output)

    def _refresh_cpu_lru(self, prefix_blocks: list[KVCacheBlock]) -> None:
        """Touch, then free in prefix order: the run placement puts the leaves first."""
        self.cpu_block_pool.touch(prefix_blocks)
        self._free_cpu_blocks(prefix_blocks)

    def _free_cpu_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """`blocks` in prefix order: free_blocks' ref drops; each run of hashed blocks reaching
        0 (consecutive, each the child of the one before) is placed by _place_cpu_run."""
        parent_keys = self._cpu_parent_keys
        last_uses = self._last_use
        in_flight = self._in_flight_children
        run_parents = self._in_flight_run_parents
        gaps = self._reuse_gap
        clock = self._clock
        unhashed: list[KVCacheBlock] = []
        run: list[KVCacheBlock] = []  # root first
        run_hash = None  # the hash of the run's last (leaf-most) block
        for block in blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            ref_cnt = block.ref_cnt
            assert ref_cnt >= 0, f"block {block.block_id} is freed twice"
            block_id = block.block_id
            block_hash = block.block_hash
            if ref_cnt:  # held: the run ends here
                if run:
                    self._place_cpu_run(run)
                    run = []
                continue
            # a store's destination lands (or is abandoned): not a use, but its parent may go
            last_use = last_uses[block_id]
            if last_use < 0:
                last_uses[block_id] = -1 - last_use
                parent_key = run_parents.pop(block_id, None)
                if parent_key is not None:
                    num_children = in_flight.pop(parent_key) - 1
                    if num_children:
                        in_flight[parent_key] = num_children
            # a use ends (a hit, a GPU hit's refresh): its gap, one tick at least
            elif block_hash is not None:
                gaps[block_id] = clock - last_use or 1
                last_uses[block_id] = clock
            if block_hash is None:  # unhashed: the run ends here
                unhashed.append(block)
                if run:
                    self._place_cpu_run(run)
                    run = []
                continue
            if run and parent_keys[block_id] == run_hash:
                run.append(block)  # the child of the run's leaf: the run goes on
            else:
                if run:
                    self._place_cpu_run(run)
                run = [block]
            run_hash = block_hash
        if run:
            self._place_cpu_run(run)
        unhashed.reverse()  # as free_blocks(reversed(blocks)) would prepend them
        self.cpu_block_pool.free_block_queue.prepend_n(unhashed)

    def _place_cpu_run(self, run: list[KVCacheBlock]) -> None:
        """The freed run (root first) joins the back leaf first, runs that waited for it just ahead;
        then just ahead of its root's parent if free, the front if gone, the back if in use."""
        queue = self.cpu_block_pool.free_block_queue
        last = run[0]
        run.reverse()
        queue.append_n(run)
        first = run[0]
        waiting_runs = self._waiting_runs
        for block in run:
            if not waiting_runs:  # none left to place (mostly none at all)
                break
            for root in waiting_runs.pop(block.block_id, ()):  # if still its free child
                if (root.prev_free_block is not None and root not in run
                        and self._cpu_parent_keys[root.block_id] == block.block_hash):
                    root_first = self._descendants_ahead(root)
                    _move_run_before(root_first, root, first)
                    first = root_first
        # a second copy of a cached block (two requests stored it in one step) is never hit:
        # it goes to the front
        cache = self.cpu_block_pool.cached_block_hash_to_block
        if cache.get_one_block(last.block_hash) is not last:
            head = queue.fake_free_list_head.next_free_block
            if head is not first:
                _move_run_before(first, last, head)
            return
        parent_key = self._cpu_parent_keys[last.block_id]
        if parent_key is None:
            return
        first = self._descendants_ahead(first)
        parent = self.cpu_block_pool.cached_block_hash_to_block.get_one_block(parent_key)
        head = queue.fake_free_list_head.next_free_block
        if parent is None and head is not first:
            _move_run_before(first, last, head)
        elif parent is not None and parent.prev_free_block is not None:  # in the free queue
            _move_run_before(first, last, parent)
        elif parent is not None:  # in use: the run waits at the back until it is placed
            waiting = self._waiting_runs.setdefault(parent.block_id, [])
            if last not in waiting:  # freed again before its parent: one entry
                waiting.append(last)

    def _descendants_ahead(self, first: KVCacheBlock) -> KVCacheBlock:
        """The first of the descendants just ahead of `first` (each the child of the next)."""
        while (first.prev_free_block.block_hash is not None
               and self._cpu_parent_keys[first.prev_free_block.block_id] == first.block_hash):
            first = first.prev_free_block
        return first


# -----------------------------------------------------------------------------
# 8. Beyond vLLM: a proposed fix for a crash vLLM 0.34 still has (opt-in)

class LoadFailureSafeCPUOffloadScheduler(SimpleCPUOffloadScheduler):  # not in vLLM: proposal
    """Stores that a failed load spoiled register nothing (not in vLLM: a proposed fix).
    A sibling connector (vLLM's MultiConnector) loads a request's prefix synchronously and
    reports a block as failed (invalid_block_ids). The eager store of that step already copies
    it: external tokens count as computed at build_connector_meta. vLLM 0.34's engine then
      policy "fail":      evicts the block and those after it (BlockPool.evict_blocks), so the
                          pinned source has no hash and the completion fails the base's
                          `assert primary_hash is not None` (the engine crashes);
      policy "recompute": keeps them, and the completion registers a copy of KV never loaded
                          under a valid hash, which a later CPU hit loads.
    Here a completed store whose GPU source lost its hash, or whose block a failed load
    covered, frees its CPU block unregistered; every other block registers as in the base."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # GPU blocks whose store was in flight when a load into them was reported failed
        self._failed_load_gpu_blocks: set[int] = set()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # the failed load's report arrives with the completion of the store that copied the
        # block, or before it
        spoiled = connector_output.invalid_block_ids & self._in_flight_store_gpu_blocks
        self._failed_load_gpu_blocks.update(spoiled)
        super().update_connector_output(connector_output)

    def _process_store_completion(self, gpu_block_ids: list[int], cpu_block_ids: list[int]
                                  ) -> None:
        assert self._gpu_block_pool is not None
        gpu_blocks = self._gpu_block_pool.blocks
        kept = TransferMeta([], [])
        dropped = TransferMeta([], [])
        for gpu_block_id, cpu_block_id in zip(gpu_block_ids, cpu_block_ids):
            failed_load = gpu_block_id in self._failed_load_gpu_blocks
            self._failed_load_gpu_blocks.discard(gpu_block_id)
            # hash lost: evicted while pinned (vLLM's _handle_invalid_blocks, policy "fail")
            spoiled = failed_load or gpu_blocks[gpu_block_id].block_hash is None
            target = dropped if spoiled else kept
            target.gpu_block_ids.append(gpu_block_id)
            target.cpu_block_ids.append(cpu_block_id)
        if dropped.gpu_block_ids:
            # unpinned, unregistered: the CPU block goes to the front of the free queue
            self._release_transfer_refs(dropped)
        super()._process_store_completion(kept.gpu_block_ids, kept.cpu_block_ids)

    def reset(self) -> bool:
        # every sent store is abandoned (released, never registered): no mark is needed
        self._failed_load_gpu_blocks.clear()
        return super().reset()


# -----------------------------------------------------------------------------
# 9. Toy model and MiniEngine

class ToyModel:
    """Deterministic stand-in for a transformer's KV writes: a token's K and V depend on (token
    id, position) only, through `rounds` integer mixing rounds per layer, so they are bit-identical
    whatever the batch, chunking or device: recompute and CPU load must agree (expected_kv())."""

    # a prime < 2**31; with the LCG multiplier, every product fits in int64
    _MOD = 2_147_483_629
    _MUL = 1_103_515_245
    VOCAB_SIZE = 32000

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu",
                 rounds: int = 4):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.rounds = rounds
        num_features = 2 * num_kv_heads * head_dim  # K and V of every head: different streams
        self._feature = torch.arange(num_features, device=self.device, dtype=torch.int64)

    def compute_kv(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[num_layers, 2, n, num_kv_heads, head_dim] for n tokens at the given positions."""
        x = token_ids[:, None] * 7919 + positions[:, None] * 104_729 + self._feature[None, :] * 31
        x.remainder_(self._MOD)
        shifted = torch.empty_like(x)  # in place throughout: no new tensor per round
        kv = torch.empty((self.num_layers, *x.shape), dtype=self.dtype, device=x.device)
        for layer in range(self.num_layers):
            for _ in range(self.rounds):
                x.mul_(self._MUL).add_(12_345 + layer).remainder_(self._MOD)
                torch.bitwise_right_shift(x, 11, out=shifted)
                x.bitwise_xor_(shifted)
            kv[layer] = ((x % 1024) - 512).to(torch.float32).div_(256)  # exact in float16
        kv = kv.view(self.num_layers, -1, 2, self.num_kv_heads, self.head_dim)
        return kv.permute(0, 2, 1, 3, 4)

    def expected_kv(self, token_ids: Sequence[int]) -> torch.Tensor:
        t = torch.as_tensor(list(token_ids), dtype=torch.int64, device=self.device)
        return self.compute_kv(t, torch.arange(len(t), device=self.device))

    def forward(self, kv_caches: dict[str, torch.Tensor], token_ids: Sequence[int],
                positions: Sequence[int], slot_mapping: torch.Tensor) -> None:
        """Write the tokens' KV into the paged (2, num_blocks, block_size, H, D) caches."""
        token_tensor = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device)
        position_tensor = torch.as_tensor(positions, dtype=torch.int64, device=self.device)
        kv = self.compute_kv(token_tensor, position_tensor)
        for layer, cache in enumerate(kv_caches.values()):
            cache.view(2, -1, self.num_kv_heads, self.head_dim)[:, slot_mapping] = kv[layer]

    def read_kv(self, kv_caches: dict[str, torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """[num_layers, 2, len(slots), H, D]: the KV at `slots`, read back from the paged caches."""
        return torch.stack([cache.view(2, -1, self.num_kv_heads, self.head_dim)[:, slots]
                            for cache in kv_caches.values()])

    def next_token(self, kv_caches: dict[str, torch.Tensor], slots: torch.Tensor) -> int:
        """Greedy 'sampling' from the KV read back (a wrong load changes it); exact in float64."""
        last_layer = self.read_kv(kv_caches, slots)[-1]
        return int(last_layer.double().sum().item() * 256) % self.VOCAB_SIZE


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    computed_tokens: int = 0   # tokens the model ran for this request (prefill + decode)
    gpu_hit_tokens: int = 0    # prefix found in the GPU prefix cache
    cpu_hit_tokens: int = 0    # prefix loaded from the CPU cache
    ttft_s: float = 0.0        # add_request() -> first output token
    output_token_ids: list[int] = field(default_factory=list)
    # with capture_kv: the prompt's KV read back before freeing
    kv: torch.Tensor | None = None


class MiniEngine:
    """A one-group engine that drives the connector as vLLM's scheduler does, per step: schedule
    -> build_connector_meta -> each worker (one per rank): preemption flush, loads -> forward ->
    each worker: stores, completions -> finished requests (request_finished_all_groups, then
    their blocks freed) -> update_connector_output. A CPU hit waits for every worker's report."""

    def __init__(self, num_gpu_blocks: int, block_size: int, max_num_batched_tokens: int,
                 model: ToyModel, connector: SimpleCPUOffloadScheduler | None = None,
                 worker: SimpleCPUOffloadWorker | list[SimpleCPUOffloadWorker] | None = None,
                 capture_kv: bool = False):
        workers = worker if isinstance(worker, list) else [worker]
        workers = [w for w in workers if w is not None]
        if connector is not None:
            # a store completes on world_size reports: never with fewer workers, too early with
            # more
            if len(workers) != connector.world_size:
                raise ValueError(f"worker: {len(workers)} given, the connector's world_size is "
                                 f"{connector.world_size} (one worker per rank)")
            if connector.group_block_sizes != [block_size]:
                raise ValueError(f"block_size {block_size}: the connector's group block sizes "
                                 f"are {connector.group_block_sizes}")
            if connector._gpu_block_pool is not None:  # it names another engine's blocks
                raise ValueError("connector: it serves another engine")
            # a smaller mirror fails far away (or copies past its end); CPU ids are the
            # connector's
            if any(w.num_cpu_blocks < connector.num_cpu_blocks for w in workers):
                raise ValueError(f"worker: fewer CPU blocks than the connector's "
                                 f"{connector.num_cpu_blocks}")
        # all or nothing: refused before anything is bound or registered
        if len({id(w) for w in workers}) != len(workers) or any(w.gpu_kv_caches for w in workers):
            raise ValueError("worker: listed twice, or registered with another engine")
        self.hash_block_size = connector.hash_block_size if connector else block_size
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.model = model
        self.connector = connector
        self.workers = workers
        self.capture_kv = capture_kv
        self.gpu_block_pool = BlockPool(num_gpu_blocks, True, self.hash_block_size)
        # per rank, a FlashAttention-layout cache per layer; all ranks compute the same KV
        # (no TP)
        shape = (2, num_gpu_blocks, block_size, model.num_kv_heads, model.head_dim)
        layer_names = [f"layers.{i}" for i in range(model.num_layers)]
        self.rank_kv_caches = [{name: torch.zeros(shape, dtype=model.dtype, device=model.device)
                                for name in layer_names} for _ in range(max(len(workers), 1))]
        self.kv_caches = self.rank_kv_caches[0]  # what sampling and capture_kv read
        # the workers first: a failed registration leaves the connector unbound
        for w, kv_caches in zip(workers, self.rank_kv_caches):
            w.register_kv_caches(kv_caches, num_gpu_blocks, block_dim=1)
        if connector:
            connector.bind_gpu_block_pool(self.gpu_block_pool)
        self.waiting: list[Request] = []  # FIFO; preempted ones go back to the front
        self.running: list[Request] = []
        # added, not finished (vLLM's scheduler.requests)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        # in store events (vLLM counts kv_offload_store_bytes_total)
        self.num_stored_blocks = 0
        # request id -> GPU block table
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # request id -> its table's cached blocks
        self.stats: dict[str, RequestStats] = {}
        self._t_arrival: dict[str, float] = {}
        # ranks that reported a load, per request
        self._recving_counts: Counter[str] = Counter()
        # a refused reset: retried each step, no CPU lookup
        self._connector_reset_pending = False

    def add_request(self, request: Request) -> None:
        req_id = request.request_id
        # not in vLLM's engine core: a reused id would mix two requests
        if req_id in self.stats:
            raise ValueError(f"request id {req_id!r} is already in use")
        # hashed at another granularity, its keys would name another prefix's blocks
        if request.hash_block_size != self.hash_block_size:
            raise ValueError(f"request {req_id!r}: hash_block_size {request.hash_block_size}, "
                             f"the engine's is {self.hash_block_size}")
        # vLLM refuses it too
        max_num_tokens = request.num_prompt_tokens + request.max_tokens - 1
        if cdiv(max_num_tokens, self.block_size) > self.gpu_block_pool.num_gpu_blocks - 1:
            raise ValueError(f"request {req_id!r} needs more GPU blocks than the pool has")
        self.waiting.append(request)
        self.requests[req_id] = request
        self.stats[req_id] = RequestStats(prompt_tokens=request.num_prompt_tokens)
        self._t_arrival[req_id] = time.perf_counter()

    def abort_request(self, request_id: str) -> None:
        """Drop a request wherever it is, as vLLM's abort: connector first, then the GPU blocks."""
        req = self.requests.pop(request_id)
        queue = self.running if req.status == RequestStatus.RUNNING else self.waiting
        queue.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        self._free(req)

    def reset_gpu_prefix_cache(self) -> bool:
        return self.gpu_block_pool.reset_prefix_cache()

    def reset_connector_cache(self) -> bool:
        """vLLM's Scheduler.reset_connector_cache; refused (False) while sent copies are running."""
        self._connector_reset_pending = not self.connector.reset()
        return not self._connector_reset_pending

    def has_unfinished_work(self) -> bool:
        """Requests to run, or copies the connector still owes (an aborted request's too)."""
        owed = self.connector and (self.connector.has_pending_push_work()
                                   or self.connector.has_pending_loads())
        return bool(self.waiting or self.running or self._connector_reset_pending or owed)

    def run(self, max_steps: int = 100_000) -> dict[str, RequestStats]:
        while self.has_unfinished_work():
            if self.num_steps >= max_steps:
                raise RuntimeError(f"no progress after {max_steps} steps")
            self.step()
        return self.stats

    def _schedule(self) -> SchedulerOutput:
        """One pass in vLLM's order: running requests first (each its next chunk, preempting the
        last when short); if none was, the waiting queue, landed loads first (vLLM 0.34). One that
        cannot start is skipped (vLLM stops: a landed load could wait forever for blocks behind)."""
        scheduler_output = SchedulerOutput()
        token_budget = self.max_num_batched_tokens
        running_tokens: dict[str, int] = {}
        for req in list(self.running):
            # preempted in this loop
            if token_budget == 0 or req.status != RequestStatus.RUNNING:
                continue
            num_new_tokens = min(req.num_tokens - req.num_computed_tokens, token_budget)
            num_tokens = req.num_computed_tokens + num_new_tokens
            while (new_blocks := self._allocate(req, num_tokens)) is None:
                if self._preempt(scheduler_output) is req:
                    break
            if new_blocks is None:
                continue  # it preempted itself
            self._cache_blocks(req, num_tokens)
            running_tokens[req.request_id] = num_new_tokens
            if new_blocks:
                scheduler_output.new_block_ids[req.request_id] = ([b.block_id for b in new_blocks],)
            token_budget -= num_new_tokens
        if not scheduler_output.preempted_req_ids:
            self.waiting.sort(key=lambda r: r.status == RequestStatus.WAITING
                              and r.request_id in self.req_to_blocks, reverse=True)
            i = 0  # the first request not skipped yet
            while i < len(self.waiting) and token_budget > 0:
                req = self.waiting[i]
                num_new_tokens = self._admit(req, token_budget)
                # None: cannot start now; a load accepted just now: not before it lands
                if num_new_tokens is None or req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    i += 1
                    continue
                del self.waiting[i]
                self.running.append(req)
                self._cache_blocks(req, req.num_computed_tokens + num_new_tokens)
                req_id = req.request_id  # a new or resumed request: sent with its whole table
                scheduler_output.new_block_ids[req_id] = (
                    [b.block_id for b in self.req_to_blocks[req_id]],)
                if req.status == RequestStatus.PREEMPTED:
                    scheduler_output.resumed_req_ids.add(req_id)
                req.status = RequestStatus.RUNNING
                scheduler_output.num_scheduled_tokens[req_id] = num_new_tokens
                token_budget -= num_new_tokens
        # as vLLM 0.34 lists them: new and resumed requests before running ones (scheduled
        # first)
        scheduler_output.num_scheduled_tokens.update(running_tokens)
        return scheduler_output

    def _admit(self, req: Request, token_budget: int) -> int | None:
        """Tokens a waiting request computes this step (0 while its CPU load is pending), or None,
        with nothing changed, if it cannot start (a new one looks up, allocates and notifies)."""
        req_id = req.request_id
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return None  # its load is in flight (vLLM skips past it too)
        if req_id in self.req_to_blocks:  # its load landed: the whole prompt has its blocks
            return min(req.num_tokens - req.num_computed_tokens, token_budget)
        # the last token: recomputed
        (hit_blocks,), num_local_tokens = find_longest_cache_hit(
            req.block_hashes, req.num_tokens - 1, [0], self.gpu_block_pool, self.block_size)
        num_external_tokens = 0
        if self.connector is not None and not self._connector_reset_pending:
            num_external_tokens, _ = self.connector.get_num_new_matched_tokens(
                req, num_local_tokens)
        if num_external_tokens:
            num_new_tokens = 0  # nothing to compute until the load lands
            # not in vLLM: blocks for the whole prompt now (landed loads could wait for each
            # other)
            num_tokens = req.num_tokens
        else:
            num_new_tokens = min(req.num_tokens - num_local_tokens, token_budget)
            num_tokens = num_local_tokens + num_new_tokens
        num_evictable_hits = sum(b.ref_cnt == 0 for b in hit_blocks)  # touch() takes them too
        num_blocks_needed = cdiv(num_tokens, self.block_size) - len(hit_blocks)
        if num_blocks_needed + num_evictable_hits > self.gpu_block_pool.get_num_free_blocks():
            return None  # the connector's pin is dropped by the next lookup
        self.gpu_block_pool.touch(hit_blocks)
        self.req_to_blocks[req_id] = list(hit_blocks)
        self.num_cached_blocks[req_id] = len(hit_blocks)
        if req.status != RequestStatus.PREEMPTED:  # a resumed request keeps its first hits
            self.stats[req_id].gpu_hit_tokens = num_local_tokens
            self.stats[req_id].cpu_hit_tokens = num_external_tokens
        self._allocate(req, num_tokens)
        if self.connector is not None:
            self.connector.update_state_after_alloc(req, (self.req_to_blocks[req_id],),
                                                    num_external_tokens)
        # as vLLM: counted as computed before the load lands; nothing reads it until then
        req.num_computed_tokens = num_local_tokens + num_external_tokens
        if num_external_tokens:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        return num_new_tokens

    def _allocate(self, req: Request, num_tokens: int) -> list[KVCacheBlock] | None:
        """Grow the request's table to cover num_tokens; None (nothing taken) if it is short."""
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new_blocks > self.gpu_block_pool.get_num_free_blocks():
            return None
        new_blocks = self.gpu_block_pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        return new_blocks

    def _cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Cache the full blocks of [0, num_tokens): at scheduling time, as vLLM does."""
        num_full_blocks = min(num_tokens, len(req.block_hashes) * self.hash_block_size)
        num_full_blocks //= self.block_size
        num_cached = self.num_cached_blocks.get(req.request_id, 0)
        self.gpu_block_pool.cache_full_blocks(req, self.req_to_blocks[req.request_id],
                                              num_cached, num_full_blocks, self.block_size, 0)
        self.num_cached_blocks[req.request_id] = max(num_full_blocks, num_cached)

    def _free(self, req: Request, finished: bool = True) -> None:
        """Finished or aborted: the connector hears it first (vLLM); then its blocks, tail first."""
        blocks = self.req_to_blocks.pop(req.request_id, [])
        if finished and self.connector is not None:
            self.connector.request_finished_all_groups(req, ([b.block_id for b in blocks],))
        self.gpu_block_pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(req.request_id, None)

    def _preempt(self, scheduler_output: SchedulerOutput) -> Request:
        """vLLM's FCFS policy: free the last running request, back to the waiting queue's front."""
        victim = self.running.pop()
        self._free(victim, finished=False)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.waiting.insert(0, victim)
        # its blocks: reused at once
        scheduler_output.preempted_req_ids.add(victim.request_id)
        return victim

    def step(self) -> None:
        """One scheduler step + one forward pass, in vLLM's order (see the class docstring)."""
        self.num_steps += 1
        scheduler_output = self._schedule()
        meta = None
        if self.connector:
            meta = self.connector.build_connector_meta(scheduler_output)
            self.num_stored_blocks += len(meta.store_gpu_blocks)
        for w in self.workers:  # each worker = one TP rank with its own CPU mirror
            w.bind_connector_metadata(meta)
            # before the forward reuses a preempted request's blocks
            w.handle_preemptions(meta)
            w.start_load_kv()           # loads target requests that do not compute this step
        self._forward(scheduler_output)
        worker_meta = None
        for w in self.workers:
            # stores read blocks confirmed by earlier steps (and finish flushes)
            w.wait_for_save()
            # sorted: a set's order follows PYTHONHASHSEED, and the order of completions
            # decides the order of CPU frees, so eviction (not in vLLM: deterministic)
            self._recving_counts.update(sorted(w.get_finished(set())[1] or ()))
            this_worker_meta = w.build_connector_worker_meta()
            if worker_meta is not None and this_worker_meta is not None:
                this_worker_meta = worker_meta.aggregate(this_worker_meta)
            worker_meta = this_worker_meta or worker_meta
            w.clear_connector_metadata()
        # a load is done once every worker (TP rank) reported it (vLLM's KVOutputAggregator); a
        # list, in report order (not in vLLM: a set): the connector frees CPU blocks in its order
        finished_recving = [r for r, n in self._recving_counts.items() if n == len(self.workers)]
        for req_id in finished_recving:
            del self._recving_counts[req_id]
        # as vLLM's update_from_output: finished requests first, then the completions
        self._update_from_output(scheduler_output)
        if self.connector:
            self.connector.update_connector_output(KVConnectorOutput(finished_recving, worker_meta))
        # the reports above may have drained what refused it
        if self._connector_reset_pending:
            self._connector_reset_pending = not self.connector.reset()
        for req_id in finished_recving:
            # None: aborted (the connector released it already)
            req = self.requests.get(req_id)
            if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # its loaded blocks become GPU hits; it waits for the rest (resumed if it was)
                self._cache_blocks(req, req.num_computed_tokens)
                resumed = req.num_preemptions > 0
                req.status = RequestStatus.PREEMPTED if resumed else RequestStatus.WAITING

    def _slots(self, req_id: str, start: int, end: int) -> torch.Tensor:
        """Flat KV slots (block_id * block_size + offset) of the request's tokens [start, end)."""
        positions = torch.arange(start, end)
        table = torch.tensor([b.block_id for b in self.req_to_blocks[req_id]], dtype=torch.int64)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        return slots.to(self.model.device)

    def _forward(self, scheduler_output: SchedulerOutput) -> None:
        for req in self.running:  # from num_computed_tokens: hit prefixes are not recomputed
            num_new_tokens = scheduler_output.num_scheduled_tokens.get(req.request_id, 0)
            if not num_new_tokens:
                continue
            start = req.num_computed_tokens
            end = start + num_new_tokens
            slots = self._slots(req.request_id, start, end)
            for caches in self.rank_kv_caches:
                self.model.forward(caches, req.all_token_ids[start:end], range(start, end), slots)

    def _update_from_output(self, scheduler_output: SchedulerOutput) -> None:
        for req in list(self.running):
            req_id = req.request_id
            num_new_tokens = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if not num_new_tokens:
                continue
            req.num_computed_tokens += num_new_tokens
            stats = self.stats[req_id]
            stats.computed_tokens += num_new_tokens
            if req.num_computed_tokens < req.num_tokens:
                continue  # chunked prefill: more to come
            # the whole sequence is computed: sample (from the paged KV, loaded parts
            # included)
            token = self.model.next_token(self.kv_caches, self._slots(req_id, 0, req.num_tokens))
            if not stats.output_token_ids:
                stats.ttft_s = time.perf_counter() - self._t_arrival[req_id]
            stats.output_token_ids.append(token)
            req.append_output_token_ids(token)
            if len(stats.output_token_ids) < req.max_tokens:
                continue
            if self.capture_kv:  # the prompt's KV, read back before the blocks are freed
                slots = self._slots(req_id, 0, req.num_prompt_tokens)
                stats.kv = self.model.read_kv(self.kv_caches, slots).cpu()
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            del self.requests[req_id]
            self.running.remove(req)
            self._free(req)


# -----------------------------------------------------------------------------
# 10. `python kv_offload.py`: the demo, --bench and --gpu-check

# the toy model's KV takes 4 KiB a token on each side (GPU cache, CPU mirror): 4 GiB each here
MAX_STORY_TOKENS = 2**20


def run_story(scheduler_cls: type = SimpleCPUOffloadScheduler, prompt_tokens: int = 8192,
              block_size: int = 16, max_num_batched_tokens: int = 1024, device: str = "cpu",
              num_cpu_blocks: int | None = None, max_tokens: int = 1, **scheduler_kwargs) -> dict:
    """Request A, the GPU prefix cache dropped, request B with A's prompt: B's numbers, checks.
    One worker per rank of the connector (`world_size` in scheduler_kwargs)."""
    # a budget of 0 never computes a token; a huge prompt would take minutes to fail to
    # allocate
    if max_num_batched_tokens <= 0 or not 0 < prompt_tokens <= MAX_STORY_TOKENS:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be positive "
                         f"and prompt_tokens ({prompt_tokens}) in 1..{MAX_STORY_TOKENS:,}")
    num_blocks = prompt_tokens // block_size + 64
    if num_cpu_blocks is None:
        num_cpu_blocks = num_blocks
    connector = scheduler_cls(num_cpu_blocks, block_size, **scheduler_kwargs)
    workers = [SimpleCPUOffloadWorker(num_cpu_blocks) for _ in range(connector.world_size)]
    model = ToyModel(num_layers=4, num_kv_heads=4, head_dim=64, device=device, rounds=8)
    engine = MiniEngine(num_blocks, block_size, max_num_batched_tokens, model, connector, workers,
                        capture_kv=True)
    prompt = torch.randint(0, 32000, (prompt_tokens,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    engine.add_request(Request("A", prompt, connector.hash_block_size, max_tokens=max_tokens))
    stored_per_step = [0]  # the CPU cache's keys after each of A's steps
    while engine.has_unfinished_work():
        engine.step()
        stored_per_step.append(len(connector.cpu_block_pool.cached_block_hash_to_block))
    a = engine.stats["A"]
    assert engine.reset_gpu_prefix_cache(), "GPU blocks still in use after run()"
    engine.add_request(Request("B", prompt, connector.hash_block_size, max_tokens=max_tokens))
    b = engine.run()["B"]
    gpu_all_free = engine.gpu_block_pool.get_num_free_blocks() == num_blocks - 1
    cpu_all_free = connector.cpu_block_pool.get_num_free_blocks() == num_cpu_blocks - 1
    bytes_per_block = sum(t[0].nbytes for t in workers[0].cpu_kv_caches.values())
    return dict(cpu_blocks_registered=stored_per_step[-1],
                stored_bytes=engine.num_stored_blocks * bytes_per_block,
                cpu_hit_tokens=b.cpu_hit_tokens, recomputed_tokens=b.computed_tokens,
                ttft_b_s=b.ttft_s, same_output=a.output_token_ids == b.output_token_ids,
                kv_exact=torch.equal(b.kv, model.expected_kv(prompt).cpu()),
                all_free=gpu_all_free and cpu_all_free, stored_per_step=stored_per_step)


def run_rotation(num_prompts: int = 3, prompt_blocks: int = 64, num_cpu_blocks: int = 160,
                 rounds: int = 4, scheduler_cls: type = SimpleCPUOffloadScheduler,
                 block_size: int = 16, max_num_batched_tokens: int = 1024, seed: int = 0) -> dict:
    """`num_prompts` prompts of `prompt_blocks` blocks requested round-robin for `rounds` rounds,
    the GPU prefix cache dropped before each: the tokens loaded from CPU per round, the ideal
    (the pool's capacity, each prompt capped at its hit limit), and the checks."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 32000, (prompt_blocks * block_size,), generator=gen).tolist()
               for _ in range(num_prompts)]
    num_blocks = prompt_blocks + 64
    # small: the manager is measured
    model = ToyModel(num_layers=1, num_kv_heads=1, head_dim=8)
    connector = scheduler_cls(num_cpu_blocks, block_size)
    engine = MiniEngine(num_blocks, block_size, max_num_batched_tokens, model, connector,
                        SimpleCPUOffloadWorker(num_cpu_blocks), capture_kv=True)
    loaded_per_round = [0] * rounds
    kv_exact = True
    for r in range(rounds):
        for k, prompt in enumerate(prompts):
            assert engine.reset_gpu_prefix_cache(), "GPU blocks still in use after run()"
            engine.add_request(Request(f"round{r}-prompt{k}", prompt, block_size, max_tokens=1))
            stats = engine.run()[f"round{r}-prompt{k}"]
            loaded_per_round[r] += stats.cpu_hit_tokens
            kv_exact = kv_exact and torch.equal(stats.kv, model.expected_kv(prompt).cpu())
    # each prompt can load all its blocks but the last token's; the pool holds
    # num_cpu_blocks - 1
    max_hit_blocks = (prompt_blocks * block_size - 1) // block_size
    ideal_blocks = min(num_cpu_blocks - 1, num_prompts * max_hit_blocks)
    gpu_all_free = engine.gpu_block_pool.get_num_free_blocks() == num_blocks - 1
    cpu_all_free = connector.cpu_block_pool.get_num_free_blocks() == num_cpu_blocks - 1
    return dict(cpu_hit_tokens_per_round=loaded_per_round,
                ideal_tokens_per_round=ideal_blocks * block_size,
                kv_exact=kv_exact, all_free=gpu_all_free and cpu_all_free)


WORKLOAD_FAMILIES = ("chat", "tree", "rag", "recency", "rotation")


def workload_prompts(family: str, seed: int = 0, block_size: int = 4) -> list[list[int]]:
    """A family's request stream, in arrival order; a segment is n blocks and a partial one.
    chat: 4 users round-robin, 4 turns each, a shared 6-block system prompt; a turn extends the
    user's last prompt by a response and a new message. tree: a shared 8-block few-shot prefix,
    then a binary tree of thoughts 3 deep, expanded breadth first. rag: a 2-block system prompt,
    one of 6 documents of 8 blocks (Zipf-popular), a question. recency: 70% of the requests
    extend one of the last 3 prompts, the rest start afresh. rotation: 3 prompts, 4 rounds."""
    rng = random.Random(seed)

    def segment(num_blocks: int) -> list[int]:
        num_tokens = num_blocks * block_size + rng.randrange(block_size)
        return [rng.randrange(ToyModel.VOCAB_SIZE) for _ in range(num_tokens)]

    prompts: list[list[int]] = []
    if family == "chat":
        histories = [segment(6)] * 4
        for _turn, user in itertools.product(range(4), range(4)):
            prompts.append(histories[user] + segment(2))
            histories[user] = prompts[-1] + segment(2)
    elif family == "tree":
        frontier = [segment(8)]
        for _depth in range(3):
            frontier = [node + segment(2) for node in frontier for _branch in range(2)]
            prompts.extend(frontier)
    elif family == "rag":
        system = segment(2)
        documents = [segment(8) for _ in range(6)]
        zipf_weights = [1 / (rank + 1) for rank in range(6)]
        for _ in range(20):
            document = rng.choices(documents, zipf_weights)[0]
            prompts.append(system + document + segment(1))
    elif family == "recency":
        for _ in range(20):
            if prompts and rng.random() < 0.7:
                prompts.append(rng.choice(prompts[-3:]) + segment(1))
            else:
                prompts.append(segment(6))
    elif family == "rotation":
        prompts = [segment(12) for _ in range(3)] * 4
    else:
        raise ValueError(f"family {family!r}: one of {WORKLOAD_FAMILIES}")
    return prompts


def run_workload(prompts: list[list[int]], num_cpu_blocks: int, scheduler_cls: type,
                 concurrency: int = 1, block_size: int = 4) -> dict:
    """The prompts in batches of `concurrency` (all of a batch admitted in one step), the GPU
    prefix cache dropped before each batch: tokens each request loaded from CPU, and checks."""
    max_blocks = max(len(p) for p in prompts) // block_size + 2
    num_gpu_blocks = concurrency * max_blocks + 1
    # small: the manager is measured
    model = ToyModel(num_layers=1, num_kv_heads=1, head_dim=4)
    connector = scheduler_cls(num_cpu_blocks, block_size)
    engine = MiniEngine(num_gpu_blocks, block_size, num_gpu_blocks * block_size, model, connector,
                        SimpleCPUOffloadWorker(num_cpu_blocks), capture_kv=True)
    loaded: list[int] = []
    kv_exact = True
    for first in range(0, len(prompts), concurrency):
        assert engine.reset_gpu_prefix_cache(), "GPU blocks still in use after run()"
        batch = {f"r{first + j}": p for j, p in enumerate(prompts[first:first + concurrency])}
        for req_id, prompt in batch.items():
            engine.add_request(Request(req_id, prompt, block_size))
        stats = engine.run()
        for req_id, prompt in batch.items():
            loaded.append(stats[req_id].cpu_hit_tokens)
            kv_exact = kv_exact and torch.equal(stats[req_id].kv, model.expected_kv(prompt))
    cpu_all_free = connector.cpu_block_pool.get_num_free_blocks() == num_cpu_blocks - 1
    return dict(loaded=loaded, kv_exact=kv_exact, all_free=cpu_all_free)


def _max_weight_intervals(num_points: int, intervals: Counter, capacity: int) -> int:
    """The largest total weight of intervals [s, t) that cover no point more than `capacity`
    times: a min-cost flow of `capacity` units from point 0 to the last along a line, each
    interval a shortcut of cost -w (a unit of flow is one cache slot over time). Successive
    shortest paths (Bellman-Ford: the costs are negative); a few dozen points: fast."""
    # graph[u]: edges [to, residual capacity, cost, index of the reverse edge in graph[to]]
    graph: list[list[list[int]]] = [[] for _ in range(num_points)]
    line = [(p, p + 1, capacity, 0) for p in range(num_points - 1)]
    shortcuts = [(s, t, n, -w) for (s, t, w), n in intervals.items()]
    for u, v, cap, cost in line + shortcuts:
        graph[u].append([v, cap, cost, len(graph[v])])
        graph[v].append([u, 0, -cost, len(graph[u]) - 1])
    total = 0
    flow = 0
    sink = num_points - 1
    while flow < capacity:
        dist = [0] + [math.inf] * sink
        via: list[tuple[int, int] | None] = [None] * num_points
        changed = True
        while changed:
            changed = False
            for u in range(num_points):
                for i, (v, cap, cost, _) in enumerate(graph[u]):
                    if cap and dist[u] + cost < dist[v]:
                        dist[v] = dist[u] + cost
                        via[v] = (u, i)
                        changed = True
        if dist[sink] >= 0:  # no interval left that pays: the rest of the flow takes the line
            break
        path = []
        v = sink
        while v:
            u, i = via[v]
            path.append(graph[u][i])
            v = u
        push = min([capacity - flow] + [edge[1] for edge in path])
        for edge in path:
            edge[1] -= push
            graph[edge[0]][edge[3]][1] += push
        flow += push
        total -= push * dist[sink]
    return total


def workload_optimum(prompts: list[list[int]], num_cpu_blocks: int, concurrency: int = 1,
                     block_size: int = 4) -> tuple[int, int]:
    """(the offline optimum, the reusable tokens): the most tokens any CPU policy can load over
    the stream run as run_workload runs it, and what an unbounded pool loads.
    Why it bounds every online policy: the lookups of batch t see the CPU cache S(t-1) left by
    the batches before; S(t) holds at most num_cpu_blocks - 1 blocks, each kept from S(t-1) or
    stored by batch t, so a block batch t loads was in the cache without a break since the last
    batch s < t that could store it. A loaded block is thus one interval [s, t) of one slot,
    worth the requests of t that load it (at most those whose hit cap covers it); no point of
    time is covered more often than the pool has slots. Dropping the rule that a hit is a
    prefix (a lookup stops at its first miss) only adds choices: the interval optimum is an
    upper bound. It is reached when requests run one at a time: a block's parent is wanted
    whenever the block is, so the intervals chosen can keep every kept block's parent too
    (tests check it against brute force on small streams)."""
    hashes = [Request("", p, block_size).block_hashes for p in prompts]
    last_stored: dict[bytes, int] = {}
    intervals: Counter = Counter()
    num_batches = cdiv(len(prompts), concurrency)
    for batch in range(num_batches):
        members = range(batch * concurrency, min(len(prompts), (batch + 1) * concurrency))
        hits: Counter = Counter()
        for i in members:
            hits.update(hashes[i][:(len(prompts[i]) - 1) // block_size])
        for key, weight in hits.items():
            if key in last_stored:
                intervals[(last_stored[key], batch, weight)] += 1
        for i in members:
            last_stored.update(dict.fromkeys(hashes[i], batch))
    reusable = sum(w * n for (_s, _t, w), n in intervals.items())
    optimum = _max_weight_intervals(num_batches, intervals, num_cpu_blocks - 1)
    return optimum * block_size, reusable * block_size


def workload_pool_sizes(prompts: list[list[int]], block_size: int = 4) -> list[int]:
    """CPU pools (num_cpu_blocks, the null block counted) from half a prompt to the working set
    (every distinct block the stream stores): half and all of the longest prompt, 1/4, 1/2, 3/4
    and all of the working set."""
    max_blocks = max(len(p) for p in prompts) // block_size
    working_set = {h for p in prompts for h in Request("", p, block_size).block_hashes}
    ws = len(working_set)
    usable = [max_blocks // 2, max_blocks, ws // 4, ws // 2, ws * 3 // 4, ws]
    return sorted({n + 1 for n in usable})


def workload_table(families: Sequence[str] = WORKLOAD_FAMILIES,
                   concurrencies: Sequence[int] = (1, 4)) -> list[dict]:
    """Per family, batch size and pool: tokens loaded from CPU per request under vLLM's LRU (the
    fixed class), the prefix-aware policy and the offline optimum, and what an unbounded pool
    loads (the reusable tokens); printed as measured and returned. Goal: the policy never below
    LRU and at least 90% of the optimum (KV exact and every pool free, asserted)."""
    print(f"{'family':9}{'batch':>6}{'pool':>6}{'LRU':>8}{'policy':>8}{'optimum':>9}"
          f"{'reusable':>10}  tokens loaded from CPU per request; policy / optimum", flush=True)
    rows = []
    for family, concurrency in itertools.product(families, concurrencies):
        prompts = workload_prompts(family)
        for num_cpu_blocks in workload_pool_sizes(prompts):
            row: dict[str, Any] = dict(family=family, concurrency=concurrency,
                                       num_cpu_blocks=num_cpu_blocks)
            for name, cls in (("lru", SimpleCPUOffloadScheduler),
                              ("policy", PrefixAwareCPUOffloadScheduler)):
                run = run_workload(prompts, num_cpu_blocks, cls, concurrency)
                assert run["kv_exact"] and run["all_free"], (family, num_cpu_blocks, name)
                row[name] = sum(run["loaded"]) / len(prompts)
            optimum, reusable = workload_optimum(prompts, num_cpu_blocks, concurrency)
            row["optimum"] = optimum / len(prompts)
            row["reusable"] = reusable / len(prompts)
            row["goal"] = row["policy"] >= row["lru"] and row["policy"] >= 0.9 * row["optimum"]
            share = row["policy"] / row["optimum"] if optimum else 1.0
            verdict = "goal met" if row["goal"] else "gap"
            print(f"{family:9}{concurrency:>6}{num_cpu_blocks:>6}{row['lru']:>8.1f}"
                  f"{row['policy']:>8.1f}{row['optimum']:>9.1f}{row['reusable']:>10.1f}"
                  f"  {share:.1%} {verdict}", flush=True)
            rows.append(row)
    return rows


def offload_prompt(scheduler: SimpleCPUOffloadScheduler, prompt: list[int], block_size: int,
                   partial_at: int | None = None) -> SimpleCPUOffloadMetadata:
    """One prompt's full blocks stored through an unbound one-worker `scheduler` in vLLM's call
    order, no model or worker (`partial_at`: a GPU secondary key too); the step's metadata."""
    if scheduler._gpu_block_pool is not None or scheduler.world_size != 1:
        raise ValueError("scheduler: it serves another engine or more than one worker")
    # blocks of another size would be registered under the wrong keys
    if block_size != scheduler.block_size:
        raise ValueError(f"block_size {block_size}: the scheduler's is {scheduler.block_size}")
    request = Request("A", prompt, scheduler.hash_block_size)
    num_full_blocks = len(prompt) // block_size
    gpu = BlockPool(num_full_blocks + 2, True, scheduler.hash_block_size)
    scheduler.bind_gpu_block_pool(gpu)
    blocks = gpu.get_new_blocks(num_full_blocks)
    gpu.cache_full_blocks(request, blocks, 0, num_full_blocks, block_size, 0)
    if partial_at is not None:
        gpu.cache_partial_block(request, blocks[partial_at // block_size], partial_at, 0)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, (blocks,), 0)
    # the prefill ran: every full block is confirmed
    request.num_computed_tokens = len(prompt)
    block_ids = ([b.block_id for b in blocks],)
    meta = scheduler.build_connector_meta(SchedulerOutput({"A": 1}, {"A": block_ids}))
    scheduler.request_finished_all_groups(request, block_ids)
    flush = scheduler.build_connector_meta(SchedulerOutput())
    done = {e: 1 for e in (meta.store_event, flush.store_event) if e >= 0}
    scheduler.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(done)))
    gpu.free_blocks(reversed(blocks))
    return meta


HEADLINE_CLASSES = {"vLLM 0.29": PreFixCPUOffloadScheduler, "the fix": SimpleCPUOffloadScheduler,
                    "prefix-aware (not in vLLM)": PrefixAwareCPUOffloadScheduler}


def headline(prompt_tokens: int = 8192) -> dict[str, dict[str, tuple[float, int]]]:
    """The demo's table, printed and returned: {config: {version: (MiB stored, tokens loaded)}}."""
    # the chunked row needs more than one 1,024-token step
    if not 1025 <= prompt_tokens <= MAX_STORY_TOKENS:
        raise ValueError(f"prompt_tokens ({prompt_tokens}): from 1,025 to {MAX_STORY_TOKENS:,}")
    print("B repeats A's prompt after A ran and the GPU prefix cache was dropped (block 16,\n"
          "1,024 tokens a step). Per version: MiB stored to CPU / tokens B loaded from CPU, what\n"
          "vLLM's kv_offload_store_bytes_total / external_prefix_cache_hits_total count ...",
          flush=True)
    n = prompt_tokens // 16
    configs = {"one-step prompt (1,000 tokens)": dict(prompt_tokens=1000),
               f"chunked prompt ({prompt_tokens:,} tokens)": dict(prompt_tokens=prompt_tokens),
               f"CPU pool ({n * 7 // 8} blocks) < prompt ({n} blocks)":
                   dict(prompt_tokens=prompt_tokens, num_cpu_blocks=n * 7 // 8)}
    rows: dict[str, dict[str, tuple[float, int]]] = {name: {} for name in configs}
    for name, kwargs in configs.items():
        for version, cls in HEADLINE_CLASSES.items():
            if cls is not PrefixAwareCPUOffloadScheduler or "pool" in name:
                r = run_story(cls, **kwargs)
                assert r["kv_exact"] and r["all_free"]
                rows[name][version] = (r["stored_bytes"] / 2**20, r["cpu_hit_tokens"])
        print(f"  {name}: done", flush=True)
    print(f"\n{'configuration':43}" + "".join(f"{v:>28}" for v in HEADLINE_CLASSES))
    for name, cells in rows.items():
        print(f"{name:43}" + "".join(f"{s:.1f} / {h:,}".rjust(28) for s, h in cells.values()))
    return rows


def story_load_ids() -> tuple[list[int], list[int]]:
    """The demo's story load (8192 tokens, block 16: 511 blocks) as the worker receives it:
    (GPU ids, CPU ids). B's GPU table is the free queue after A: 513-575, 384 down to 1,
    385-448 (test_copy_calls_per_block_of_the_story derives it and checks it on the real run);
    its CPU sources are blocks 1-511: 386 runs, 384 of them single blocks."""
    gpu_ids = [*range(513, 576), *range(384, 0, -1), *range(385, 449)]
    return gpu_ids, list(range(1, 512))


# cuMemcpyBatchAsync's srcAccessOrder, as vLLM 0.34's cuda_mem_ops.py passes it: a store reads
# the live KV cache in stream order (STREAM), a load reads stable pinned memory (ANY)
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 1, 3


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _CUmemLocation),
                ("dstLocHint", _CUmemLocation), ("flags", ctypes.c_uint)]


def _cu_memcpy_batch_async() -> Any:
    """vLLM 0.34's batched DMA entry point for the bench: cuMemcpyBatchAsync with CUDA 12.8's
    signature (the one with failIdx), from the driver torch loaded, through ctypes. Raises
    where the driver lacks it."""
    libcuda = ctypes.CDLL("libcuda.so.1")
    get_proc = libcuda.cuGetProcAddress_v2
    get_proc.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                         ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
    fn = ctypes.c_void_p()
    found = ctypes.c_int()
    err = get_proc(b"cuMemcpyBatchAsync", ctypes.byref(fn), 12080, 0, ctypes.byref(found))
    if err != 0 or not fn.value:
        raise RuntimeError(f"cuGetProcAddress(cuMemcpyBatchAsync): error {err}")
    pointers = [ctypes.c_void_p] * 3
    prototype = ctypes.CFUNCTYPE(ctypes.c_uint, *pointers, ctypes.c_size_t, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                 ctypes.c_void_p)
    return prototype(fn.value)


def _batched_dma(fn: Any, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor],
                 src_ids: list[int], dst_ids: list[int], is_store: bool, stream: Any) -> None:
    """One launch as vLLM 0.34's copy_blocks issues it: one cuMemcpyBatchAsync call, one
    descriptor per (region, block), address = base + block id * bytes per block."""
    block_bytes = np.array([t[0].nbytes for t in src.values()], dtype=np.uint64)
    src_bases = np.array([t.data_ptr() for t in src.values()], dtype=np.uint64)
    dst_bases = np.array([dst[name].data_ptr() for name in src], dtype=np.uint64)
    src_all = (src_bases[:, None] + np.array(src_ids, dtype=np.uint64) * block_bytes[:, None])
    dst_all = (dst_bases[:, None] + np.array(dst_ids, dtype=np.uint64) * block_bytes[:, None])
    sizes = np.repeat(block_bytes, len(src_ids))
    order = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM if is_store else CU_MEMCPY_SRC_ACCESS_ORDER_ANY
    attrs = _CUmemcpyAttributes(srcAccessOrder=order)
    attrs_idx = ctypes.c_size_t(0)
    fail_idx = ctypes.c_size_t(0)
    dsts = dst_all.ravel()
    srcs = src_all.ravel()
    err = fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, len(sizes),
             ctypes.addressof(attrs), ctypes.byref(attrs_idx), 1, ctypes.byref(fail_idx),
             stream.cuda_stream)
    if err != 0:
        raise RuntimeError(f"cuMemcpyBatchAsync: error {err} at descriptor {fail_idx.value}")


def _bench_cases(block_kib: int, num_blocks: int, n_copy: int, num_layers: int,
                 cases: str) -> Iterator[tuple[str, str, dict[str, torch.Tensor], int, list[int],
                                                list[int], tuple[str, ...]]]:
    """(layout, ids, caches on CPU, block_dim, gpu ids, cpu ids, directions) of each case:
    "layouts": per-layer and cross-layer caches, contiguous and scattered ids (random, never the
    null block 0), both directions; "scattered": per-layer, scattered only; "story": the demo's
    story load (4 layers of (2, 576, 16, 4, 64) float16: 8 regions of 8 KiB rows)."""
    if cases == "story":
        story = {f"l{i}": torch.zeros(2, 576, 16, 4, 64, dtype=torch.float16) for i in range(4)}
        yield "story (2,N,..) x4", "story", story, 1, *story_load_ids(), ("load",)
        return
    gen = torch.Generator().manual_seed(0)
    elems = block_kib * 1024 // 2  # float16 elements per block (per layer: K and V together)
    per_layer = {f"l{i}": torch.zeros(2, num_blocks, elems // 2, dtype=torch.float16)
                 for i in range(num_layers)}
    cross_layer = {"all": torch.zeros(num_blocks, num_layers, elems, dtype=torch.float16)}
    layouts = {f"per-layer (2,N,..) x{num_layers}": per_layer, "cross-layer [N,...]": cross_layer}
    for layout, caches in layouts.items():
        if cases == "scattered" and caches is cross_layer:
            continue
        for ids in ("contiguous", "scattered"):
            gpu_ids = list(range(1, n_copy + 1))  # one run: one slice copy per region
            cpu_ids = list(range(1, n_copy + 1))
            if ids == "scattered":
                gpu_ids = (torch.randperm(num_blocks - 1, generator=gen)[:n_copy] + 1).tolist()
                cpu_ids = (torch.randperm(num_blocks - 1, generator=gen)[:n_copy] + 1).tolist()
            if ids == "scattered" or cases == "layouts":
                yield layout, ids, caches, int(caches is per_layer), gpu_ids, cpu_ids, (
                    "store", "load")


def bench_copies(device: str, block_kib: int = 32, num_blocks: int = 1024, n_copy: int = 512,
                 reps: int = 5, num_layers: int = 8, cases: str = "layouts") -> Iterator[dict]:
    """Rows as measured (cases: see _bench_cases). Per row, GB/s of: the worker on its copy_
    path, on its gather/scatter path, vLLM 0.34's batched DMA (one cuMemcpyBatchAsync per
    launch; CUDA only, else None with the reason in dma_note), and one copy_ of the same bytes
    (CUDA: to or from pinned memory). Each is the median of `reps` interleaved rounds (one
    more warms up); `worker_gbps` is the path the rule picks (`rule`), `ratio` = worker_gbps /
    plain_gbps, `issue_us` the host µs to issue the worker's launch on the rule's path."""
    dma_fn, dma_note = None, "CUDA only"
    if device == "cuda":
        try:
            dma_fn, dma_note = _cu_memcpy_batch_async(), ""
        except (OSError, AttributeError, RuntimeError) as e:
            dma_note = f"unavailable: {e}"

    def timed(fn, stream=None) -> tuple[float, float]:  # (copies' seconds, host seconds)
        if device == "cuda":
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
        host_start = time.perf_counter()
        fn()
        host_s = time.perf_counter() - host_start
        if device != "cuda":
            return host_s, host_s
        if stream is not None:  # the copy stream: the end waits for it
            torch.cuda.current_stream().wait_stream(stream)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, host_s

    event = 0  # the worker's events must grow
    for layout, ids, cpu_caches, block_dim, gpu_ids, cpu_ids, directions in _bench_cases(
            block_kib, num_blocks, n_copy, num_layers, cases):
        caches = {name: t.to(device) for name, t in cpu_caches.items()}
        w = SimpleCPUOffloadWorker(max(cpu_ids) + 1)
        w.register_kv_caches(caches, next(iter(caches.values())).shape[block_dim], block_dim)
        nbytes = sum(r[0].nbytes for r in w.gpu_kv_caches.values()) * len(gpu_ids)
        dev_buf = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        host_buf = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
        runs = _coalesce_runs(gpu_ids, cpu_ids)
        row_bytes = sum(t[0].nbytes for t in w.cpu_kv_caches.values())
        per_call = len(gpu_ids) * row_bytes / (len(runs) * len(w.cpu_kv_caches))
        rule = "copy_" if per_call >= _GATHER_BELOW_BYTES else "gather"
        for direction in directions:
            is_store = direction == "store"
            stream = w.store_stream if is_store else w.load_stream
            src, dst = (dev_buf, host_buf) if is_store else (host_buf, dev_buf)
            regions = (w.gpu_kv_caches, w.cpu_kv_caches)
            src_ids, dst_ids = (gpu_ids, cpu_ids) if is_store else (cpu_ids, gpu_ids)

            def worker_copy(path: str) -> None:
                nonlocal event
                event += 1
                w.bind_connector_metadata(SimpleCPUOffloadMetadata(**{
                    f"{direction}_event": event, f"{direction}_gpu_blocks": gpu_ids,
                    f"{direction}_cpu_blocks": cpu_ids}))
                w._backend.gather_below_bytes = 0 if path == "copy_" else math.inf
                (w.wait_for_save if is_store else w.start_load_kv)()
                w.clear_connector_metadata()

            copies = {"copy_": (lambda: worker_copy("copy_"), stream),
                      "gather": (lambda: worker_copy("gather"), stream),
                      "plain": (lambda: dst.copy_(src, non_blocking=True), None)}
            if dma_fn is not None:
                pair = regions if is_store else regions[::-1]
                copies["dma"] = (lambda: _batched_dma(dma_fn, *pair, src_ids, dst_ids, is_store,
                                                      stream), stream)
            rounds = [{name: timed(fn, s) for name, (fn, s) in copies.items()}
                      for _ in range(reps + 1)][1:]  # interleaved; the first warms up
            w.handle_preemptions(SimpleCPUOffloadMetadata(need_flush=True))  # wait, forget
            gbps = {name: nbytes / sorted(r[name][0] for r in rounds)[reps // 2] / 1e9
                    for name in copies}
            issue_s = sorted(r[rule][1] for r in rounds)[reps // 2]
            yield dict(device=device, layout=layout, ids=ids, direction=direction,
                       block_kib=block_kib if ids != "story" else 16, rule=rule,
                       copy_gbps=gbps["copy_"], gather_gbps=gbps["gather"],
                       dma_gbps=gbps.get("dma"), dma_note=dma_note, plain_gbps=gbps["plain"],
                       worker_gbps=gbps[rule], ratio=gbps[rule] / gbps["plain"],
                       issue_us=issue_s * 1e6)


GOAL_RATIO = 0.8  # --gpu-check's goal for the worker's rows: printed, not in the exit status
GPU_CHECK_SEED, GPU_CHECK_LIMIT_S = 20261204, 360  # its CUDA fuzz's seed, its time limit


def _print_copy_rows(device: str) -> list[str]:
    """The story's load and per-layer scattered ids at 32 and 256 KiB blocks, four ways each;
    returns the rows whose worker ratio (the rule's path) misses GOAL_RATIO on CUDA."""
    print(f"{'device':7}{'case':26}{'dir':6}{'KiB/blk':>8}{'copy_':>13}{'gather':>13}"
          f"{'batched DMA':>13}{'one copy':>9}{'rule':>7}{'issue µs':>10}", flush=True)
    missed = []
    dma_note = ""
    rows = itertools.chain(bench_copies(device, cases="story"),
                           bench_copies(device, cases="scattered"),
                           bench_copies(device, 256, 256, 128, cases="scattered"))
    for r in rows:
        cells = []
        for key in ("copy_gbps", "gather_gbps", "dma_gbps"):
            value = r[key]
            cell = f"{value:.1f} ({value / r['plain_gbps']:.2f})" if value else "n/a"
            cells.append(f"{cell:>13}")
        if device == "cuda" and r["ratio"] < GOAL_RATIO:
            missed.append(f"{r['layout']} {r['ids']} {r['direction']} {r['ratio']:.2f}")
        case = f"{r['layout'].split()[0]} {r['ids']}"
        print(f"{r['device']:7}{case:26}{r['direction']:6}{r['block_kib']:>8}{''.join(cells)}"
              f"{r['plain_gbps']:>9.1f}{r['rule']:>7}{r['issue_us']:>10.0f}", flush=True)
        dma_note = r["dma_note"]
    if dma_note:
        print(f"batched DMA: n/a here ({dma_note})")
    return missed


def gpu_check(fuzz_examples: int = 200, limit_s: float = GPU_CHECK_LIMIT_S) -> int:
    """The CUDA tests, a seeded fuzz, the CUDA bench, a verdict: non-zero on failure or no GPU."""
    start = time.perf_counter()
    if not torch.cuda.is_available():
        print("GPU CHECK: FAIL (torch sees no CUDA device: nothing was checked)")
        return 2
    seed = int(os.environ.get("KV_OFFLOAD_FUZZ_SEED") or GPU_CHECK_SEED)
    print(f"--gpu-check: {torch.cuda.get_device_name()}, torch {torch.__version__}, fuzz seed "
          f"{seed}, {fuzz_examples} schedules, limit {limit_s:.0f} s", flush=True)
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_kv_offload.py")
    # a CUDA case fails instead of skipping
    env = dict(os.environ, KV_OFFLOAD_REQUIRE_CUDA="1",
               KV_OFFLOAD_FUZZ_SEED=str(seed), KV_OFFLOAD_FUZZ_EXAMPLES=str(fuzz_examples))
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda", tests]
    failures = []
    try:  # the bench takes under a minute: the tests get the rest
        if subprocess.run(argv, env=env, timeout=limit_s - 60).returncode != 0:
            failures.append("a CUDA test failed")
    except subprocess.TimeoutExpired:
        failures.append(f"the CUDA tests ran past {limit_s - 60:.0f} s")
    print(f"\nCUDA copies (goal: the worker's rows at >= {GOAL_RATIO} of one pinned copy) ...")
    missed = _print_copy_rows("cuda")
    print("bandwidth goal: met" if not missed else f"bandwidth goal missed: {'; '.join(missed)}")
    if time.perf_counter() - start > limit_s:
        failures.append(f"past the {limit_s:.0f} s limit")
    print("GPU CHECK: PASS" if not failures else f"GPU CHECK: FAIL ({'; '.join(failures)})")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)  # defined before `import torch`, at the top
    if args.gpu_check:
        raise SystemExit(gpu_check())
    if args.bench:
        print(f"{torch.get_num_threads()} torch threads. GB/s of the worker on its copy_ path,"
              " on its gather/scatter path, of vLLM's batched DMA (one cuMemcpyBatchAsync a\n"
              "launch) and of one copy_ of the same bytes (pinned on CUDA), each the median of 5"
              " interleaved rounds;\n(x.xx) = that GB/s / one copy's. rule = the path the worker"
              " takes; issue µs = host time to issue\nits launch on that path ...", flush=True)
        for device in ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]:
            _print_copy_rows(device)
        return
    torch.set_num_threads(1)  # torch's default (one per core) slows the toy model 10-50x
    headline(args.prompt_tokens)
    print("\nBug 2 (no final flush) loses the blocks of a request's last forward pass; bug 1 (the\n"
          "registration) costs only lookups that end inside a block. Why: walkthrough.ipynb.")


if __name__ == "__main__":
    main()
