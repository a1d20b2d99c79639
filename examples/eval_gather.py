"""Evaluation with variable-length predictions: gather them from every rank, no padding, no duplicates.

Each rank evaluates its own slice of a validation set whose size the world does
not divide (here 11 samples), so ranks hold different numbers of samples, and
every sample's prediction is a sequence of its own length (generated tokens).
The usual recipes pad to the longest rank and the longest sequence, gather,
then strip the padding (and with a padded sampler, drop the duplicated samples
at the end). funcoll gathers the ragged pieces as they are:

- ``funcoll.gather(scores)``: every rank's per-sample scores, concatenated in rank order;
- ``funcoll.all_gather_list(tokens)``: every rank's generated tokens (flat), one tensor per rank;
- ``funcoll.gather(lengths)``: each sample's length, to split the flat tokens back into sequences.

Every rank then computes the metrics over the whole validation set, and the
program checks them (and every gathered sequence) against one process that
evaluates all samples. It exits non-zero on a mismatch.

Run it on ranks it starts itself (gloo, CPU), as the test suite does
(``tests/test_examples_dir.py`` calls :func:`run` through ``funcoll.testing.run_ranks``)::

    python examples/eval_gather.py --world 3

or under a launcher, one process per rank::

    torchrun --nproc-per-node 3 examples/eval_gather.py
"""

from __future__ import annotations

import argparse
import sys

import torch

import funcoll
from funcoll.testing import launch, print_ranks

N_SAMPLES, VOCAB = 11, 50


def predict(sample: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A stand-in model: sample `sample`'s score, generated tokens (1 to 6 of them) and label."""
    gen = torch.Generator().manual_seed(sample)
    score = torch.rand((), generator=gen)
    tokens = torch.randint(VOCAB, (1 + sample % 6,), generator=gen)
    return score, tokens, int(torch.randint(2, (), generator=gen))


def metrics(scores: torch.Tensor, labels: torch.Tensor, sequences: list[torch.Tensor]) -> dict[str, float]:
    return {
        "accuracy": ((scores > 0.5).long() == labels).double().mean().item(),
        "mean_length": sum(len(s) for s in sequences) / len(sequences),
        "distinct_tokens": float(len(torch.cat(sequences).unique())),
    }


def run(rank: int, world: int) -> dict[str, float]:
    """One rank's part: evaluate this rank's samples, gather, compute the metrics, check them.

    Returns the metrics; raises ``AssertionError`` on a mismatch.
    """
    mine = torch.arange(N_SAMPLES).tensor_split(world)[rank].tolist()  # a CPU tensor: no device sync
    with torch.no_grad():
        preds = [predict(i) for i in mine]
        scores = torch.stack([p[0] for p in preds]) if preds else torch.empty(0)
        labels = torch.tensor([p[2] for p in preds], dtype=torch.long)
        lengths = torch.tensor([len(p[1]) for p in preds], dtype=torch.long)
        tokens = torch.cat([p[1] for p in preds]) if preds else torch.empty(0, dtype=torch.long)

        all_scores = funcoll.gather(scores)  # (N_SAMPLES,): rank 0's samples first
        all_labels = funcoll.gather(labels)
        all_lengths = funcoll.gather(lengths)
        per_rank_tokens = funcoll.all_gather_list(tokens)  # one flat tensor per rank
        sequences = list(torch.cat(per_rank_tokens).split(all_lengths.tolist()))  # CPU: no device sync
        got = metrics(all_scores, all_labels, sequences)

    # The single-process reference: every sample evaluated in one place.
    ref = [predict(i) for i in range(N_SAMPLES)]
    torch.testing.assert_close(all_scores, torch.stack([p[0] for p in ref]))
    assert len(sequences) == N_SAMPLES and all(
        torch.equal(s, p[1]) for s, p in zip(sequences, ref, strict=True)
    )
    want = metrics(torch.stack([p[0] for p in ref]), torch.tensor([p[2] for p in ref]), [p[1] for p in ref])
    assert got == want, (got, want)
    print_ranks(f"rank {rank}: evaluated {len(mine)} of {N_SAMPLES} samples; every rank has {got}")
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--world", type=int, default=3, help="ranks to start (ignored under torchrun)")
    args = parser.parse_args()
    return launch(run, args.world, timeout=120)


if __name__ == "__main__":
    sys.exit(main())
