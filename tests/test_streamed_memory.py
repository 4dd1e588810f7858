"""convert()'s peak memory does not grow with depth: synthetic deep sources of random weights (built layer by layer
in a temporary folder), converted to MLA 50% in fresh subprocesses (ru_maxrss is per process) by
`scripts/bench_memory.py convert`, which reads the RSS floor after a warm-up conversion and the report's peak_rss_mb."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_memory import convert_measure as measure  # noqa: E402


def test_peak_memory_is_flat_in_depth_and_within_the_bound():
    width, depths = 256, (8, 32)
    shallow, deep = measure(list(depths), width, ["mla"], "default", printer=lambda line: None)
    # one layer's bytes: q, o [w, w], k, v [w/3 heads of 64, w] and the MLP 3 x [8w/3, w], fp32
    layer_mb = (2 * width * width + 2 * 64 * width + 3 * (width * 8 // 3) * width) * 4 / 2**20
    resident_mb = 512 * width * 4 / 2**20  # tied embeddings (vocab 512)
    rise = {row["layers"]: row["peak_rss_mb"] - row["floor_mb"] for row in (shallow, deep)}
    # the bound: the resident parts, the source and the converted layer with the closed form's temporaries (3
    # layers' worth), the carried activations (2 tracks x 2 buffers), and 16 MB for the allocator's and the
    # tokenizer's working memory (measured rise 18.5-21 MB at both depths)
    activations_mb = deep["activations"]["bytes"] / 2**20
    assert rise[32] < resident_mb + 3 * layer_mb + activations_mb + 16, (rise, layer_mb)
    assert rise[32] < 0.4 * deep["source_bytes"] / 2**20  # the whole source would be 100% (85 MB)
    assert rise[32] - rise[8] < 2 * layer_mb + 4, rise  # 24 more layers (65 MB): flat within allocator noise
