"""Multi-query associative recall (MQAR; Zoology, Arora et al. 2023).

Each sequence starts with ``num_kv_pairs`` key-value pairs (k1 v1 k2 v2 ...); the rest holds
random tokens, among which every key appears again as a query, at a distance drawn from a power
law (most queries near the pairs, some far). The target after a query key is its value; all
other targets are ignored (-1). Keys come from the lower half of the vocabulary, values from
the upper half, and the keys of one sequence are distinct.
"""

from __future__ import annotations

import torch


def mqar_batch(n: int, vocab_size: int, seq_len: int, num_kv_pairs: int, power_a: float = 0.01,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (n, seq_len); targets are -1 except after query keys."""
    N = num_kv_pairs
    half = vocab_size // 2
    if half - 1 < N:
        raise ValueError(f"vocab_size {vocab_size} leaves {half - 1} keys, fewer than "
                         f"num_kv_pairs = {N}.")
    total = seq_len + 1
    space = (total - 2 * N) // 2
    if space < N:
        raise ValueError(f"seq_len {seq_len} is too short for {N} key-value pairs and their "
                         f"queries; it needs at least {4 * N - 1} tokens.")
    g = generator
    keys = torch.rand(n, half - 1, generator=g).argsort(dim=1)[:, :N] + 1      # distinct, no 0
    values = torch.randint(half, vocab_size, (n, N), generator=g)
    seq = torch.randint(1, vocab_size, (n, total), generator=g)              # filler tokens
    seq[:, 0:2 * N:2] = keys
    seq[:, 1:2 * N:2] = values
    x = torch.arange(1, space + 1, dtype=torch.float64)
    p = power_a * x ** (power_a - 1)
    slots = torch.multinomial((p / p.sum()).float().expand(n, space), N, replacement=False,
                              generator=g)
    qpos = 2 * N + 2 * slots                                                 # (n, N)
    rows = torch.arange(n)[:, None]
    seq[rows, qpos] = keys
    seq[rows, qpos + 1] = values
    inputs, targets = seq[:, :-1], torch.full((n, seq_len), -1, dtype=torch.long)
    targets[rows, qpos] = values
    return inputs, targets


def mqar_bytes(n: int, vocab_size: int, seq_len: int) -> int:
    """Peak memory of ``mqar_batch(n, ...)``: the random keys' sort (float32 draws and int64
    order over half the vocabulary per sequence) plus the inputs and targets it returns."""
    return n * (vocab_size // 2) * 12 + n * (seq_len + 1) * 8 * 3


def mqar_mixed_batch(n: int, vocab_size: int, seq_len: int, kv_pairs: list[int],
                     power_a: float = 0.01, generator: torch.Generator | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences split evenly among the pair counts in ``kv_pairs`` (the first ones get
    one more when ``n`` does not divide), in that order, all ``seq_len`` long: a training set
    that mixes easy and hard recall, as Zoology trains. Shuffling is the caller's."""
    if not kv_pairs:
        raise ValueError("kv_pairs is empty: give at least one pair count.")
    share, extra = divmod(n, len(kv_pairs))
    parts = [mqar_batch(share + (i < extra), vocab_size, seq_len, N, power_a, generator)
             for i, N in enumerate(kv_pairs)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


@torch.no_grad()
def query_hits(model, inputs: torch.Tensor, targets: torch.Tensor,
               batch_size: int = 64) -> torch.Tensor:
    """Whether the model's most likely next token is the value, for every query, in the order
    of ``targets[targets >= 0]``. The output layer is applied at the query positions only,
    through the model's forward (so a sharded FSDP model gathers its weights as in training)."""
    was_training = model.training
    model.eval()
    hits = []
    with torch.no_grad():
        for i in range(0, len(inputs), batch_size):
            x, y = inputs[i:i + batch_size], targets[i:i + batch_size]
            logits, _ = model(x, y, targets_only=True)
            hits.append((logits.argmax(-1) == y[y >= 0]).cpu())
    model.train(was_training)
    return torch.cat(hits) if hits else torch.zeros(0, dtype=torch.bool)


def recall_accuracy(model, inputs: torch.Tensor, targets: torch.Tensor,
                    batch_size: int = 64) -> float:
    """Share of queries answered with their value (greedy); a LanguageModel in, 0..1 out."""
    hits = query_hits(model, inputs, targets, batch_size)
    return hits.float().mean().item() if len(hits) else 0.0


def query_distances(inputs: torch.Tensor, targets: torch.Tensor,
                    num_kv_pairs: int) -> torch.Tensor:
    """How many positions each query lies after its key in the key-value pairs at the start,
    in the order of ``targets[targets >= 0]``."""
    rows, pos = (targets >= 0).nonzero(as_tuple=True)
    keys = inputs[rows, pos]
    pair_keys = inputs[rows, 0:2 * num_kv_pairs:2]                 # (queries, num_kv_pairs)
    match = pair_keys == keys[:, None]
    if not match.any(1).all():
        raise ValueError("a query key does not appear among the key-value pairs at the start of "
                         "its sequence: these are not MQAR sequences with num_kv_pairs = "
                         f"{num_kv_pairs}.")
    return pos - 2 * match.int().argmax(1)
