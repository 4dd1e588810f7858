"""Calibration: text in, per-layer activation statistics out (what activation-aware conversion needs).

Per stock attention layer, over all calibration tokens x (the attention input, after the layer norm):
    input covariance   S = sum_t x_t x_t^T  [D, D]          -> the covariance of any linear map's outputs: W S W^T
    pair energy        mean_t ||q_h,t[i, i + d_rot/2]||, mean_t ||k_g,t[i, i + d_rot/2]||  per head and RoPE pair
Pair norms are rotation invariant, so they need no positions. Nothing per token is kept.

Calibration windows are either consecutive windows of a text (`calibration_windows`) or samples of the source
model itself (`sample_from_teacher`: prompts cut from the text, continued at temperature 1 with nucleus top-p), which
follow the source's own distribution rather than the calibration text's domain.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ... import __file__ as _package_file
from ...compat import cache_kwarg, get_cache
from ...models.architectures import AttentionShape

logger = logging.getLogger(__name__)

# converters/ sits at the repository root but installs inside the package: find the assets from the package itself
ASSETS = Path(_package_file).resolve().parent / "assets"
DEFAULT_CORPUS = ASSETS / "calibration"
# Corpora shipped in the package, by the name --calib-data takes (each folder's LICENSE says what it is):
#   stories  a TinyStories sample: the default of a closed form on the embedded story models (one narrow domain);
#   general  WikiText-2 articles (encyclopedic text, ~200K SmolLM2 tokens): the default of --context long.
SHIPPED_CORPORA = {"stories": DEFAULT_CORPUS, "general": ASSETS / "general"}


@dataclass
class LayerStats:
    """Calibration statistics of one attention layer (float64)."""

    input_cov: torch.Tensor  # [D + 1, D + 1]: inputs with a constant 1 appended, so biases are covered too
    q_pair_norm: torch.Tensor  # [H, d_rot / 2] mean norm of each query head's RoPE pairs
    k_pair_norm: torch.Tensor  # [H_kv, d_rot / 2]
    tokens: int


DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
MAX_DATASET_CHARS = 50_000_000  # a dataset is read row by row until this much text: calibration needs far less


def read_calibration_text(source: str | Path | None, split: str = "train", column: str = "text") -> str:
    """Calibration text from `source`:
    - None: the package's default corpus ("stories"); a name of SHIPPED_CORPORA: that corpus;
    - a text file, or a folder of .txt files (sorted, joined by blank lines);
    - a `datasets` dataset: a folder written by save_to_disk, a .json/.jsonl/.parquet/.csv data file, or a dataset
      name on the Hub (reachable, or in the local datasets cache), "name" or "name:config"; rows of `column` in
      `split` joined by blank lines.
    """
    path = DEFAULT_CORPUS if source is None else SHIPPED_CORPORA.get(str(source), Path(source))
    if is_dataset_source(path):
        text = _dataset_text(str(path), split, column)
    elif path.is_dir():
        files = sorted(path.glob("*.txt"))
        if not files:
            raise ValueError(f"calib_data={str(path)!r} is a folder without .txt files or a saved dataset")
        text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    elif path.is_file():
        text = path.read_text(encoding="utf-8", errors="replace")
    else:
        raise ValueError(f"calib_data={str(path)!r} is neither a file, a folder nor a dataset name")
    if not text.strip():
        raise ValueError(f"calib_data={str(path)!r} is empty")
    return text


def is_dataset_source(source: str | Path) -> bool:
    """Whether read_calibration_text reads `source` with `datasets`: a save_to_disk folder, a data file
    (.json/.jsonl/.parquet/.csv) or a name that is no local path nor a shipped corpus."""
    if str(source) in SHIPPED_CORPORA:
        return False
    path = Path(source)
    if path.is_dir():
        return any((path / marker).exists() for marker in ("state.json", "dataset_dict.json"))
    if path.is_file():
        return path.suffix in DATA_FILE_BUILDERS
    return not path.is_absolute() and not str(source).startswith(".")


def _dataset_text(source: str, split: str, column: str) -> str:
    """Rows of `column` of a `datasets` dataset (see read_calibration_text), joined by blank lines."""
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            f"calib_data={source!r} needs the `datasets` package: pip install 'hf-attn-patch[convert]'"
        ) from err
    try:
        if Path(source).is_dir():
            loaded = datasets.load_from_disk(source)
        elif Path(source).is_file():
            loaded = datasets.load_dataset(DATA_FILE_BUILDERS[Path(source).suffix], data_files=source)
        else:
            name, _, config = source.partition(":")
            loaded = datasets.load_dataset(name, config or None, split=split)
    except Exception as err:  # datasets raises many types (FileNotFoundError, ConnectionError, DatasetNotFoundError)
        raise ValueError(
            f"calib_data={source!r}: could not load it as a dataset ({type(err).__name__}: {err})"
        ) from err
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"calib_split={split!r} is not a split of {source!r}: {sorted(loaded)}")
        loaded = loaded[split]
    if column not in loaded.column_names:
        raise ValueError(f"calib_column={column!r} is not a column of {source!r}: {loaded.column_names}")
    parts, size = [], 0
    for row in loaded.select_columns([column]):
        value = row[column]
        if isinstance(value, str) and value.strip():
            parts.append(value)
            size += len(value)
            if size >= MAX_DATASET_CHARS:
                logger.info("calibration: read the first %d rows of %s (%d characters)", len(parts), source, size)
                break
    return "\n\n".join(parts)


def calibration_windows(text: str, tokenizer, samples: int, length: int) -> torch.Tensor:
    """[samples, length] token windows, consecutive from the start of the text."""
    for name, value in (("calib_samples", samples), ("calib_len", length)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if len(ids) < samples * length:
        raise ValueError(
            f"calibration text has {len(ids)} tokens, fewer than calib_samples x calib_len = {samples * length}"
        )
    return ids[: samples * length].view(samples, length)


TEACHER_TOP_P = 0.95  # nucleus of the teacher samples: the 5% tail of a small model is mostly noise
TEACHER_PROMPT = 4  # tokens of calibration text that start each teacher sample: a start, not a domain
CALIB_SOURCES = ("text", "teacher")


def teacher_windows(teacher, text_windows: torch.Tensor, seed: int = 0, progress: bool = True) -> torch.Tensor:
    """[n, T] samples of `teacher`, one per calibration text window [n, T]: its first TEACHER_PROMPT tokens
    continued by sample_from_teacher (temperature 1, top-p TEACHER_TOP_P)."""
    return sample_from_teacher(
        teacher, text_windows[:, :TEACHER_PROMPT], text_windows.shape[1], seed=seed, progress=progress
    )


@torch.no_grad()
def sample_from_teacher(
    teacher,
    prompts: torch.Tensor,
    length: int,
    seed: int = 0,
    top_p: float = TEACHER_TOP_P,
    batch_size: int = 32,
    progress: bool = True,
) -> torch.Tensor:
    """[n, length] windows: each prompt [n, p] (p < length) continued by `teacher` sampling at temperature 1 from the
    smallest set of tokens holding `top_p` of the probability (EOS suppressed, so every window is full),
    reproducible from `seed` (and batch_size: the rows of a batch draw from one generator in turn).

    batch_size 32: a decode step's cost is mostly fixed (SmolLM2-135M, one CPU thread: 0.15 / 0.19 / 0.29 s per step
    at batch 8 / 16 / 32), so 32 windows sample in about the time 16 took at batch 8."""
    if not 0 < prompts.shape[1] < length:
        raise ValueError(f"prompt length {prompts.shape[1]} must be in 1..length-1 = {length - 1}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
    device = input_device(teacher)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    eos = getattr(teacher.config, "eos_token_id", None)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    out = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="teacher samples", disable=not progress):
        ids = prompts[start : start + batch_size].to(device)
        past, step_input = None, ids
        while ids.shape[1] < length:
            result = teacher(step_input, **cache_kwarg(past), use_cache=True)
            past = get_cache(result)
            probs = torch.softmax(result.logits[:, -1].float(), dim=-1).cpu()
            probs[:, eos] = 0
            if top_p < 1:  # keep the most probable tokens until their sum reaches top_p (the first always)
                sorted_probs, order = probs.sort(dim=-1, descending=True)
                cum = sorted_probs.cumsum(-1)
                sorted_probs[(cum - sorted_probs) >= top_p * cum[:, -1:]] = 0
                probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
            step_input = torch.multinomial(probs, 1, generator=generator).to(device)
            ids = torch.cat((ids, step_input), dim=1)
        out.append(ids.cpu())
    return torch.cat(out)


def input_device(model) -> torch.device:
    """Where a model takes its inputs: its parameters' device, or for a model dispatched by accelerate (weights
    offloaded to the CPU or disk, on the meta device until used) the device its first module runs on."""
    placed = getattr(model, "hf_device_map", None)
    if placed:
        first = next(iter(placed.values()))
        return torch.device("cpu" if first in ("cpu", "disk") else first)
    return next(model.parameters()).device


class StatsAccumulator:
    """Running sums of LayerStats for one layer: add() attention inputs x [..., D] batch after batch."""

    def __init__(self, w, shape: AttentionShape):
        self.w, self.d_h, self.half = w, shape.head_dim, shape.half
        self.cov, self.q, self.k, self.n = 0.0, 0.0, 0.0, 0

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, self.w.q_w.shape[1]).double()
        x1 = torch.cat((x, x.new_ones(len(x), 1)), dim=1)
        self.cov = self.cov + x1.t() @ x1
        if self.half:
            for key, weight, bias in (("q", self.w.q_w, self.w.q_b), ("k", self.w.k_w, self.w.k_b)):
                out = (x @ weight.double().t() + (0 if bias is None else bias.double())).view(len(x), -1, self.d_h)
                norms = (out[..., : self.half] ** 2 + out[..., self.half : 2 * self.half] ** 2).sqrt().sum(0)
                setattr(self, key, getattr(self, key) + norms)
        self.n += len(x)

    def stats(self) -> LayerStats:
        """The sums so far, on the CPU (accumulated where the model runs; the closed forms run on the CPU)."""
        empty = torch.zeros(0, 0, dtype=torch.float64)
        return LayerStats(
            input_cov=self.cov.cpu(),
            q_pair_norm=(self.q / self.n).cpu() if self.half else empty,
            k_pair_norm=(self.k / self.n).cpu() if self.half else empty,
            tokens=self.n,
        )


def stats_of_inputs(x: torch.Tensor, w, shape: AttentionShape, batch: int = 8) -> LayerStats:
    """LayerStats of one layer (weights w: AttentionWeights) from its attention inputs x [n, T, D]: the propagated
    calibration of reconstruct.py feeds the inputs the converted prefix produces."""
    acc = StatsAccumulator(w, shape)
    for start in range(0, len(x), batch):
        acc.add(x[start : start + batch])
    return acc.stats()


@torch.no_grad()
def track_statistics(runner, layer, attn, w, shape: AttentionShape, i: int, track) -> LayerStats:
    """LayerStats of decoder layer i's attention `attn` (weights w) over the carried source track
    (layer_stream.Activations) while runner (a layer_stream.LayerRunner) advances it: the layer's output goes into the
    spare buffer; the hook sees each batch of windows as a whole model's forward would."""
    acc = StatsAccumulator(w, shape)
    hook = attn.register_forward_pre_hook(
        lambda m, a, kw: acc.add(a[0] if a else kw["hidden_states"]), with_kwargs=True
    )
    try:
        runner.apply(layer, i, track.current, track.spare)
    finally:
        hook.remove()
    return acc.stats()
