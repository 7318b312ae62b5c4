"""Content keys of KV blocks for prefix caching: a hash chain, so that equal keys mean equal
prompts up to the end of the block.

Two sources, one kind of key (``KvBlockAllocator`` only compares them):

- Token ids (the engine): the key of block j hashes (key of block j-1, the block's token ids).
  Python's hash of a tuple of ints is 64 bits and the same in every process; two different
  prefixes share a key with probability ~n^2 / 2^64 for n blocks cached (vLLM's default hash
  makes the same trade).
- A trace's block ids (the simulator, which has no tokens): Mooncake-format traces give
  ``hash_ids``, one id per block of ``trace_block_tokens`` (512) prompt tokens, equal ids meaning
  a reusable prefix block. KV blocks are ``kv_block_tokens`` long (16 by default), so several KV
  blocks map to one trace block. KV block j (tokens ``[j*B, (j+1)*B)``) gets the key of the
  trace block holding its last token, t = ((j+1)*B - 1) // 512, and its own index j: the pair
  stands for the prompt's tokens up to the end of block j, because trace block t's chain covers
  every trace block before it. The chain is built here from the ids in order (trace block t's
  chain = (chain of t-1, id t), interned as a small integer), so equal keys need equal ids for
  every earlier block even if a trace's ids were not chained themselves. A KV block that
  straddles two trace blocks is keyed by the later one, which also covers the earlier. Only KV
  blocks that lie wholly within the prompt and within the trace's ids get a key; the rest of a
  prompt is never shared. The pair (chain t, j) is numbered densely from 0 (chain number x
  KV blocks per trace block + j's place among the KV blocks ending in trace block t), so that
  the allocator keeps trace keys in an array indexed by key (``pagedweight.core.key_map``).
- A trace without ``hash_ids`` says nothing about shared prefixes, so requests share nothing:
  each request's blocks get keys of their own (``own_block_keys``), negative so that they never
  equal a trace key. They matter only to the request itself: preempted by recompute, it finds
  its prompt blocks again if they were not evicted meanwhile, as it would in a real engine (whose
  token keys find them too).

Private blocks: keys no other request has. Nothing else can hit them, so the scheduler
registers them only at the request's first preemption, and a request never preempted retires
them unkeyed (``Request.private_from``, ``KvBlockAllocator.retire``): the cache's contents and
order are the same, the keys' upkeep is saved. Own keys are private from block 0. A trace's keys
are private from the first trace block that no other request of the trace holds
(``TraceBlockKeys.private_from``): since keys are chained, every later block of that request is
unshared too. In the Mooncake trace that is ~46% of the KV blocks of its first 2,000 requests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids: one id per 512 prompt tokens
_INDEX_BITS = 24  # a KV block's index within its prompt: up to 16M blocks


def token_block_keys(token_ids: Sequence[int], block_tokens: int) -> list[int]:
    """Keys of the full ``block_tokens``-token blocks of ``token_ids``."""
    keys: list[int] = []
    prev = -1
    for start in range(0, len(token_ids) - block_tokens + 1, block_tokens):
        prev = hash((prev, tuple(token_ids[start : start + block_tokens])))
        keys.append(prev)
    return keys


class TraceBlockKeys:
    """The KV block keys of every request of a trace with per-request block ids."""

    def __init__(self, hash_ids: Sequence[Sequence[int]], trace_block_tokens: int = TRACE_BLOCK_TOKENS):
        self.trace_block_tokens = trace_block_tokens
        interned: dict[tuple[int, int], int] = {}
        self._chains: list[np.ndarray] = []
        for ids in hash_ids:
            chain = np.empty(len(ids), dtype=np.int64)
            prev = -1
            for t, block_id in enumerate(ids):
                prev = interned.setdefault((prev, int(block_id)), len(interned))
                chain[t] = prev
            self._chains.append(chain)
        # Requests holding each chain node (a request holds a node at most once: the chain of
        # trace block t has t links).
        chains = [c for c in self._chains if len(c)]
        self._holders = np.bincount(np.concatenate(chains), minlength=len(interned)) if chains else np.zeros(0, int)

    def keys(self, request: int, prompt_tokens: int, kv_block_tokens: int) -> np.ndarray:
        """Keys of request ``request``'s full KV blocks, as far as its trace blocks reach: an
        int64 array of small non-negative numbers."""
        chain = self._chains[request]
        covered = min(prompt_tokens, len(chain) * self.trace_block_tokens)
        n = covered // kv_block_tokens
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        # Numbered densely: chain node c's KV blocks are j0(t) .. j0(t) + per_node - 1 with
        # j0(t) = t * 512 // B, key c * per_node + (j - j0(t)); a node stands at one depth t, so
        # keys are distinct, and they stay small (the allocator keeps them in an array).
        trace_tokens = self.trace_block_tokens
        per_node = -(-trace_tokens // kv_block_tokens)
        j = np.arange(n, dtype=np.int64)
        t = ((j + 1) * kv_block_tokens - 1) // trace_tokens
        return chain[t] * per_node + (j - t * trace_tokens // kv_block_tokens)

    def private_from(self, request: int, prompt_tokens: int, kv_block_tokens: int) -> int:
        """The first of ``keys(...)`` that no other request of the trace has (their number if
        every one is shared): the first KV block ending in a trace block only this request
        holds. Holders fall along a chain, so every later key is unshared too."""
        chain = self._chains[request]
        num_keys = min(prompt_tokens, len(chain) * self.trace_block_tokens) // kv_block_tokens
        alone = np.flatnonzero(self._holders[chain] < 2)
        if len(alone) == 0:
            return num_keys
        t = int(alone[0])  # KV block j ends in trace block ((j + 1) * B - 1) // 512; the first j there:
        return min(num_keys, -(-(t * self.trace_block_tokens + 1) // kv_block_tokens) - 1)


def own_block_keys(request: int, prompt_tokens: int, kv_block_tokens: int) -> range:
    """Keys of request ``request``'s full prompt blocks that no other request has."""
    base = -((request + 1) << _INDEX_BITS)
    return range(base, base - prompt_tokens // kv_block_tokens, -1)
