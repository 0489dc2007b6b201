"""Exact evaluation metrics: AUC (ties counted as half), logloss and RMSE, each optionally
weighted by the rows' importance weights (``weights``, None: every row's 1) as scikit-learn's
``roc_auc_score``, ``log_loss`` and ``root_mean_squared_error`` weigh them with ``sample_weight``."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from .keys import radix_argsort


def auc(labels, scores, weights=None) -> float:
    """Exact ROC AUC: P(score of a positive > score of a negative) + 0.5 P(tie).

    Labels > 0.5 count as positives. Returns NaN when one class is missing (or weighs nothing);
    a NaN score is an error. Scores are sorted by a radix sort of their bits (mapped to keep float
    order). With ``weights``, a pair counts the product of its rows' weights: the area under the
    weighted ROC curve, which is scikit-learn's ``roc_auc_score(sample_weight=weights)``.
    """
    scores = np.ascontiguousarray(scores, dtype=np.float64) + 0.0  # + 0.0 turns -0.0 into 0.0
    if np.isnan(scores).any():
        raise ValueError("auc: a score is NaN")
    if weights is not None:
        weights = np.ascontiguousarray(weights, dtype=np.float64)
    return float(_auc(np.asarray(labels), scores, scores.view(np.uint64), weights))


@njit(cache=True)
def _auc(labels, scores, bits, weights):
    n = scores.shape[0]
    sortable = np.empty(n, dtype=np.uint64)
    sign = np.uint64(1) << np.uint64(63)
    for i in range(n):
        u = bits[i]
        sortable[i] = ~u if u & sign else u | sign  # order-preserving map of floats to uint64
    sk, order = radix_argsort(sortable)
    lab = np.empty(n, dtype=np.bool_)
    pos_total = 0.0
    neg_total = 0.0
    for i in range(n):
        lab[i] = labels[order[i]] > 0.5
        if lab[i]:
            pos_total += 1.0 if weights is None else weights[order[i]]
        elif weights is not None:
            neg_total += weights[order[i]]
    if weights is None:
        neg_total = n - pos_total
    if pos_total == 0.0 or neg_total == 0.0:
        return np.nan
    # Walk groups of equal score from the lowest; count (pos, neg) pairs with neg below.
    neg_below = 0.0
    pairs = 0.0
    i = 0
    while i < n:
        j = i
        p = 0.0
        q = 0.0
        while j < n and sk[j] == sk[i]:  # equal bits = equal scores (no NaN, no -0.0)
            wj = 1.0 if weights is None else weights[order[j]]
            if lab[j]:
                p += wj
            else:
                q += wj
            j += 1
        pairs += p * neg_below + 0.5 * p * q
        neg_below += q
        i = j
    return pairs / (pos_total * neg_total)


@njit(cache=True)
def logloss_sum(labels, margins, weights=None):
    """Sum of the logistic losses of margins (logits), computed stably (each times its row's weight).

    softplus(m) = max(m, 0) + log1p(exp(-|m|)): the same two libm calls and the same result, bit
    for bit, as branching on the sign, without a branch that mispredicts on every other row (the
    signs of a model's margins are as random as its labels); twice as fast."""
    total = 0.0
    for i in range(labels.shape[0]):
        m = np.float64(margins[i])
        sp = (m if m > 0.0 else 0.0) + math.log1p(math.exp(-abs(m)))
        if weights is None:
            total += sp - labels[i] * m
        else:
            total += weights[i] * (sp - labels[i] * m)
    return total


def logloss(labels, margins, weights=None) -> float:
    """Mean logistic loss of margins (logits); with ``weights``, the weighted mean (their sum
    divides)."""
    labels, margins = np.asarray(labels), np.asarray(margins, dtype=np.float64)
    if weights is None:
        return np.float64(logloss_sum(labels, margins)) / max(len(labels), 1)
    weights = np.ascontiguousarray(weights, dtype=np.float64)
    return np.float64(logloss_sum(labels, margins, weights)) / weights.sum()


def rmse(labels, predictions, weights=None) -> float:
    """Root mean squared error; with ``weights``, of the weighted mean."""
    err = (np.asarray(predictions, dtype=np.float64) - np.asarray(labels, dtype=np.float64)) ** 2
    return float(np.sqrt(np.mean(err) if weights is None else np.average(err, weights=weights)))
