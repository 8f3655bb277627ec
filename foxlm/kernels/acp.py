"""Adaptive Computation Pruning (fox-reference.md §5): the score bound U and the pruned-fraction statistics.

The kernels skip a (query block, key block) tile when its largest decay bias `c_i0 - c_j1` is below
`delta = log eps - 2U - log L`; then every query loses at most `eps` of its attention mass, so the output moves by at
most `2 eps max|v|`. U must bound `|sm_scale q_i.k_j|` for every pair: from the QK-norm scales (the model passes
them) or measured here from the largest norms of q and k.
"""

import contextlib
import math

import torch

try:
    from .triton_attention import _INTERPRET, triton_max_square_norms
except ImportError:  # no Triton: the torch formula below
    triton_max_square_norms, _INTERPRET = None, False

DEFAULT_EPS = math.exp(-10)  # the paper's recommended tolerance (log eps = -10)
_active_stats = []


def max_square_norms(q, k):
    """(max_t |q_t|^2 per (batch, head), the same for k) in fp32, NaN counted as +inf: on a GPU one Triton reduction
    that reads q and k once (the torch formula, used elsewhere, writes per-token norms and took 3-5x its GPU time on
    an H100 at 16k), on CPU tensors the torch formula."""
    if triton_max_square_norms is not None and (q.is_cuda or _INTERPRET):
        return triton_max_square_norms(q, k)
    return tuple(torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).nan_to_num(nan=float("inf")).amax(1)
                 .square() for x in (q, k))


def measured_score_bound(q, k, sm_scale):
    """U = sm_scale * max_t |q_t| * max_t |k_t| per (batch, query head), by Cauchy-Schwarz; on the device, no sync.
    NaN in q or k gives U = inf: nothing is pruned, so the NaN shows in the output as without pruning."""
    B, _, Hq, _ = q.shape
    q_square, k_square = max_square_norms(q, k)
    return (q_square.view(B, k.shape[2], -1) * k_square[:, :, None]).sqrt_().view(B, Hq) * sm_scale


class PruningStats:
    """What the forward kernels pruned inside an `acp_statistics()` block: one entry per pruned Triton call (in call
    order, so per layer for one model forward), each a (query heads, 2) int64 tensor of (skipped, visible) causal
    (query, key) pairs. Reading a fraction synchronises with the device; recording does not."""

    def __init__(self):
        self.calls = []

    def record(self, counts):
        self.calls.append(counts.sum(dim=(0, 2), dtype=torch.int64))

    def per_call(self):
        """Pruned fraction per call and head: a list of (query heads,) float tensors."""
        return [c[:, 0].double() / c[:, 1].clamp_min(1) for c in self.calls]

    @property
    def pruned_fraction(self):
        """Skipped over visible (query, key) pairs, all calls and heads together (0.0 if nothing was recorded)."""
        if not self.calls:
            return 0.0
        skipped, visible = torch.stack(self.calls).sum(dim=(0, 1)).tolist()
        return skipped / max(visible, 1)


@contextlib.contextmanager
def acp_statistics():
    """Record the pruned fraction of every pruned `forgetting_attention` call (Triton path) inside the block:

        with acp_statistics() as stats:
            model(input_ids)
        print(stats.pruned_fraction, stats.per_call())

    Outside such a block the kernels count nothing (the counting is a compile-time branch of the kernel)."""
    stats = PruningStats()
    _active_stats.append(stats)
    try:
        yield stats
    finally:
        _active_stats.remove(stats)


def recording_pruned_counts():
    return bool(_active_stats)


def record_pruned_counts(counts):
    for stats in _active_stats:
        stats.record(counts)
