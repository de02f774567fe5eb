"""Namespaces and chained keys (I8, I9): what changes a key, and what must not."""

from __future__ import annotations

import msgspec
import pytest

from coordinator.core.keys import (
    KEY_BYTES,
    canonical_namespace,
    chain_keys,
    content_key,
    namespace_id,
    namespace_problems,
    reuse_unit,
)
from tests.kit.builders import namespace

BASE = namespace()
CHANGES = {
    "model_id": "org/other",
    "weights_revision": "sha256:9999",
    "tokenizer_digest": "sha256:3333",
    "kv_dtype": "fp8_e4m3",
    "kv_layout_version": 2,
    "block_sizes": (16,),
    "tensor_parallel_size": 4,
    "tenant": "tenant-b",
    "hash_algorithm": "sha256",
    "pipeline_parallel_size": 2,
    "adapter_id": "lora-1",
}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_every_namespace_field_changes_the_namespace_id(field: str) -> None:
    changed = msgspec.structs.replace(BASE, **{field: CHANGES[field]})
    assert namespace_id(changed) != namespace_id(BASE)


def test_namespace_id_ignores_defaults_so_adding_a_defaulted_field_keeps_ids() -> None:
    encoded = canonical_namespace(BASE)
    assert b"adapter_id" not in encoded and b"pipeline_parallel_size" not in encoded
    assert namespace_id(BASE) == namespace_id(namespace())
    assert len(namespace_id(BASE)) == KEY_BYTES


def test_namespace_problems_name_the_empty_field() -> None:
    assert namespace_problems(BASE) == []
    bad = msgspec.structs.replace(BASE, weights_revision="", adapter_revision="r1")
    problems = namespace_problems(bad)
    assert any("weights_revision" in p for p in problems)
    assert any("adapter_revision" in p for p in problems)


def test_key_depends_on_every_input() -> None:
    ns, other_ns = namespace_id(BASE), namespace_id(msgspec.structs.replace(BASE, tenant="b"))
    key = content_key(ns, None, [1, 2, 3, 4])
    assert content_key(ns, None, [1, 2, 3, 4]) == key
    assert content_key(other_ns, None, [1, 2, 3, 4]) != key
    assert content_key(ns, b"p" * 16, [1, 2, 3, 4]) != key
    assert content_key(ns, None, [1, 2, 3, 5]) != key
    assert content_key(ns, None, [1, 2, 3, 4], ["lora:a"]) != key
    assert content_key(ns, None, [1, 2, 3, 4], ["salt"]) != content_key(ns, None, [1, 2, 3, 4], ["lora:a"])


def test_chain_keys_chain_and_skip_the_partial_tail() -> None:
    ns = namespace_id(BASE)
    keys = chain_keys(ns, list(range(10)), 4)
    assert len(keys) == 2
    assert keys[0] == content_key(ns, None, [0, 1, 2, 3])
    assert keys[1] == content_key(ns, keys[0], [4, 5, 6, 7])
    # Same second block of tokens after another first block: another key (the chain).
    assert chain_keys(ns, [9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != keys[1]


def test_key_test_vector() -> None:
    """The documented formula and test vector (README, "Keys"). Changing either means a new
    hash_algorithm: every key already stored in every tier would silently stop matching."""
    import blake3

    ns = bytes(range(16))
    seed = blake3.blake3(b"kvledger/content-key/v1").digest()
    by_the_formula = blake3.blake3(msgspec.msgpack.encode([ns, b"", [1, 2, 3, 4], []]), key=seed).digest(16)
    assert content_key(ns, None, [1, 2, 3, 4]) == by_the_formula
    assert content_key(ns, None, (1, 2, 3, 4)).hex() == "1e4a22e055dd0999ff1522ebca83ae9b"


def test_reuse_unit_is_the_lcm_of_prefix_groups() -> None:
    assert reuse_unit([("attention", 64), ("state", 1152)]) == 1152
    assert reuse_unit([("attention", 16), ("state", 24)]) == 48
    assert reuse_unit([("attention", 16), ("encoder", 7)]) == 16
    assert reuse_unit([("encoder", 7)]) == 0
