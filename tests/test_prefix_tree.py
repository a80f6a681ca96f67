"""Prefix trees over prompts: the radix tree, the packed tree layout seen by each sequence exactly as
its flat layout, and the split into micro-batches under a token budget (CPU, no model)."""
import pytest
import torch

from colocate.learner.prefix_tree import build_tree, split_by_budget, split_prompts, tree_layout
from colocate.learner.tree_attention import dense_tree_mask

# two prompts share [1, 2, 3]; one prompt is a prefix of another; a prompt repeated (a GRPO group)
PROMPTS = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4], [1, 2, 3, 4, 6], [7, 8]]
COMPLETIONS = [[10, 11], [12], [13, 14, 15], [16], [17, 18]]


def test_radix_tree_shares_every_common_prefix_once():
    nodes = build_tree(PROMPTS, "tree")
    by_tokens = {tuple(n.tokens): n for n in nodes[1:]}
    assert set(by_tokens) == {(1, 2, 3), (4,), (5,), (6,), (7, 8)}
    assert sorted(by_tokens[(4,)].seqs) == [0, 2] and by_tokens[(6,)].seqs == [3]
    assert nodes[by_tokens[(4,)].parent].tokens == [1, 2, 3]
    assert nodes[by_tokens[(6,)].parent].tokens == [4]


def test_group_mode_shares_only_whole_prompts():
    nodes = build_tree(PROMPTS, "group")
    assert sorted(tuple(n.tokens) for n in nodes[1:]) == sorted({tuple(p) for p in PROMPTS})
    assert all(n.parent == 0 for n in nodes[1:])
    with pytest.raises(ValueError, match="empty prompt"):
        build_tree([[1], []], "tree")


@pytest.mark.parametrize("mode", ["tree", "group"])
def test_each_sequence_sees_exactly_its_own_tokens_at_its_flat_positions(mode):
    """The tree mask restricted to one sequence is the flat causal mask: from its last token the
    visible rows hold its prompt + completion in order, at positions 0..L-1, and each of its tokens
    sees exactly the ones before it."""
    layout = tree_layout(PROMPTS, COMPLETIONS, mode)
    mask = dense_tree_mask(layout.kv_end)[0, 0]
    for s, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        last = int(layout.keep[layout.seq_ids == s][-1]) + 1  # the row of its last completion token
        rows = mask[last].nonzero().flatten()
        assert layout.tokens[rows].tolist() == p + c, s
        assert layout.position_ids[rows].tolist() == list(range(len(p) + len(c))), s
        for i, r in enumerate(rows.tolist()):
            assert mask[r].nonzero().flatten().tolist() == rows[:i + 1].tolist(), (s, i)
    flat_targets = [t for c in COMPLETIONS for t in c]
    assert layout.targets.tolist() == flat_targets
    assert layout.seq_ids.tolist() == [s for s, c in enumerate(COMPLETIONS) for _ in c]
    # every completion's first token is predicted from its prompt's last row, shared by a group
    first = {s: int(layout.keep[layout.seq_ids == s][0]) for s in range(len(PROMPTS))}
    assert first[0] == first[2] and layout.tokens[first[0]] == 4
    shared = 3 + 1 + 1 + 1 + 2 if mode == "tree" else 4 + 4 + 5 + 2
    assert layout.num_tokens == shared + sum(len(c) for c in COMPLETIONS)


def test_split_respects_the_budget_and_repeats_ancestors():
    g = torch.Generator().manual_seed(0)
    instruction = torch.randint(2, 500, (20,), generator=g).tolist()
    prompts, comp_lens = [], []
    for _board in range(3):
        board = torch.randint(2, 500, (8,), generator=g).tolist()
        for _power in range(7):
            own = torch.randint(2, 500, (5,), generator=g).tolist()
            for _ in range(2):
                prompts.append(instruction + board + own)
                comp_lens.append(int(torch.randint(1, 6, (1,), generator=g)))
    for budget in (40, 80, 200, 10_000):
        groups = split_by_budget(prompts, comp_lens, "tree", budget)
        assert sorted(i for grp in groups for i in grp) == list(range(len(prompts)))
        for grp in groups:
            sub = tree_layout([prompts[i] for i in grp], [[0] * comp_lens[i] for i in grp], "tree")
            assert sub.num_tokens <= budget, (budget, grp)
            assert grp == sorted(grp)
        if budget == 10_000:
            assert len(groups) == 1
    # a budget below one sequence: that sequence alone
    assert split_by_budget([[1, 2, 3]], [4], "tree", 5) == [[0]]
    # the split keeps siblings together: at a budget of one board's subtree, far fewer micro-batches
    # than one per power
    assert len(split_by_budget(prompts, comp_lens, "tree", 200)) <= 6


def test_split_prompts_round_trips_a_packed_batch():
    from tests.test_packing import random_batch
    batch = random_batch(100, [(5, 2), (7, 3)], seed=3)
    prompts, completions = split_prompts(batch)
    assert [len(p) for p in prompts] == [5, 7] and [len(c) for c in completions] == [2, 3]
    assert torch.equal(torch.tensor(sum((p + c for p, c in zip(prompts, completions)), [])), batch.tokens.long())
