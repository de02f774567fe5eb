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
from events import NamespaceSpec
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
    "kv_rank_layout": "heads",
    "parallelism_agnostic": True,
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


def test_a_tp1_and_a_tp2_engine_never_share_keys_unless_both_say_their_layout_is_parallelism_agnostic() -> None:
    """vLLM #56772: a tier's rows depended on the TP size, TP1 and TP2 engines shared keys of
    different layouts, and completions differed. The parallel layout (sizes, how ranks split a
    block) is in the namespace id; an engine storing whole blocks may say it is agnostic, and
    then only the layout drops out of the id: everything else still counts, and an agnostic
    namespace never meets a layout-bound one."""
    tp1 = msgspec.structs.replace(BASE, tensor_parallel_size=1, kv_rank_layout="heads")
    tp2 = msgspec.structs.replace(BASE, tensor_parallel_size=2, kv_rank_layout="heads")
    pp2 = msgspec.structs.replace(tp1, pipeline_parallel_size=2)
    by_layers = msgspec.structs.replace(tp2, kv_rank_layout="layers")
    ids = {namespace_id(spec) for spec in (tp1, tp2, pp2, by_layers)}
    assert len(ids) == 4
    key = chain_keys(namespace_id(tp1), list(range(16)), 16)
    assert key != chain_keys(namespace_id(tp2), list(range(16)), 16)

    def agnostic(spec: NamespaceSpec) -> NamespaceSpec:
        return msgspec.structs.replace(spec, parallelism_agnostic=True)

    shared = {namespace_id(agnostic(spec)) for spec in (tp1, tp2, pp2, by_layers)}
    assert len(shared) == 1 and not shared & ids
    assert namespace_id(agnostic(msgspec.structs.replace(tp2, weights_revision="sha256:other"))) not in shared
    assert b"tensor_parallel_size" not in canonical_namespace(agnostic(tp2))


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
