"""One block of a layer's KV heads for the GQA merges (gqa_merge.py): the rows of every source KV head in one RoPE
frequency (complex) or in the non-RoPE dims (real), whitened by what their consumers (query heads, o_proj columns)
read, and the merges of a group of heads within it (principal directions, or Procrustes-aligned means) with the
refit maps back to each head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

METRIC_FLOOR = 1e-6  # added to consumer metrics (times their mean diagonal): heads nobody reads still count a little
RIDGE = 1e-9  # ridge of the refit regressions (times the mean diagonal of E[k^ k^H]): numerical only


@dataclass
class Block:
    """One block of every source KV head and its consumers (float64; complex for a RoPE frequency).

    rows [H_kv, n, D+1] (augmented [W b]); consumers [H, n, m] (query rows, m = D+1, or o_proj columns transposed,
    m = D); whitened [H_kv*n, D+1] = rows_g premultiplied by M_g^1/2; gram = whitened S whitened^H; cov: S in the
    block's dtype;
    weight: share of a block's energy in the score (1/2 on a RoPE frequency: the phase average of Re^2 of a complex
    product; 1 on real dims).
    """

    family: str  # "k" or "v"
    rows: torch.Tensor
    consumers: torch.Tensor
    whitened: torch.Tensor
    gram: torch.Tensor
    cov: torch.Tensor
    weight: float

    @classmethod
    def of(cls, family: str, rows, consumers, consumers_read_inputs: bool, cov) -> "Block":
        """M_g = sum over g's consumers of c_h Sigma c_h^H (+ METRIC_FLOOR); Sigma = S for consumers reading the
        inputs (queries), the identity otherwise (o_proj columns)."""
        kv, n, _ = rows.shape
        cov = cov.to(rows.dtype)  # no copy when it is already
        read = consumers @ cov if consumers_read_inputs else consumers
        metric = (read @ consumers.mH).view(kv, -1, n, n).sum(1)
        floor = METRIC_FLOOR * metric.diagonal(dim1=-2, dim2=-1).real.mean() + 1e-300
        metric = metric + floor * torch.eye(n, dtype=metric.dtype)
        e, u = torch.linalg.eigh(metric)
        root = (u * e.clamp_min(0).sqrt()[..., None, :].to(u.dtype)) @ u.mH
        whitened = (root @ rows).reshape(kv * n, -1)
        gram = whitened @ cov @ whitened.mH
        return cls(family, rows, consumers, whitened, gram, cov, 0.5 if rows.is_complex() else 1.0)

    def span(self, group) -> list[int]:
        """Rows of whitened / gram that belong to the heads of `group`."""
        n = self.rows.shape[1]
        return [g * n + d for g in group for d in range(n)]

    def principal(self, group) -> tuple[torch.Tensor, torch.Tensor]:
        """(top n principal directions [G*n, n] of the group's whitened block, all eigenvalues ascending)."""
        idx = self.span(group)
        e, u = torch.linalg.eigh(self.gram[idx][:, idx])
        return u[:, -self.rows.shape[1] :], e

    def merge(self, group, method: str, refit: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(merged rows [n, D+1], back maps R_g [n, n] with k_g ~ R_g k^ for each head of the group)."""
        rows = self.rows[list(group)]
        if method == "pca":
            directions, _ = self.principal(group)
            merged = directions.mH @ self.whitened[self.span(group)]
            # The whitening sets each merged row's scale (sqrt of its consumers' energy). Bring every row to the
            # group's mean row energy, so healing's per-weight steps meet weights of the source's size; the refit
            # below absorbs any scale exactly.
            target = (rows @ self.cov @ rows.mH).diagonal(dim1=-2, dim2=-1).real.mean()
            energy = (merged @ self.cov @ merged.mH).diagonal().real
            merged = merged * (target / energy.clamp_min(1e-300)).sqrt()[:, None].to(merged.dtype)
        else:  # aligned: polar factor R_j of k_j S k_0^H, aligned rows R_j^H k_j, averaged
            turns = [torch.eye(rows.shape[1], dtype=rows.dtype)] + [polar(r @ self.cov @ rows[0].mH) for r in rows[1:]]
            merged = torch.stack([t.mH @ r for t, r in zip(turns, rows)]).mean(0)
            if not refit:
                return merged, turns
        return merged, [regression(r, merged, self.cov) for r in rows]


def split_rope(rows: torch.Tensor, half: int) -> list[torch.Tensor]:
    """[N, d_h, m] -> blocks: [N, 1, m] complex per RoPE frequency (dim i + i * dim i + half), then [N, n, m] real
    non-RoPE dims (if any)."""
    blocks = [torch.complex(rows[:, i], rows[:, i + half])[:, None] for i in range(half)]
    return blocks + ([rows[:, 2 * half :]] if rows.shape[1] > 2 * half else [])


def join_rope(blocks: list[torch.Tensor], half: int) -> torch.Tensor:
    """Inverse of split_rope: [N, d_h, m] real."""
    complex_part = torch.cat(blocks[:half], dim=1) if half else None
    parts = [complex_part.real, complex_part.imag] if half else []
    return torch.cat(parts + blocks[half:], dim=1)


def polar(m: torch.Tensor) -> torch.Tensor:
    """Unitary R maximizing Re tr(R^H m) (U V^H of svd(m)); m = A S B^H makes R^H A the Procrustes fit of B."""
    u, _, vh = torch.linalg.svd(m)
    return u @ vh


def regression(source: torch.Tensor, merged: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """R [n, n] minimizing E|source x~ - R merged x~|^2: E[k k^H] (E[k^ k^H] + ridge)^-1 (rows [n, D+1]; cov: S
    in their dtype)."""
    cross, auto = source @ cov @ merged.mH, merged @ cov @ merged.mH
    ridge = RIDGE * auto.diagonal().real.mean() + 1e-300
    return torch.linalg.solve(auto + ridge * torch.eye(len(auto), dtype=auto.dtype), cross.mH).mH
