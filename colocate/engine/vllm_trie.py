"""Constraint masks inside vLLM's sampler from our automata, instead of vLLM's structured outputs
(`engine.constraint_masks: ours`).

With structured outputs vLLM's engine core compiles an llguidance grammar per request and, every
step, waits for the previous step's tokens, advances each grammar and fills each request's bitmask
on host threads before it can sample: the host work grows with every constrained sequence and the
GPU waits on it (profiles/README.md, issue 36). Here each request carries its Constraint as a
`TrieTable` (`SamplingParams.extra_args[PAYLOAD_KEY]`, built once per Constraint on the inference
rank); the worker keeps the tables in one device pool and, before each sampling, one kernel walks
every constrained row's state over its new tokens from vLLM's token history (which the GPU reads
in place) and masks its logits (`colocate.kernels.trie_mask`). Nothing waits for the host, so
vLLM's asynchronous scheduling keeps running ahead.

`install` (through `ColocateWorkerExtension.colocate_use_constraint_masks`) wraps the V2 model
runner's sampler: `add_request` registers a request's table, `apply_staged_writes` sends the
per-request vectors, `__call__` masks then samples. It refuses (returns "vllm") under the V1 runner
and with speculative decoding (several logit rows per request).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from colocate.constraint import TrieTable
from colocate.kernels.trie_mask import Pool, Requests, advance_and_mask

PAYLOAD_KEY = "colocate_trie"
HOST_FIELDS = ("active", "eos", "sbase", "ebase", "epoch")


def trie_payload(table: TrieTable) -> dict:
    """What a request carries in `SamplingParams.extra_args[PAYLOAD_KEY]` (msgpack-friendly)."""
    return {"key": table.key, "eos": table.eos_id, "offsets": table.offsets.tobytes(),
            "tokens": table.tokens.tobytes(), "targets": table.targets.tobytes()}


def table_from_payload(payload: dict) -> TrieTable:
    arrays = [np.frombuffer(payload[k], dtype=np.int32) for k in ("offsets", "tokens", "targets")]
    return TrieTable(*arrays, eos_id=int(payload["eos"]), key=payload["key"])


def host_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A CPU copy of `array`, pinned when it goes to a GPU (so the copy does not wait for the GPU;
    torch keeps pinned blocks until the copies reading them have run)."""
    t = torch.from_numpy(np.array(array))
    return t.pin_memory() if device.type == "cuda" else t


class TablePool:
    """The tables of live requests in one device pool, shared by key, appended at the end; when
    full, rebuilt from the live tables alone (at twice the size if they need it). A table is
    appended to a host mirror of the pool (pinned for a GPU); `flush` copies what was appended since
    the last one, one copy per array, once per engine step (`ConstraintMasks.apply_staged_writes`)
    instead of three pinned tensors and three copies per table."""

    def __init__(self, device: torch.device, states: int = 1 << 16, edges: int = 1 << 18):
        self.device = device
        self.tables: dict[str, tuple[TrieTable, int, int]] = {}  # key -> (table, state base, edge base)
        self.max_degree = 1
        self.rebuilds = 0
        self._alloc(states, edges)

    def _alloc(self, states: int, edges: int) -> None:
        """A new, empty pool and its mirror. The old mirror may still be read by a copy in flight:
        torch keeps a pinned block until the copies that read it have run."""
        sizes = (states, edges, edges)
        self.pool = Pool(*(torch.zeros(n, dtype=torch.int32, device=self.device) for n in sizes))
        self.mirror = Pool(*(torch.zeros(n, dtype=torch.int32, pin_memory=self.device.type == "cuda") for n in sizes))
        self.used_states = self.used_edges = 0
        self.flushed_states = self.flushed_edges = 0  # what the device pool holds already

    def flush(self) -> None:
        """Copy the tables appended since the last flush to the device (non-blocking, in order
        before the kernel that reads them on the same stream)."""
        for dst, src, lo, hi in ((self.pool.offsets, self.mirror.offsets, self.flushed_states, self.used_states),
                                 (self.pool.tokens, self.mirror.tokens, self.flushed_edges, self.used_edges),
                                 (self.pool.targets, self.mirror.targets, self.flushed_edges, self.used_edges)):
            if hi > lo:
                dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
        self.flushed_states, self.flushed_edges = self.used_states, self.used_edges

    def place(self, table: TrieTable, live: Callable[[], set[str]]) -> bool:
        """Put `table` in the pool (no-op when its key is there); True when the pool was rebuilt,
        which moves every live table (their bases change). `live()`: the keys still in use, asked
        only when the pool is full."""
        if table.key in self.tables:
            return False
        rebuilt = False
        if not self._fits(table):
            keep = [self.tables[k][0] for k in live() if k in self.tables]
            need_s = sum(len(t.offsets) for t in keep) + len(table.offsets)
            need_e = sum(len(t.tokens) for t in keep) + len(table.tokens)
            self._alloc(max(len(self.pool.offsets), 2 * need_s), max(len(self.pool.tokens), 2 * need_e))
            self.tables, rebuilt = {}, True
            self.rebuilds += 1
            for t in keep:
                self._append(t)
        self._append(table)
        return rebuilt

    def _fits(self, table: TrieTable) -> bool:
        return (self.used_states + len(table.offsets) <= len(self.pool.offsets)
                and self.used_edges + len(table.tokens) <= len(self.pool.tokens))

    def _append(self, table: TrieTable) -> None:
        sb, eb = self.used_states, self.used_edges
        for dst, src, at in ((self.mirror.offsets, table.offsets, sb), (self.mirror.tokens, table.tokens, eb),
                             (self.mirror.targets, table.targets, eb)):
            dst.numpy()[at:at + len(src)] = src
        self.used_states, self.used_edges = sb + len(table.offsets), eb + len(table.tokens)
        self.tables[table.key] = (table, sb, eb)
        self.max_degree = max(self.max_degree, table.max_degree)


class ConstraintMasks:
    """The requests' tables and automaton states, indexed by vLLM's request-state index."""

    def __init__(self, req_states, pool: TablePool | None = None):
        """`req_states`: vLLM's `RequestState` (its size, device and token history)."""
        self.req_states, self.device = req_states, req_states.device
        max_reqs = req_states.max_num_reqs
        self.tables = pool or TablePool(self.device)
        self.host = {name: np.zeros(max_reqs, dtype=np.int32) for name in HOST_FIELDS}
        self.keys: list[str | None] = [None] * max_reqs
        self._device_host = torch.zeros(len(HOST_FIELDS), max_reqs, dtype=torch.int32, device=self.device)
        self._owned = torch.zeros(3, max_reqs, dtype=torch.int32, device=self.device)  # state, consumed, seen
        self._dirty = False
        self._synced = (self.host["epoch"].copy(), 0)  # (each index's epoch, pool rebuilds) at the last staged write
        self.rows_masked = 0

    def add_request(self, index: int, sampling_params) -> None:
        """A new request at `index` (its table, if it carries one, replaces whatever was there)."""
        payload = (getattr(sampling_params, "extra_args", None) or {}).get(PAYLOAD_KEY)
        h = self.host
        h["epoch"][index] += 1
        self._dirty = True
        if payload is None:
            h["active"][index], self.keys[index] = 0, None
            return
        table = table_from_payload(payload)
        self.keys[index] = table.key
        if self.tables.place(table, self.live_keys):
            for i, key in enumerate(self.keys):  # rebuilt: every live table moved
                if key is not None:
                    _, h["sbase"][i], h["ebase"][i] = self.tables.tables[key]
        _, h["sbase"][index], h["ebase"][index] = self.tables.tables[table.key]
        h["active"][index], h["eos"][index] = 1, table.eos_id

    def live_keys(self) -> set[str]:
        """The tables of requests vLLM still holds. It frees an index without telling the sampler,
        so a finished request's key is forgotten here, when the pool is rebuilt."""
        held = self.req_states.index_to_req_id
        for i, key in enumerate(self.keys):
            if key is not None and i not in held:
                self.keys[i] = None
        return {k for k in self.keys if k is not None}

    def apply_staged_writes(self) -> None:
        self.tables.flush()
        if self._dirty:
            stacked = np.stack([self.host[name] for name in HOST_FIELDS])
            self._device_host.copy_(host_tensor(stacked, self.device), non_blocking=True)
            self._dirty = False
            self._synced = (self.host["epoch"].copy(), self.tables.rebuilds)

    def requests(self) -> Requests:
        s = self.req_states
        return Requests(*self._device_host, *self._owned, history=s.all_token_ids.gpu, prompt_len=s.prompt_len.gpu,
                        total_len=s.total_len.gpu)

    def warm_up(self) -> None:
        """Compile the kernel now, at engine start, for logits of the model's width in every layout
        the sampler may pass (`vllm_logprobs.warm_up_logits`; rows of no request: nothing is
        masked), instead of inside the first batch."""
        from colocate.engine.vllm_logprobs import warm_up_logits
        for logits in warm_up_logits(self.req_states.vocab_size, self.device):
            rows_req = torch.full((logits.shape[0],), -1, dtype=torch.int32, device=self.device)
            advance_and_mask(logits, rows_req, self.tables.pool, self.requests(), self.tables.max_degree)

    def apply(self, logits: torch.Tensor, rows_req: torch.Tensor, rows_req_host: np.ndarray) -> None:
        """Mask the rows whose request carries a table (a no-op, no launch, when none does)."""
        live = rows_req_host[rows_req_host >= 0]
        masked = int(self.host["active"][live].sum())
        if masked:
            epochs, rebuilds = self._synced
            if rebuilds != self.tables.rebuilds or not np.array_equal(self.host["epoch"][live], epochs[live]):
                raise RuntimeError("constraint masks: a request of this batch was added after the last "
                                   "apply_staged_writes, so the device holds stale tables (vLLM's runner order changed?)")
            self.rows_masked += masked
            advance_and_mask(logits, rows_req, self.tables.pool, self.requests(), self.tables.max_degree)


class MaskingSampler:
    """vLLM's V2 `Sampler` with our constraint masks before it samples; everything else is its own."""

    def __init__(self, sampler, masks: ConstraintMasks):
        self.__dict__.update(_sampler=sampler, _masks=masks)

    def __getattr__(self, name):
        return getattr(self._sampler, name)

    def add_request(self, req_idx: int, prompt_len: int, sampling_params) -> None:
        self._masks.add_request(req_idx, sampling_params)
        self._sampler.add_request(req_idx, prompt_len, sampling_params)

    def apply_staged_writes(self) -> None:
        self._masks.apply_staged_writes()
        self._sampler.apply_staged_writes()

    def __call__(self, logits: torch.Tensor, input_batch):
        self._masks.apply(logits, input_batch.expanded_idx_mapping, np.asarray(input_batch.idx_mapping_np))
        return self._sampler(logits, input_batch)


def install(model_runner) -> str:
    """Wrap the V2 model runner's sampler (once); "ours" when the masks are ours now, "vllm" when
    this runner cannot take them (V1 runner, speculative decoding, no sampler)."""
    if isinstance(getattr(model_runner, "sampler", None), MaskingSampler):
        return "ours"
    if not type(model_runner).__module__.startswith("vllm.v1.worker.gpu."):
        return "vllm"
    if getattr(model_runner, "sampler", None) is None or getattr(model_runner, "speculator", None) is not None:
        return "vllm"
    masks = ConstraintMasks(model_runner.req_states)
    try:
        masks.warm_up()
    except Exception as exc:  # noqa: BLE001 - the engine then keeps vLLM's grammars, and says so
        print(f"colocate: constraint masks unavailable ({type(exc).__name__}: {exc}); vLLM's grammars stay",
              flush=True)
        return "vllm"
    model_runner.sampler = MaskingSampler(model_runner.sampler, masks)
    return "ours"


def masked_rows(model_runner) -> int:
    """Logit rows masked by our kernel in this worker since the install (0 without it)."""
    sampler = getattr(model_runner, "sampler", None)
    return sampler._masks.rows_masked if isinstance(sampler, MaskingSampler) else 0
