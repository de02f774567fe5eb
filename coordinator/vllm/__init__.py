"""kvledger beside a real vLLM: its KV events decoded (kv_events, pure) and recorded in the
ledger as an observed engine (ingest, the `kvledger ingest vllm` command in cli)."""

from __future__ import annotations

from coordinator.vllm.kv_events import DecodedBatch, Unreadable, decode_event, decode_frames, decode_payload, hash_bytes

__all__ = ["DecodedBatch", "Unreadable", "decode_event", "decode_frames", "decode_payload", "hash_bytes"]
