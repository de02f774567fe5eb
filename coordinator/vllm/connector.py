# mypy: ignore-errors
# Why: this module subclasses vLLM's connector, and vLLM lives only in the separate .venv-vllm
# (ops/vllm/setup.sh), never in the project's .venv where mypy runs; its checks are
# coordinator.vllm.offload_client.check_connector_config and LoadErrors, which mypy checks.
"""KvledgerOffloadingConnector: vLLM 0.32's OffloadingConnector, with the loads kvledger refused
reported to vLLM as load errors, so that vLLM recomputes those blocks instead of crashing.

    kv_connector="KvledgerOffloadingConnector", kv_connector_module_path="coordinator.vllm.connector",
    kv_load_failure_policy="recompute", kv_connector_extra_config={"spec_name": "KvledgerOffloadingSpec",
    "spec_module_path": "coordinator.vllm.offload", "kvledger_socket": ..., "kvledger_namespace": {...}}

vLLM's OffloadingConnector asserts that every transfer succeeded and never overrides
get_block_ids_with_load_errors (ops/vllm/API_NOTES.md section 6). Here the worker of
coordinator.vllm.offload answers a refused load as a finished transfer and puts its engine block
ids in LoadErrors; this connector hands them to vLLM's model runner, whose scheduler, under
kv_load_failure_policy "recompute", truncates the request's computed tokens at the first refused
block, caches nothing of it and schedules those tokens again (vllm/v1/core/sched/scheduler.py,
_handle_invalid_blocks and _update_waiting_for_remote_kv). The blocks from the first that failed
verification on are refused, the verified ones before it kept. A model with several KV-cache
groups (a hybrid of sliding-window and full attention) cannot name blocks so (a block id is unique
only within its group, and vLLM 0.32 raises on them): its refused loads are reported as failed
requests (failed_recving, and in finished_recving too), which vLLM recomputes whole.

Cheaper than one committed step per manager call: a request's whole key chain is asked of kvledger
in one lookup, answered at once from its committed state (`_ask_chain`), with the chains of the
requests waiting behind it (`_waiting_chains`: the requests one scheduler pass admits share one
round trip, where each made its own before: 48 prompts a round took ~50 lookups), and the loads and stores
of a scheduler pass are decided in one committed step at the end of the pass
(`build_connector_meta`), before vLLM ships them to its workers.

A request whose load was refused loads nothing from the tier again: it recomputes. That bounds
the retries (a key that keeps failing, a lease that keeps expiring), and it avoids a stall in
vLLM 0.32: a request whose refused load left it no computed token is freed but stays in the
scheduler's _inflight_prefills, so a second async load of it reserves its own blocks twice and,
in a small cache, is never admitted (seen live: the same lookups, step after step, for ever).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from coordinator.vllm.offload_client import LoadErrors, check_connector_config


class KvledgerOffloadingConnector(OffloadingConnector):
    """OffloadingConnector + KvledgerOffloadingSpec, whose refused loads vLLM recomputes."""

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        transfer = vllm_config.kv_transfer_config
        # Both roles check: the engine refuses to start (seen: the worker's connector, built
        # first, raises this) rather than fail a request or die at the first refused load.
        check_connector_config(transfer.kv_load_failure_policy, transfer.kv_connector_extra_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self._several_groups = len(kv_cache_config.kv_cache_groups) > 1
        """Refused loads are reported as failed requests then, not block ids (unique only in a group)."""
        self._load_errors = LoadErrors()
        if self.connector_worker is not None:
            # The spec hands them to its worker at register_kv_caches (get_worker).
            self.connector_worker.spec.load_errors = self._load_errors
        self._refused_requests: set[str] = set()
        """Scheduler side: requests a load of which was refused; they recompute from now on."""
        self._prefetch_requests = vllm_config.scheduler_config.max_num_seqs
        """Scheduler side: the most waiting requests whose chains ride along with a lookup."""

    def reset_cache(self) -> bool:
        """vLLM's `reset_prefix_cache(reset_connector=True)`: True once kvledger ended this
        engine's keys in its tier (KvledgerOffloadingManager.reset_cache); False, not success,
        when it could not be told (vLLM #57727 answered success and kept serving the old blocks)."""
        done = super().reset_cache()
        assert self.connector_scheduler is not None
        return bool(done) and getattr(self.connector_scheduler.manager, "reset_failed", None) is None

    # --- worker side --------------------------------------------------------------------------

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The engine blocks of the loads refused since the last forward pass (one KV-cache group:
        vLLM recomputes from the first of them and keeps the blocks before it)."""
        refused = self._load_errors.take()
        return set() if self._several_groups else refused

    def get_transfer_results(self, finished_req_ids):
        """vLLM's results, and with several KV-cache groups the requests whose load was refused as
        failed (failed_recving; each is in finished_recving too, the transfer having ended): vLLM
        recomputes such a request whole. The worker's load jobs are read before vLLM's worker
        forgets them, in its get_finished."""
        worker = self.connector_worker
        requests = dict(worker._load_jobs) if worker is not None else {}
        results = super().get_transfer_results(finished_req_ids)
        failed = {requests[job] for job in self._load_errors.take_jobs() if job in requests}
        if self._several_groups and failed:
            results.failed_recving |= failed
            results.finished_recving |= failed
        return results

    # --- scheduler side -----------------------------------------------------------------------

    def update_connector_output(self, connector_output) -> None:
        # The workers load synchronously: a refused load's request finishes receiving in the
        # very output that names its blocks. A load that succeeded in the same step is marked
        # too; it only loses tier hits if it is ever scheduled from scratch again.
        live = self.scheduler._req_status
        if connector_output.invalid_block_ids:
            # Only requests still alive: one aborted meanwhile had request_finished already, and
            # marking it now would keep its id for ever.
            self._refused_requests.update(
                req_id
                for req_id in connector_output.finished_recving or ()
                if req_id in live and not live[req_id].req.is_finished()
            )
        self._refused_requests.update(
            req_id for req_id in connector_output.failed_recving or () if req_id in live and not live[req_id].req.is_finished()
        )
        if connector_output.invalid_block_ids or connector_output.failed_recving:
            self.scheduler.manager.load_failed()  # its hits are not reused: a key may be quarantined
        super().update_connector_output(connector_output)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.request_id in self._refused_requests:
            # Nothing to load (no lookup either), with the connector's per-request state kept as usual.
            return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens, max_num_new_tokens=0)
        self._ask_chain(request, num_computed_tokens)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def _ask_chain(self, request, num_computed_tokens: int) -> None:
        """One question per request per pass: the request's keys beyond what the engine computed,
        every group's, asked of kvledger at once; vLLM's scheduler then looks them up one by one
        (in prefix order, until the first miss), and the manager answers from this answer."""
        scheduler = self.scheduler
        status = scheduler._req_status.get(request.request_id)
        if status is None or status.transfer_jobs or request.skip_reading_prefix_cache:
            return  # vLLM asks nothing now
        scheduler.manager.ask(self._chain(status, num_computed_tokens), lambda: self._waiting_chains(request.request_id))

    def _chain(self, status, num_computed_tokens: int) -> list:
        """A request's offload keys beyond its first `num_computed_tokens`, every group's."""
        status.update_offload_keys()  # idempotent: vLLM's own call finds nothing new to add
        return [
            key
            for config, group in zip(self.scheduler.config.kv_group_configs, status.group_states, strict=True)
            for key in group.offload_keys[num_computed_tokens // config.tokens_per_chunk :]
        ]

    def _waiting_chains(self, asking: str):
        """The whole key chains of the requests waiting to be scheduled (nothing computed yet, no
        transfer in flight), in arrival order, at most max_num_seqs of them (the most one pass can
        admit): asked with the chain of the request `asking`, so the other requests of the pass
        find their answers and make no round trip of their own."""
        found = 0
        for req_id, status in self.scheduler._req_status.items():
            if found >= self._prefetch_requests:
                return
            request = status.req
            if (
                req_id == asking
                or request.num_computed_tokens
                or status.transfer_jobs
                or request.skip_reading_prefix_cache
                or req_id in self._refused_requests
                or request.is_finished()
            ):
                continue
            found += 1
            yield self._chain(status, 0)

    def build_connector_meta(self, scheduler_output):
        # The pass's loads and stores (prepared during it) are decided in one committed kvledger
        # step here, before vLLM ships the metadata, and so their specs, to the workers.
        meta = super().build_connector_meta(scheduler_output)
        self.scheduler.manager.flush()
        return meta

    def request_finished(self, request, block_ids):
        self._refused_requests.discard(request.request_id)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids):
        self._refused_requests.discard(request.request_id)
        return super().request_finished_all_groups(request, block_ids)
