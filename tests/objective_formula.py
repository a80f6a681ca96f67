"""The policy objectives in float64, written out per sequence and per token from their definitions
(GSPO, AReaL's decoupled clip, truncated and masked importance sampling, verl's dual clip): no code shared with
`colocate.kernels`. Imported by the reference's tests and by the Triton interpreter subprocess."""
import torch


def objective_float64(logits, targets, weights, behaviour, advantages, ref, seq_ids, old=None, *, temperature,
                      eps_low, eps_high, beta, ratio_level="token", tis_cap=0.0, mis_threshold=0.0, clip_ratio_c=0.0):
    """-> (loss, d(logits)), float64. `logits` [N, V] any dtype; `old` the start-of-batch log-probs."""
    x = logits.detach().double().requires_grad_()
    logp = torch.log_softmax(x / temperature, -1).gather(1, targets.long()[:, None]).squeeze(1)
    b, adv, w = behaviour.double(), advantages.double(), weights.double()
    learner = old.double() if old is not None else logp.detach()
    decoupled = old is not None or tis_cap > 0
    total = x.sum() * 0.0
    for s in sorted(set(seq_ids.tolist())):
        toks = [t for t in range(len(seq_ids)) if int(seq_ids[t]) == s and w[t] > 0]
        if not toks:
            continue
        drift = sum(abs(float(learner[t] - b[t])) for t in toks) / len(toks)
        if mis_threshold > 0 and drift > mis_threshold:
            continue  # the whole sequence is masked
        anchor = {t: (learner[t] if decoupled else b[t]) for t in toks}
        seq_log_ratio = sum(logp[t] - anchor[t] for t in toks) / len(toks)
        for t in toks:
            log_ratio = seq_log_ratio if ratio_level == "sequence" else logp[t] - anchor[t]
            r = torch.exp(log_ratio)
            iw = torch.exp(learner[t] - b[t]) if decoupled else torch.ones((), dtype=torch.float64)
            if tis_cap > 0:
                iw = torch.clamp(iw, max=tis_cap)
            # verl's compute_policy_loss: pg_losses1/2 -> clip_pg_losses1 = max(-A r, -A clip(r)); with the dual
            # clip, where A < 0: min(pg_losses3 = -A c, clip_pg_losses1)
            policy = torch.maximum(-adv[t] * r, -adv[t] * torch.clamp(r, 1 - eps_low, 1 + eps_high))
            if clip_ratio_c > 0 and adv[t] < 0:
                policy = torch.minimum(-adv[t] * clip_ratio_c, policy)
            term = iw * policy
            if ref is not None and beta > 0:
                d = ref[t].double() - logp[t]
                term = term + beta * (torch.exp(d) - d - 1)
            total = total + w[t] * term
    total.backward()
    return total.detach(), x.grad


def objective_inputs(num_rows, vocab, dtype, *, seed, temperature=1.0, num_seqs=5):
    """Random inputs for the objectives: sequences of several tokens, 20% masked rows, sampler
    log-probs spread around the true ones (some sequences drift further, for the mask), a
    start-of-batch policy between the two."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab, (num_rows,), generator=g)
    seq_ids = torch.sort(torch.randint(0, num_seqs, (num_rows,), generator=g)).values
    mask = (torch.rand(num_rows, generator=g) > 0.2).float()
    exact = torch.log_softmax(logits.double() / temperature, -1).gather(1, targets[:, None]).squeeze(1)
    drift = 0.05 + 0.5 * (seq_ids % 2).double()  # odd sequences drift ~10x more from the sampler
    behaviour = (exact + drift * torch.randn(num_rows, generator=g, dtype=torch.float64)).float()
    old = (exact + 0.02 * torch.randn(num_rows, generator=g, dtype=torch.float64)).float()
    advantages = torch.randn(num_seqs, generator=g)[seq_ids]
    ref = (exact + 0.2 * torch.randn(num_rows, generator=g, dtype=torch.float64)).float()
    return dict(logits=logits, targets=targets, weights=mask / mask.sum().clamp(min=1), behaviour=behaviour,
                advantages=advantages, ref=ref, seq_ids=seq_ids, old=old)
