#!/usr/bin/env python
"""How often does the suite's chi-square check fail a correct service?

Draws samples of the size ``tests/test_combinations.py`` sends (1,500 requests) from the exact
distribution of each of its sampled mixes (enumerated on the suite's tiny models, built here in a
temporary directory), many times over, and computes each sample's p-value as
``tests/spec_oracle.chi_square_pvalue`` does (outcomes expected fewer than 5 times pooled into one
bin). Prints, per mix and threshold, how often p fell below the threshold and that share over the
threshold: 1.0x where the chi-square approximation is exact, more where its tail is heavier than
nominal. Run from the repository root (it imports ``tests``)::

    .venv/bin/python scripts/chi_square_tail.py --reps 2000000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.spec_oracle import PASS_P, PLANTED_P, POOL_BELOW, Enumerator
from tests.test_combinations import FIRST, MIXES, SAMPLES, prepared, sampled_request
from tests.tiny_models import build_tiny_models

THRESHOLDS = (1e-3, 1e-4, PASS_P, PLANTED_P)


def pooled_pvalues(draws: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """The p-value ``tests/spec_oracle.chi_square_pvalue`` gives each row of ``draws`` (counts of
    the outcomes ``probs`` gives the probabilities of), for many rows at once."""
    n = int(draws[0].sum())
    own = probs * n >= POOL_BELOW
    observed, expected = draws[:, own], probs[own] * n
    if (~own).any():
        observed = np.concatenate([observed, draws[:, ~own].sum(1, keepdims=True)], axis=1)
        expected = np.append(expected, probs[~own].sum() * n)
    return stats.chi2.sf(((observed - expected) ** 2 / expected).sum(1), len(expected) - 1)


def tail_shares(probs: np.ndarray, n: int, reps: int, rng: np.random.Generator) -> dict[float, float]:
    """The share of ``reps`` samples of ``n`` draws from ``probs`` whose p-value falls below each
    threshold."""
    below = dict.fromkeys(THRESHOLDS, 0)
    for start in range(0, reps, 100_000):
        p = pooled_pvalues(rng.multinomial(n, probs, size=min(100_000, reps - start)), probs)
        for threshold in THRESHOLDS:
            below[threshold] += int((p < threshold).sum())
    return {threshold: count / reps for threshold, count in below.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2_000_000, help="samples simulated per mix")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as root:
        models = build_tiny_models(Path(root))
        enumerator = Enumerator(str(models.target), FIRST)
        for name, mix in MIXES.items():
            mix, context = prepared(mix, enumerator)
            exact = enumerator.distribution(context, sampled_request(mix, 0).sampling)
            probs = np.array(list(exact.values()))
            shares = tail_shares(probs / probs.sum(), SAMPLES, args.reps, rng)
            cells = " ".join(f"p<{t:g}: {s:.1e} ({s / t:.1f}x)" for t, s in shares.items())
            sys.stdout.write(f"{name} ({args.reps} samples of {SAMPLES}): {cells}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
