"""Conversion methods for GQA / MQA: how K/V heads merge when there are fewer of them.

Notation. Source KV head g serves the P = H / H_kv query heads g*P ... (g+1)*P - 1. S = sum_t x~ x~^T over the
calibration inputs, x~ = [x; 1] (calibration.py), so for augmented rows A = [W b], B: E[(A x~)(B x~)^H] ∝ A S B^H.
Each head splits into blocks (module-internal, float64):
- K, one complex dim per RoPE frequency i: pair (i, i + d_rot/2) read as a + ib. RoPE multiplies it by
  e^{i theta_i t}, so a complex scalar on a key block, undone conjugately on its queries, commutes with RoPE.
- K, one real block of the non-RoPE dims (partial rotary, or every dim without RoPE): any linear map is allowed.
- V, one real block of d_h dims: any linear map, absorbed into o_proj.
A block's consumers read Re(c^H k): query rows for K (score q^H k), o_proj columns for V (O_h v = (O_h^T)^H v).

Methods (each group of source KV heads becomes one KV head):
- `mean` (Ainslie et al. 2023, the GQA paper's baseline): K and V rows of each group of consecutive heads averaged;
  queries and o_proj kept; groups by index.
- `aligned` (after "Align attention heads before merging them", arXiv 2412.20677): per block, each head is rotated
  onto the group's first head by orthogonal Procrustes on calibration activations (polar factor of k_j S k_0^H: a
  phase per RoPE frequency, an orthogonal map on the others), then the group is averaged.
- `pca`: per block, consumer-weighted PCA of the group's heads. Head g is whitened by the metric of what reads it,
  M_g = sum over its consumers h of E[c_h c_h^H] (K: query block, E over tokens; V: O_h^T O_h; plus 1e-6 of its
  mean diagonal); the merged block is the top n_b principal components of the stacked whitened heads:
  k^ = E^H [M_g^1/2 k_g]_g, E the top n_b eigenvectors of their covariance (dimension G * n_b).
  For a RoPE frequency (n_b = 1, M_g = w_g = sum_h E|q_h,i|^2) that is k^ = sum_g conj(d_g) sqrt(w_g) k_g with d the
  top eigenvector of W^1/2 C W^1/2, C[g, g'] = E[k_g conj(k_g')].
Consumer refit (`aligned` with refit=True; `pca` always): least-squares regression of each source head's block on
the merged block, k_g ~ R_g k^, R_g = E[k_g k^H] (E[k^ k^H] + ridge)^-1; consumers c'_h = R_g^H c_h, i.e. queries
q'_h = R_g^H q_h and o_proj O'_h = O_h R_g. On a RoPE frequency R_g is one complex scalar (commutes with RoPE) and
minimizes E_{t,s}|conj(q') k^ - conj(q) k_g|^2 over independent query / key tokens; on real blocks any metric gives
the same unconstrained optimum. Without refit, `aligned` absorbs its own rotations (k_g ~ R_g k^ with R_g unitary).
Biases ride in the augmented rows: query biases transform with their rows, merged K / V rows carry merged biases
(none when the source has none); with an o_proj bias the mean output error of the V refit is folded into it.
Exactness (tested): when each head of a group is its first head times a complex scalar per RoPE frequency and an
invertible linear map on the other K dims and on V, `pca` reproduces the source; so does `aligned` with refit
(the average is then, generically, an invertible map of the first head); without refit `aligned` needs rotations.

Regrouping (`aligned` and `pca`, regroup=True; choose_groups): the source KV heads are partitioned into equal groups
by how much consumer-weighted energy the PCA merge of each group retains, not by index. A group loses the eigenvalues
PCA drops, per block (RoPE blocks count 1/2: the phase average of Re^2); K and V losses are each divided by the
layer's total K / V energy, so they count equally, and the partition's score is the summed loss. Every equal-size
partition is tried when there are at most 2000, else groups grow greedily from the lowest free head. The partition
by index is kept unless the best loses 1e-6 less (so planted-by-index and identity cases stay as they are).
Regrouping is exact in itself: the query heads (rows, bias) and o_proj columns that read source head g move with
it, so new KV head j serves query heads j*H/kv ... (j+1)*H/kv - 1. The score is a proxy of the model's loss: on
stories260k (4 -> 2 KV heads) it lowered the KL of `aligned` and raised that of `pca` (tests/test_gqa_merge.py).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ...models.architectures import AttentionShape, AttentionWeights
from ..io.calibration import LayerStats
from .gqa_blocks import Block, join_rope, split_rope
from .mla_lift import with_bias_column

GQA_METHODS = ("pca", "aligned", "mean")  # the first is the default: best measured (BENCHMARKS.md, README)
_REGROUP_TOLERANCE = 1e-6  # retained-energy fraction another partition must gain over the one by index
_MAX_PARTITIONS = 2000  # enumerate every equal-size partition up to this many, else build groups greedily


def mean_pool(w: AttentionWeights, shape: AttentionShape, kv_heads: int) -> dict[str, torch.Tensor]:
    """GroupedQueryAttention state dict with each group's K/V heads averaged into one (groups of consecutive heads)."""
    d_h = shape.head_dim
    source_kv = w.k_w.shape[0] // d_h
    if source_kv % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide the source's {source_kv} KV heads")
    merge = source_kv // kv_heads

    def pool(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.view(kv_heads, merge, d_h, *t.shape[1:]).mean(1).reshape(-1, *t.shape[1:])

    pooled = AttentionWeights(
        w.q_w, pool(w.k_w), pool(w.v_w), w.o_w, w.q_b, pool(w.k_b), pool(w.v_b), w.o_b, w.scaling, w.q_norm, w.k_norm
    )
    return pooled.gqa_state_dict()


def gqa_layer(
    method: str,
    w: AttentionWeights,
    shape: AttentionShape,
    kv_heads: int,
    stats: LayerStats | None = None,
    *,
    regroup: bool = True,
    refit: bool = True,
) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """(GroupedQueryAttention state dict, groups) of one layer merged to kv_heads KV heads by `method`.

    groups[j]: the source KV heads merged into new KV head j (sorted; new KV head j serves query heads
    j*H/kv_heads ... (j+1)*H/kv_heads - 1). `mean` ignores stats, regroup and refit (groups by index, the baseline);
    `pca` always refits; `aligned` and `pca` need the layer's calibration stats.
    """
    if method not in GQA_METHODS:
        raise ValueError(f"method={method!r} is not one of {GQA_METHODS}")
    source_kv = _check(w, shape, kv_heads, method)
    if method == "mean":
        return mean_pool(w, shape, kv_heads), _by_index(source_kv, kv_heads)
    if stats is None:
        raise ValueError(f"method={method!r} needs calibration stats (stats=None)")
    layer = _Layer.of(w, shape, stats)
    groups = layer.choose(kv_heads) if regroup else _by_index(source_kv, kv_heads)
    return layer.merged(groups, method, refit, w), groups


def choose_groups(w: AttentionWeights, shape: AttentionShape, kv_heads: int, stats: LayerStats) -> list[list[int]]:
    """Partition of the source KV heads into kv_heads equal groups retaining the most consumer-weighted energy
    under the PCA merge (see _Layer.choose); the partition by index unless another is measurably better."""
    _check(w, shape, kv_heads, "pca")
    return _Layer.of(w, shape, stats).choose(kv_heads)


def _check(w: AttentionWeights, shape: AttentionShape, kv_heads: int, method: str) -> int:
    """The source's KV head count, after refusing impossible requests."""
    source_kv = w.k_w.shape[0] // shape.head_dim
    if not isinstance(kv_heads, int) or kv_heads < 1 or source_kv % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide the source's {source_kv} KV heads")
    if method != "mean" and w.q_norm is not None:
        raise ValueError(f"{method} pooling with per-head q/k norms (qwen3) is not supported: use method='mean'")
    return source_kv


def _by_index(source_kv: int, kv_heads: int) -> list[list[int]]:
    merge = source_kv // kv_heads
    return [list(range(j * merge, (j + 1) * merge)) for j in range(kv_heads)]


@dataclass
class _Layer:
    """One layer in blocks: K blocks (RoPE frequencies, then the non-RoPE dims), then the V block."""

    blocks: list[Block]
    half: int  # RoPE frequencies per head
    per_kv: int  # query heads per source KV head
    cov: torch.Tensor  # S [D+1, D+1]

    @classmethod
    def of(cls, w: AttentionWeights, shape: AttentionShape, stats: LayerStats) -> "_Layer":
        d_h = shape.head_dim
        heads, source_kv = w.q_w.shape[0] // d_h, w.k_w.shape[0] // d_h
        half = shape.half
        cov = stats.input_cov.to(torch.float64)
        if cov.shape != (w.q_w.shape[1] + 1,) * 2:
            needs = (w.q_w.shape[1] + 1,) * 2
            raise ValueError(f"stats.input_cov has shape {tuple(cov.shape)}: this layer needs {needs}")
        q = with_bias_column(w.q_w, w.q_b).view(heads, d_h, -1)
        k = with_bias_column(w.k_w, w.k_b).view(source_kv, d_h, -1)
        v = with_bias_column(w.v_w, w.v_b).view(source_kv, d_h, -1)
        o_t = w.o_w.to(torch.float64).view(-1, heads, d_h).permute(1, 2, 0)  # [H, d_h, D]: O_h^T
        cov_c = cov.to(torch.complex128) if half else None  # one copy shared by the RoPE blocks
        blocks = [
            Block.of("k", kb, qb, True, cov_c if kb.is_complex() else cov)
            for kb, qb in zip(split_rope(k, half), split_rope(q, half))
        ]
        blocks.append(Block.of("v", v, o_t, False, cov))
        return cls(blocks, half, heads // source_kv, cov)

    def loss(self, group) -> float:
        """Share of the layer's consumer-weighted energy the PCA merge of `group` loses: (K share + V share) / 2."""
        lost, total = {"k": 0.0, "v": 0.0}, {"k": 0.0, "v": 0.0}
        for b in self.blocks:
            _, e = b.principal(group)
            lost[b.family] += b.weight * float(e[: -b.rows.shape[1]].sum())
            total[b.family] += b.weight * float(torch.diagonal(b.gram).real.sum())  # every head: the layer's total
        return sum(lost[f] / max(total[f], 1e-300) for f in lost) / 2

    def choose(self, kv_heads: int) -> list[list[int]]:
        """Equal groups minimizing the summed loss: every partition when there are at most _MAX_PARTITIONS, else
        greedily (grow a group from the lowest unassigned head by the head that loses least). The partition by index
        is kept unless the best retains _REGROUP_TOLERANCE more of the energy."""
        source_kv = self.blocks[0].rows.shape[0]
        merge = source_kv // kv_heads
        by_index = _by_index(source_kv, kv_heads)
        if merge == 1 or kv_heads == 1:
            return by_index
        loss = lru_cache(maxsize=None)(self.loss)  # groups as sorted tuples

        def total(partition) -> float:
            return sum(loss(tuple(g)) for g in partition)

        if _partition_count(source_kv, merge) <= _MAX_PARTITIONS:
            best = min(_partitions(tuple(range(source_kv)), merge), key=total)
        else:
            best, free = [], list(range(source_kv))
            while free:
                group = (free.pop(0),)
                while len(group) < merge:
                    pick = min(free, key=lambda h: loss(tuple(sorted(group + (h,)))))
                    free.remove(pick)
                    group = tuple(sorted(group + (pick,)))
                best.append(group)
        if total(by_index) <= total(best) + _REGROUP_TOLERANCE:
            return by_index
        return sorted(sorted(g) for g in best)

    def merged(self, groups: list[list[int]], method: str, refit: bool, w: AttentionWeights) -> dict[str, torch.Tensor]:
        """State dict of the merge: new KV head j = groups[j]; query heads and o_proj columns follow their KV head."""
        p = self.per_kv
        new_blocks, new_consumers = [], []
        for b in self.blocks:
            consumers, merged = b.consumers.clone(), []
            for group in groups:
                rows, maps = b.merge(group, method, refit)
                merged.append(rows)
                for g, r in zip(group, maps):
                    consumers[g * p : (g + 1) * p] = r.mH @ b.consumers[g * p : (g + 1) * p]
            new_blocks.append(torch.stack(merged))
            new_consumers.append(consumers)
        order = [h for group in groups for g in group for h in range(g * p, (g + 1) * p)]
        k, v = join_rope(new_blocks[:-1], self.half), new_blocks[-1]  # [kv, d_h, D+1]
        q = join_rope(new_consumers[:-1], self.half)[order]  # [H, d_h, D+1]
        o_t = new_consumers[-1]  # [H, d_h, D], original head order
        o_b = w.o_b
        if o_b is not None and (refit or method == "pca"):
            o_b = o_b.to(torch.float64) + self._mean_output_error(groups, v, o_t)
        dtype, heads = w.q_w.dtype, len(order)

        def weight(aug: torch.Tensor) -> torch.Tensor:
            return aug.reshape(-1, aug.shape[-1])[:, :-1].to(dtype)

        def bias(aug: torch.Tensor, source_bias) -> torch.Tensor | None:
            return None if source_bias is None else aug.reshape(-1, aug.shape[-1])[:, -1].to(dtype)

        out = AttentionWeights(
            weight(q),
            weight(k),
            weight(v),
            o_t[order].permute(2, 0, 1).reshape(-1, heads * o_t.shape[1]).to(dtype),
            bias(q, w.q_b),
            bias(k, w.k_b),
            bias(v, w.v_b),
            None if o_b is None else o_b.to(dtype),
            w.scaling,
        )
        return out.gqa_state_dict()

    def _mean_output_error(self, groups, v_new: torch.Tensor, o_t_new: torch.Tensor) -> torch.Tensor:
        """[D]: sum_h E[O_h v_g(h) - O'_h v^_j(h)] over calibration inputs (E[x~] = S[:, -1] / S[-1, -1])."""
        mean_x = self.cov[:, -1] / self.cov[-1, -1]
        source = self.blocks[-1]
        new_of = {g: j for j, group in enumerate(groups) for g in group}
        error = torch.zeros(o_t_new.shape[-1], dtype=torch.float64)
        for h in range(len(o_t_new)):
            g = h // self.per_kv
            error += source.consumers[h].t() @ (source.rows[g] @ mean_x) - o_t_new[h].t() @ (v_new[new_of[g]] @ mean_x)
        return error


def _partition_count(n: int, size: int) -> int:
    """Partitions of n items into n / size unordered groups of `size`."""
    return math.factorial(n) // (math.factorial(size) ** (n // size) * math.factorial(n // size))


def _partitions(items: tuple[int, ...], size: int):
    """Every partition of `items` into groups of `size` (each group a sorted tuple led by its lowest item)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        remaining = tuple(h for h in rest if h not in others)
        for tail in _partitions(remaining, size):
            yield [(first, *others), *tail]
