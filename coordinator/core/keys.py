"""Namespaces and chained content keys (I8, I9).

    namespace_id = blake3(NAMESPACE_DOMAIN || canonical(spec))[:16]
    key          = blake3(keyed by KEY_SEED_DIGEST;
                          msgpack([namespace_id, parent_key or b"", token_ids, extra_keys]))[:16]

`canonical(spec)` is the msgpack map of the spec's fields, sorted by name, leaving out fields
equal to their default: adding a field with a default later keeps every existing namespace_id.
A parallelism-agnostic spec leaves out its parallel layout too (PARALLEL_LAYOUT).
The seed is a fixed constant so keys agree across processes and machines (unlike Python's
salted `hash()`, see PYTHONHASHSEED in seed 004's reproduction). 128-bit keys: a collision needs
~2^64 blocks, and keys of different namespaces never meet because the namespace roots the chain.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import blake3
import msgspec

from events import NamespaceSpec, PoolKind

KEY_BYTES = 16
NAMESPACE_DOMAIN = b"kvledger/namespace/v1\x00"
KEY_SEED = b"kvledger/content-key/v1"
KEY_SEED_DIGEST = blake3.blake3(KEY_SEED).digest()  # 32 bytes: blake3's keyed mode
"""The fixed chain seed, documented here and in README; changing it is a new hash_algorithm."""

_encoder = msgspec.msgpack.Encoder(order="sorted")
_PREFIX_KINDS: frozenset[str] = frozenset({"attention", "sliding_window", "state"})


PARALLEL_LAYOUT = frozenset({"tensor_parallel_size", "pipeline_parallel_size", "kv_rank_layout"})
"""The fields of a namespace that say how its blocks are split across ranks: in its id unless it
is `parallelism_agnostic` (its flag is in the id then, so it never meets a layout-bound one)."""
MAX_WORLD_SIZE = 1 << 12
"""The most ranks one engine may have (tensor x pipeline parallel size): far beyond any model
served today (8-64 devices). Unbounded, a declaration of 2**40 ranks made the decider list every
rank of a job it fenced, on the event loop (the sidecar stopped answering anyone), and a rank past
2**63 stopped the audit index's every catch-up (an adversarial review, session 31)."""


def canonical_namespace(spec: NamespaceSpec) -> bytes:
    """The canonical encoding the namespace digest is taken over."""
    fields = {}
    for field in msgspec.structs.fields(spec):
        value = getattr(spec, field.name)
        if field.default is not msgspec.NODEFAULT and value == field.default:
            continue
        if spec.parallelism_agnostic and field.name in PARALLEL_LAYOUT:
            continue
        fields[field.name] = value
    return _encoder.encode(fields)


def namespace_id(spec: NamespaceSpec) -> bytes:
    return blake3.blake3(NAMESPACE_DOMAIN + canonical_namespace(spec)).digest(KEY_BYTES)


def namespace_problems(spec: NamespaceSpec) -> list[str]:
    """What makes a namespace unusable; empty when it is fine."""
    problems = []
    for name in ("model_id", "weights_revision", "tokenizer_digest", "kv_dtype", "tenant"):
        if not getattr(spec, name):
            problems.append(f"{name} is empty")
    if not spec.block_sizes or any(size <= 0 for size in spec.block_sizes):
        problems.append("block_sizes must be positive")
    if spec.tensor_parallel_size <= 0 or spec.pipeline_parallel_size <= 0:
        problems.append("parallel sizes must be positive")
    elif spec.tensor_parallel_size * spec.pipeline_parallel_size > MAX_WORLD_SIZE:
        problems.append(
            f"tensor x pipeline parallel size is {spec.tensor_parallel_size * spec.pipeline_parallel_size:,}, "
            f"at most {MAX_WORLD_SIZE:,} ranks"
        )
    if spec.adapter_revision and not spec.adapter_id:
        problems.append("adapter_revision without adapter_id")
    return problems


def content_key(namespace: bytes, parent_key: bytes | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> bytes:
    """The key of one full block: its namespace, its parent block's key, its tokens, extras."""
    payload = _encoder.encode((namespace, parent_key or b"", list(token_ids), list(extra_keys)))
    return blake3.blake3(payload, key=KEY_SEED_DIGEST).digest(KEY_BYTES)


def chain_keys(
    namespace: bytes,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str] = (),
    parent_key: bytes | None = None,
) -> list[bytes]:
    """Keys of every full block of `token_ids` at `block_size`; a partial tail has no key."""
    return list(iter_chain_keys(namespace, token_ids, block_size, extra_keys, parent_key))


def iter_chain_keys(
    namespace: bytes,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str] = (),
    parent_key: bytes | None = None,
) -> Iterator[bytes]:
    """`chain_keys`, one key at a time: a reader that stops at its first miss hashes no further.
    content_key, inlined: a 262,144-token lookup hashes 16,384 blocks (each key as content_key makes it)."""
    parent = parent_key or b""
    extras = list(extra_keys)
    encode, hasher, seed = _encoder.encode, blake3.blake3, KEY_SEED_DIGEST
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hasher(encode((namespace, parent, list(token_ids[start : start + block_size]), extras)), key=seed).digest(
            KEY_BYTES
        )
        yield parent


def reuse_unit(groups: Iterable[tuple[PoolKind, int]]) -> int:
    """The whole reuse unit: LCM of the block sizes of every group a prefix hit restores (I7).

    A finer hash granularity never defines a hit (seed 002: 64-token hash hits mapped onto
    1152-token blocks)."""
    sizes = [size for kind, size in groups if kind in _PREFIX_KINDS]
    return math.lcm(*sizes) if sizes else 0
