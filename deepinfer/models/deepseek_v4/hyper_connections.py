"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4.

The residual is `hc_mult` parallel streams [T, N, D]. Before each block a
learned projection of the flattened streams gives three weights: `pre`
collapses the streams into the block input, `post` spreads the block output
back over the streams, and `comb` mixes the old streams; `comb` is pushed
towards a doubly-stochastic matrix by Sinkhorn-Knopp so deep stacks stay
non-expansive. All of it runs in fp32 with fp32 parameters, as in the
reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps), the statistic in fp32, the product in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate column / row normalisation of [..., N, N]; column first, `iters` column passes.

    Matches the reference's order: one column pass, then (iters - 1) row+column passes.
    """
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """Computes (post [T, N], comb [T, N, N], collapsed block input [T, D])."""

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.n = hc_mult
        self.iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        width = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.zeros(width, hc_mult * hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(width, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.n
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = sinkhorn(comb, self.iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def hc_merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: post[n] * block_out + sum_j comb[j, n] * streams[j] (comb applied transposed)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


class HyperHead(nn.Module):
    """Final collapse of the streams into one hidden vector before the last norm."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.eps = hc_eps
        self.norm_eps = norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size, dtype=torch.float32), requires_grad=False)
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
