"""Constraints as automata on the GPU (`engine.constraint_masks: ours`): the table
(`colocate.constraint.trie_table`), the kernel that walks and applies it
(`colocate.kernels.trie_mask`) and its place in vLLM's sampler (`colocate.engine.vllm_trie`).

The reference of all three is `ConstraintState`, the HF engine's walk: after every prefix the
tokens left finite must be exactly the ones it allows (EOS alone once it is done). Masks are exact:
a logit is kept bit for bit or set to -inf, so every comparison here is equality. The Triton kernel
runs under the interpreter in a subprocess (the interpreter is chosen when `triton.jit` decorates
the kernel) against the PyTorch reference on the same inputs.
"""
import json
import os
import random
import types

import numpy as np
import pytest
import torch

from colocate.constraint import Constraint, ConstraintState, _chained_edges, trie_table
from colocate.engine import vllm_trie
from colocate.kernels.trie_mask import Pool, Requests, advance_and_mask_reference
from tests.conftest import run_interpreted

V, EOS = 40, 0


def random_constraint(rng: random.Random, prefixes: bool) -> Constraint:
    """1-4 slots of 1-6 choices of 1-3 tokens; without `prefixes` every choice ends in token V-1
    (an order line's newline), so none is a prefix of another."""
    slots = []
    for _ in range(rng.randint(1, 4)):
        choices = set()
        for _ in range(rng.randint(1, 6)):
            seq = tuple(rng.randint(1, V - 2) for _ in range(rng.randint(1, 3)))
            choices.add(seq if prefixes else seq + (V - 1,))
        slots.append([list(c) for c in sorted(choices)])
    return Constraint(slots=slots, eos_id=EOS)


def edges(table, state: int) -> list[int]:
    return table.tokens[table.offsets[state]:table.offsets[state + 1]].tolist()


@pytest.mark.parametrize("prefixes", [False, True])
def test_table_allows_what_constraint_state_allows(prefixes):
    rng = random.Random(int(prefixes))
    for _ in range(200):
        c = random_constraint(rng, prefixes)
        table = trie_table(c)
        for _ in range(10):
            walk, state = ConstraintState(c), 0
            while not walk.done:
                assert edges(table, state) == walk.allowed()
                tok = rng.choice(walk.allowed())
                state = int(table.targets[table.offsets[state] + edges(table, state).index(tok)])
                walk.advance(tok)
            assert edges(table, state) == []  # after EOS nothing


def test_prefix_choices_take_the_determinized_path():
    c = Constraint(slots=[[[5], [5, 6]], [[7]]], eos_id=EOS)  # "5" ends where "5 6" goes on
    assert _chained_edges(c) is None
    table = trie_table(c)
    after_5 = int(table.targets[table.offsets[0]])
    assert edges(table, after_5) == [6, 7]  # the longer choice or the next slot
    assert _chained_edges(Constraint(slots=[[[5, 9], [6, 9]]], eos_id=EOS)) is not None


def test_equal_constraints_share_a_key():
    rng = random.Random(3)
    a = random_constraint(rng, False)
    b = Constraint(slots=[[list(s) for s in slot] for slot in a.slots], eos_id=EOS)
    assert trie_table(a).key == trie_table(b).key
    assert a.table() is a.table()  # built once per Constraint
    assert trie_table(Constraint(slots=a.slots, eos_id=EOS + 1)).key != trie_table(a).key


# ------------------------------------------------------------------------------ the kernel

CASES = [(0, V), (1, V), (2, V), (0, 5000)]
"""(seed, vocabulary): 5,000 takes the kernel's vocabulary loop past one block."""
PROMPTS = [3, 4, 5, 3, 3, 2, 4, 2]
ROWS = [5, 0, -1, 1, 2, 3, 4, 6, 7]
"""Logit rows' request indices (-1: vLLM's padding). 0-3: fresh requests; 4: no table; 5: an index
taken by a new request (its epoch moved on, its old state is stale); 6: back from preemption with
three outputs already (the first launch walks all three); 7: an output its table does not allow
(dead: only EOS from there)."""


def kernel_constraints(seed: int, vocab: int) -> list[Constraint]:
    """Four random constraints (two with prefix choices); with a wide vocabulary also one slot of
    150 one-token choices (a state of more edges than one block of the kernel)."""
    rng = random.Random(seed)
    out = [random_constraint(rng, bool(i % 2)) for i in range(4)]
    if vocab > 4096:
        out[2] = Constraint(slots=[[[t] for t in rng.sample(range(1, vocab), 150)], *out[2].slots], eos_id=EOS)
    return out


def kernel_case(seed: int, vocab: int):
    """(constraints, pool of their tables, requests at the start; see ROWS)."""
    constraints = kernel_constraints(seed, vocab)
    tables = [c.table() for c in constraints]
    offsets, tokens, targets, bases = [], [], [], []
    for t in tables:
        bases.append((sum(map(len, offsets)), sum(map(len, tokens))))
        offsets.append(t.offsets), tokens.append(t.tokens), targets.append(t.targets)
    pool = Pool(*(torch.from_numpy(np.concatenate(a)) for a in (offsets, tokens, targets)))
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    req = Requests(active=i32([1, 1, 1, 1, 0, 1, 1, 1]), eos=i32([EOS] * 8),
                   sbase=i32([bases[i % 4][0] for i in range(8)]), ebase=i32([bases[i % 4][1] for i in range(8)]),
                   epoch=i32([1, 1, 1, 1, 1, 2, 1, 1]), state=i32([0, 0, 0, 0, 0, 3, 0, 0]),
                   consumed=i32([0, 0, 0, 0, 0, 9, 0, 0]), seen=i32([0, 0, 0, 0, 0, 1, 0, 0]),
                   history=torch.zeros(8, 64, dtype=torch.int32), prompt_len=i32(PROMPTS), total_len=i32(PROMPTS))
    walk, rng = ConstraintState(constraints[6 % 4]), random.Random(seed)
    for _ in range(3):  # index 6: three valid outputs from before its preemption
        tok = rng.choice([t for t in walk.allowed() if t != EOS] or walk.allowed())
        req.history[6, req.total_len[6]] = tok
        req.total_len[6] += 1
        walk.advance(tok)
    req.history[7, req.total_len[7]] = vocab - 1  # never a choice's first token
    req.total_len[7] += 1
    return constraints, tables, pool, req


def run_kernel(fn, seed: int, vocab: int = V, device: str = "cpu") -> dict:
    """Drive `fn` (the reference or the kernel) for 20 steps (every walk ends within them), each row's next token drawn among the
    finite logits it left (EOS once only EOS is left, then nothing); returns each step's finite
    columns per row, the final states and the token histories."""
    _, tables, pool, req = kernel_case(seed, vocab)
    pool = Pool(*(t.to(device) for t in (pool.offsets, pool.tokens, pool.targets)))
    req = Requests(**{k: v.to(device) for k, v in vars(req).items()})
    rng = torch.Generator().manual_seed(seed)
    rows_req = torch.tensor(ROWS, dtype=torch.int32, device=device)
    steps, done = [], set()
    for _ in range(20):
        logits = torch.randn(len(rows_req), vocab, generator=rng).to(device)
        before = logits.clone()
        fn(logits, rows_req, pool, req, max(t.max_degree for t in tables))
        logits, before = logits.cpu(), before.cpu()
        finite = torch.isfinite(logits)
        assert torch.equal(logits[finite], before[finite])  # kept bit for bit
        steps.append([finite[row].nonzero().flatten().tolist() for row in range(len(rows_req))])
        for row, r in enumerate(ROWS):
            allowed = steps[-1][row]
            if r < 0 or r == 4 or r in done:
                continue
            pick = allowed[int(torch.randint(len(allowed), (1,), generator=rng))]
            req.history[r, req.total_len[r]] = pick
            req.total_len[r] += 1
            if pick == EOS:
                done.add(r)
    return {"steps": steps, "state": req.state.tolist(), "consumed": req.consumed.tolist(),
            "history": req.history.tolist(), "total_len": req.total_len.tolist()}


def reference(logits, rows_req, pool, req, max_degree):
    advance_and_mask_reference(logits, rows_req, pool, req)


@pytest.mark.parametrize("seed,vocab", CASES)
def test_reference_keeps_what_constraint_state_allows(seed, vocab):
    constraints, _, _, _ = kernel_case(seed, vocab)
    got = run_kernel(reference, seed, vocab)
    for r in (0, 1, 2, 3, 5, 6):  # each request's tokens through ConstraintState
        walk, earlier = ConstraintState(constraints[r % 4]), 3 if r == 6 else 0
        tokens = got["history"][r][PROMPTS[r]:got["total_len"][r]]
        for i, tok in enumerate(tokens):
            if i >= earlier:
                assert got["steps"][i - earlier][ROWS.index(r)] == walk.allowed()
            walk.advance(tok)
        assert walk.done and tokens[-1] == EOS
        for step in got["steps"][len(tokens) - earlier:]:
            assert step[ROWS.index(r)] == [EOS]  # after EOS the state has no edges: EOS alone
    assert all(step[ROWS.index(7)] == [EOS] for step in got["steps"])  # dead
    assert got["state"][7] == -1
    assert all(step[ROWS.index(-1)] == step[ROWS.index(4)] == list(range(vocab)) for step in got["steps"])


@pytest.fixture(scope="module")
def interpreted():
    return json.loads(run_interpreted(__file__))


@pytest.mark.parametrize("seed,vocab", CASES)
def test_interpreted_kernel_matches_reference(interpreted, seed, vocab):
    assert interpreted[f"{seed}-{vocab}"] == run_kernel(reference, seed, vocab)


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed,vocab", CASES)
def test_cuda_kernel_matches_reference(seed, vocab):
    from colocate.kernels.trie_mask import advance_and_mask
    assert run_kernel(advance_and_mask, seed, vocab, "cuda") == run_kernel(reference, seed, vocab)


# ------------------------------------------------------------------------------ in vLLM's sampler

class FakeSampler:
    """vLLM's V2 Sampler as `MaskingSampler` sees it: it records what it is handed."""

    def __init__(self):
        self.added, self.staged, self.seen = [], 0, []
        self.sampling_states = "vllm's"

    def add_request(self, req_idx, prompt_len, sampling_params):
        self.added.append(req_idx)

    def apply_staged_writes(self):
        self.staged += 1

    def __call__(self, logits, input_batch):
        self.seen.append(logits.clone())
        return "sampled"


def fake_req_states(max_reqs: int, max_len: int) -> types.SimpleNamespace:
    uva = lambda t: types.SimpleNamespace(gpu=t)  # noqa: E731
    return types.SimpleNamespace(max_num_reqs=max_reqs, device=torch.device("cpu"), vocab_size=V, index_to_req_id={},
                                 all_token_ids=uva(torch.zeros(max_reqs, max_len, dtype=torch.int32)),
                                 prompt_len=uva(torch.zeros(max_reqs, dtype=torch.int32)),
                                 total_len=uva(torch.zeros(max_reqs, dtype=torch.int32)))


def test_masking_sampler_follows_requests_through_steps_reuse_and_a_pool_rebuild():
    """Requests come and go at vLLM's indices (one without a constraint, one index reused, one
    preempted and re-added with its outputs as prefill); the pool is small enough to be rebuilt.
    Each step the rows handed to vLLM's sampler keep exactly what `ConstraintState` allows."""
    rng = random.Random(7)
    states = fake_req_states(4, 64)
    masks = vllm_trie.ConstraintMasks(states, vllm_trie.TablePool(torch.device("cpu"), 24, 48))
    inner = FakeSampler()
    sampler = vllm_trie.MaskingSampler(inner, masks)
    walks: dict[int, ConstraintState | None] = {}

    def add(index: int, constraint: Constraint | None, prompt: int, outputs: list[int] = ()):
        extra = {vllm_trie.PAYLOAD_KEY: vllm_trie.trie_payload(constraint.table())} if constraint else None
        states.index_to_req_id[index] = f"request-{len(inner.added)}"  # vLLM's states first, then the sampler
        sampler.add_request(index, prompt, types.SimpleNamespace(extra_args=extra))
        states.prompt_len.gpu[index] = prompt
        states.all_token_ids.gpu[index, prompt:prompt + len(outputs)] = torch.tensor(outputs, dtype=torch.int32)
        states.total_len.gpu[index] = prompt + len(outputs)
        walks[index] = ConstraintState(constraint) if constraint else None
        for tok in outputs:
            walks[index].advance(tok)

    def step(indices: list[int]):
        sampler.apply_staged_writes()
        batch = types.SimpleNamespace(expanded_idx_mapping=torch.tensor(indices, dtype=torch.int32),
                                      idx_mapping_np=np.array(indices, dtype=np.int32))
        assert sampler(torch.randn(len(indices), V), batch) == "sampled"
        logits = inner.seen[-1]
        for row, i in enumerate(indices):
            finite = torch.isfinite(logits[row]).nonzero().flatten().tolist()
            walk = walks[i]
            if walk is None:
                assert finite == list(range(V))
                continue
            assert finite == (walk.allowed() if not walk.done else [EOS])
            if not walk.done:
                tok = rng.choice(finite)
                walk.advance(tok)
                states.all_token_ids.gpu[i, states.total_len.gpu[i]] = tok
                states.total_len.gpu[i] += 1

    constraints = [random_constraint(rng, bool(k % 2)) for k in range(6)]
    add(0, constraints[0], 5)
    add(1, constraints[1], 7)
    add(2, None, 4)
    for _ in range(3):
        step([0, 1, 2])
    add(1, constraints[2], 3)  # index 1 reused by a new request
    add(3, constraints[3], 6)
    for _ in range(3):
        step([3, 0, 1])
    walk = ConstraintState(constraints[4])
    outputs = []
    while len(outputs) < 2 and not walk.done:
        outputs.append(rng.choice(walk.allowed()))
        walk.advance(outputs[-1])
    add(0, constraints[4], 4, outputs)  # preempted, back with two outputs in its prefill
    add(2, constraints[5], 2)
    for _ in range(4):
        step([0, 1, 2, 3])
    assert masks.tables.rebuilds >= 1
    assert inner.added == [0, 1, 2, 1, 3, 0, 2] and inner.staged == 10
    assert sampler.sampling_states == "vllm's"  # everything else is vLLM's sampler's own


def test_a_rebuilt_pool_keeps_only_the_tables_of_requests_vllm_still_holds():
    """vLLM frees an index without telling the sampler: a finished request's table must not be
    carried into the rebuilt pool (nor keep it growing)."""
    rng = random.Random(3)
    tables = [random_constraint(rng, False).table() for _ in range(5)]
    states = fake_req_states(4, 8)
    first = (sum(len(t.offsets) for t in tables[:4]), sum(len(t.tokens) for t in tables[:4]))
    masks = vllm_trie.ConstraintMasks(states, vllm_trie.TablePool(torch.device("cpu"), *first))  # full after 4

    def add(index: int, table):
        states.index_to_req_id[index] = f"request-{index}"
        masks.add_request(index, types.SimpleNamespace(extra_args={vllm_trie.PAYLOAD_KEY: vllm_trie.trie_payload(table)}))

    for index in range(4):
        add(index, tables[index])
    assert masks.tables.rebuilds == 0
    del states.index_to_req_id[1], states.index_to_req_id[2]  # two requests finished
    add(1, tables[4])  # index 1 reused; the pool is full
    assert masks.tables.rebuilds == 1
    assert set(masks.tables.tables) == {tables[0].key, tables[3].key, tables[4].key}
    assert masks.keys == [tables[0].key, tables[4].key, None, tables[3].key]
    for index in (0, 1, 3):  # the live rows point at their tables' new places
        _, sbase, ebase = masks.tables.tables[masks.keys[index]]
        assert (masks.host["sbase"][index], masks.host["ebase"][index]) == (sbase, ebase)


def test_appended_tables_reach_the_device_pool_at_the_flush():
    """A table goes to the host mirror at once and to the device pool at the next flush (once per
    engine step), where each array arrives whole at its base."""
    rng = random.Random(5)
    pool = vllm_trie.TablePool(torch.device("cpu"), 256, 1024)
    tables = [random_constraint(rng, k % 2 == 1).table() for k in range(3)]
    pool.place(tables[0], set)
    pool.flush()
    for t in tables[1:]:
        pool.place(t, set)
    for k, t in enumerate(tables):
        _, sb, eb = pool.tables[t.key]
        arrays = ((pool.pool.offsets, t.offsets, sb), (pool.pool.tokens, t.tokens, eb), (pool.pool.targets, t.targets, eb))
        for dst, src, at in arrays:  # the first flushed; the others only on the host so far
            assert torch.equal(dst[at:at + len(src)], torch.from_numpy(src) if k == 0 else torch.zeros(len(src), dtype=torch.int32))
    pool.flush()
    for t in tables:
        _, sb, eb = pool.tables[t.key]
        assert torch.equal(pool.pool.offsets[sb:sb + len(t.offsets)], torch.from_numpy(t.offsets))
        assert torch.equal(pool.pool.tokens[eb:eb + len(t.tokens)], torch.from_numpy(t.tokens))
        assert torch.equal(pool.pool.targets[eb:eb + len(t.targets)], torch.from_numpy(t.targets))
    assert (pool.flushed_states, pool.flushed_edges) == (pool.used_states, pool.used_edges)


def test_payload_round_trip_and_unconstrained_batches_launch_nothing(monkeypatch):
    table = trie_table(random_constraint(random.Random(0), True))
    back = vllm_trie.table_from_payload(vllm_trie.trie_payload(table))
    assert back.key == table.key and back.eos_id == table.eos_id
    assert all(np.array_equal(getattr(back, k), getattr(table, k)) for k in ("offsets", "tokens", "targets"))
    masks = vllm_trie.ConstraintMasks(fake_req_states(2, 8))
    masks.add_request(0, types.SimpleNamespace(extra_args=None))
    monkeypatch.setattr(vllm_trie, "advance_and_mask", lambda *a: pytest.fail("no constrained row: no launch"))
    masks.apply(torch.zeros(1, V), torch.tensor([0], dtype=torch.int32), np.array([0]))


def test_install_wraps_only_a_v2_runner_without_speculation():
    v2 = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu.model_runner"})
    runner = v2()
    runner.sampler, runner.speculator, runner.req_states = FakeSampler(), None, fake_req_states(2, 8)
    assert vllm_trie.install(runner) == "ours" and isinstance(runner.sampler, vllm_trie.MaskingSampler)
    assert vllm_trie.install(runner) == "ours" and isinstance(runner.sampler._sampler, FakeSampler)  # once
    runner.speculator = object()
    runner.sampler = FakeSampler()
    assert vllm_trie.install(runner) == "vllm"
    v1 = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu_model_runner"})()
    v1.sampler, v1.speculator = FakeSampler(), None
    assert vllm_trie.install(v1) == "vllm" and vllm_trie.masked_rows(v1) == 0


def test_a_kernel_that_fails_at_start_leaves_vllms_grammars(monkeypatch, capsys):
    """The kernel is compiled when installed (not inside the first batch); if that fails the
    sampler stays vLLM's and the engine says so (its requests then carry grammars)."""
    compiled = []
    monkeypatch.setattr(vllm_trie, "advance_and_mask", lambda logits, *a: compiled.append(logits.dtype))
    runner = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu.model_runner"})()
    runner.sampler, runner.speculator, runner.req_states = FakeSampler(), None, fake_req_states(2, 8)
    assert vllm_trie.install(runner) == "ours" and set(compiled) == {torch.float32, torch.bfloat16}

    def broken(*a):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(vllm_trie, "advance_and_mask", broken)
    runner.sampler = FakeSampler()
    assert vllm_trie.install(runner) == "vllm" and isinstance(runner.sampler, FakeSampler)
    assert "vLLM's grammars stay" in capsys.readouterr().out


if __name__ == "__main__":  # the interpreter subprocess
    from colocate.kernels.trie_mask import advance_and_mask
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps({f"{seed}-{vocab}": run_kernel(advance_and_mask, seed, vocab) for seed, vocab in CASES}))


def test_masking_before_the_staged_writes_is_refused_not_wrong():
    """A request added after the last `apply_staged_writes` and sampled before the next one would be
    masked from stale device tables (zeros): that order is an error, loud at once; a request added
    afterwards but not in the batch is fine."""
    rng = random.Random(11)
    states = fake_req_states(3, 8)
    masks = vllm_trie.ConstraintMasks(states)
    batch = (torch.tensor([0], dtype=torch.int32), np.array([0]))

    def add(index: int):
        states.index_to_req_id[index] = f"request-{index}"
        table = random_constraint(rng, False).table()
        masks.add_request(index, types.SimpleNamespace(extra_args={vllm_trie.PAYLOAD_KEY: vllm_trie.trie_payload(table)}))
    add(0)
    with pytest.raises(RuntimeError, match="added after the last apply_staged_writes"):
        masks.apply(torch.zeros(1, V), *batch)
    masks.apply_staged_writes()
    masks.apply(torch.zeros(1, V), *batch)
    add(1)  # staged for the next step; row 0 is still current
    masks.apply(torch.zeros(1, V), *batch)
    with pytest.raises(RuntimeError, match="stale tables"):
        masks.apply(torch.zeros(2, V), torch.tensor([0, 1], dtype=torch.int32), np.array([0, 1]))


def test_our_kernels_warm_up_on_every_logits_layout_the_sampler_passes(monkeypatch):
    """vLLM hands the sampler a view of its padded LM head's output (rows VOCAB_PADDING wide), and a
    float32 copy of one such row keeps that stride; Triton compiles a kernel again for a row stride
    of another class (divisible by 16 or not). So both warm-ups run their kernel on contiguous rows
    and on padded views, one row and two, float32 and bfloat16: a vocabulary of 269 (cpu-tiny's)
    gives strides 269 and 320, a Qwen one (a multiple of 64) only its own."""
    from colocate.engine import vllm_logprobs
    from colocate.kernels import sampled_logprob as logprob_kernel
    layouts = {(l.shape[0], l.stride(0), l.dtype) for l in vllm_logprobs.warm_up_logits(269, "cpu")}
    assert layouts == {(r, s, d) for r in (1, 2) for s in (269, 320) for d in (torch.float32, torch.bfloat16)}
    assert all(l.shape[1] == 269 and l.stride(1) == 1 for l in vllm_logprobs.warm_up_logits(269, "cpu"))
    assert {l.stride(0) for l in vllm_logprobs.warm_up_logits(152064, "cpu")} == {152064}
    seen = {"logprob": set(), "mask": set()}
    monkeypatch.setattr(logprob_kernel, "sampled_logprob",
                        lambda logits, ids: seen["logprob"].add((logits.shape[0], logits.stride(0), logits.dtype)))
    assert vllm_logprobs.warm_up(269, "cpu")

    def record_mask(logits, rows_req, *rest):
        assert rows_req.shape[0] == logits.shape[0]  # a row of no request for every row
        seen["mask"].add((logits.shape[0], logits.stride(0), logits.dtype))
    monkeypatch.setattr(vllm_trie, "advance_and_mask", record_mask)
    states = fake_req_states(2, 8)
    states.vocab_size = 269
    vllm_trie.ConstraintMasks(states).warm_up()
    assert seen["logprob"] == seen["mask"] == layouts
