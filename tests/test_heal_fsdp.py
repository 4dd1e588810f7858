"""Sharded healing (FSDP2 through `accelerate launch`) on 2 CPU processes over gloo: a step equals a data-parallel
step, a resumed run equals a straight one, rank 0 writes the healed model, and DeepSpeed / FSDP1 are refused. The
same runs on CUDA GPUs: test_sharded_healing_on_cuda (scripts/gpu_check.sh).

This file is also the script the launched processes run (`python tests/test_heal_fsdp.py STUDENT OUT`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

CONFIG = Path(__file__).resolve().parents[1] / "scripts" / "accelerate_fsdp.yaml"
STEPS, LR = 4, 1e-3  # the runs below; the interrupted one dies after step 2's checkpoint
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _port() -> str:
    with socket.socket() as probe:  # free on this machine now, not a fixed one another program may hold
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def _launch(sharded: bool, *args: str, processes: int = 2, timeout: int = 300, options: tuple = ()):
    """`processes` processes (CPU ones over gloo without a GPU): `accelerate launch` with the FSDP config (and its
    `options`, e.g. --fsdp_offload_params true), or torchrun (data parallel)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in [k for k in env if k.startswith(("ACCELERATE_", "FSDP_"))]:
        del env[name]  # only the launcher decides
    if sharded:
        head = [
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(CONFIG),
            "--num_processes",
            str(processes),
            "--main_process_port",
            _port(),
            *options,
        ]
    else:
        head = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", _port()]
    result = subprocess.run([sys.executable, *head, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    from hf_attn_patch.converters.convert import convert

    out = tmp_path_factory.mktemp("fsdp") / "mla"
    convert("default", out, to="mla", kv_budget=0.5, method="mha2mla", reconstruct_steps=0, calib_source="text")
    return out


def test_a_sharded_step_equals_a_data_parallel_step_and_resumes_exactly(student_dir, tmp_path):
    _launch(False, __file__, str(student_dir), str(tmp_path / "ddp"), "straight", "auto")
    _launch(True, __file__, str(student_dir), str(tmp_path / "fsdp"), "shards", "straight", "resume", "auto")
    for dtype, low in DTYPES.items():
        ranks = [json.loads((tmp_path / "fsdp" / f"shards_{dtype}_{rank}.json").read_text()) for rank in (0, 1)]
        for model in ("student", "teacher"):  # each process holds its half of every weight, nothing else
            assert ranks[0][model][0] + ranks[1][model][0] == ranks[0][model][2]
            assert all(held[model][0] <= held[model][1] for held in ranks), ranks
        for held in ranks:
            assert held["untouched"]  # the sharded copies alias the caller's weights and never write them
            assert held["trainable"] == ["torch.float32"] and held["frozen"] == [str(low)]  # fp32 sharded masters
            assert held["layers"] == 1 + 5  # the root and one unit per decoder layer
    ddp_lr, fsdp_lr = (json.loads((tmp_path / run / "auto_lr.json").read_text()) for run in ("ddp", "fsdp"))
    assert fsdp_lr[0] == ddp_lr[0] and dict(fsdp_lr[1]) == pytest.approx(dict(ddp_lr[1]), rel=1e-5)  # its pick
    saved = tmp_path / "fsdp" / "ckpt_fp32"
    assert (saved / "step.txt").read_text() == "2" and [p.name for p in (saved / "heal_fsdp").iterdir()] == ["step_2"]
    shards = {p.name for p in (saved / "heal_fsdp" / "step_2").iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp"} <= shards  # each process wrote its own shards
    _compare(tmp_path, deterministic=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: run by scripts/gpu_check.sh on a GPU machine")
def test_sharded_healing_on_cuda(student_dir, tmp_path):
    """The same runs on the GPUs (NCCL; one process per GPU, at most 2): bf16 autocast, the bf16 student's weights
    gathered in bf16 from fp32 shards, checkpoints of CUDA shards; the models stay on the CPU."""
    processes = min(2, torch.cuda.device_count())
    _launch(False, __file__, str(student_dir), str(tmp_path / "ddp"), "straight", processes=processes, timeout=120)
    _launch(
        True, __file__, str(student_dir), str(tmp_path / "fsdp"), "straight", "resume", processes=processes, timeout=120
    )
    _compare(tmp_path, deterministic=False)
    # fsdp_offload_params: the shards, their gradients and Adam on the CPU; the same elementwise fp32 arithmetic
    _launch(
        True,
        __file__,
        str(student_dir),
        str(tmp_path / "offload"),
        "straight",
        processes=processes,
        timeout=120,
        options=("--fsdp_offload_params", "true"),
    )
    for dtype in DTYPES:
        offload, fsdp = (load_file(tmp_path / run / f"straight_{dtype}.safetensors") for run in ("offload", "fsdp"))
        for name, weight in fsdp.items():  # the bounds of _compare's sharded / data-parallel comparison
            ulp = 2.0 ** (torch.log2(weight.float().abs().max()).floor().item() - 7)
            torch.testing.assert_close(offload[name], weight, atol=1e-5 if dtype == "fp32" else ulp, rtol=0, msg=name)


def _compare(runs: Path, deterministic: bool) -> None:
    """The runs of _run: sharded = data parallel, resumed = straight. deterministic: the CPU, where two runs of the
    same ops give the same bits; on a GPU some backward kernels (attention) add in a varying order."""
    if (runs / "ddp" / "auto_fp32.safetensors").exists():  # lr="auto": the same pick, the same weights
        ddp, fsdp = (load_file(runs / run / "auto_fp32.safetensors") for run in ("ddp", "fsdp"))
        for name, weight in ddp.items():
            torch.testing.assert_close(fsdp[name], weight, atol=1e-5, rtol=0, msg=name)  # as for fp32 below
    for dtype in DTYPES:
        ddp = load_file(runs / "ddp" / f"straight_{dtype}.safetensors")
        fsdp = load_file(runs / "fsdp" / f"straight_{dtype}.safetensors")
        resumed = load_file(runs / "fsdp" / f"resume_{dtype}.safetensors")
        curve, resumed_curve = (
            json.loads((runs / "fsdp" / f"{run}_{dtype}.json").read_text()) for run in ("straight", "resume")
        )
        # the held-in KL of every step: the resumed run's first two are the interrupted run's, from the checkpoint
        assert [s for s, _ in resumed_curve] == list(range(STEPS + 1))
        if deterministic:
            assert resumed_curve == curve
        else:  # weights within the bounds below move a KL of ~1 by far less than 1%
            assert [kl for _, kl in resumed_curve] == pytest.approx([kl for _, kl in curve], rel=1e-2)
        assert ddp.keys() == fsdp.keys() == resumed.keys() and any("self_attn" in k for k in ddp)
        for name, weight in ddp.items():
            # one bf16 ulp of the tensor's largest |w| (see below)
            ulp = 2.0 ** (torch.log2(weight.float().abs().max()).floor().item() - 7)
            if deterministic:
                # resumed = straight: the same ops on the same shards, and the saved state (the fp32 sharded weights,
                # the optimizer state, the schedule) is exact: equal up to one rounding of weights of size <= 1
                # (fp32 eps 1.2e-7 < 1e-6); measured 0
                torch.testing.assert_close(resumed[name], fsdp[name], atol=1e-6, rtol=0, msg=name)
            else:  # a varying summation order: the bounds of the sharded / data-parallel comparison
                torch.testing.assert_close(
                    resumed[name], fsdp[name], atol=1e-5 if dtype == "fp32" else ulp, rtol=0, msg=name
                )
            if dtype == "fp32":
                # FSDP gathers the same weights and reduce-scatters the gradients the all-reduce of DDP averages:
                # the same sums of 2 terms, at most a reduction-order difference, a relative eps 1.2e-7 per gradient.
                # Adam normalizes the updates to ~lr 1e-3, so 4 steps move a weight by <= 4e-3 with a relative error
                # far under 1e-3: <= 1e-5 (measured 0 on the CPU: halving a sum of 2 is exact)
                torch.testing.assert_close(fsdp[name], weight, atol=1e-5, rtol=0, msg=name)
            else:
                # bf16: both step fp32 masters, but DDP averages bf16 gradients (a relative error 2^-9 each) where FSDP
                # reduces them in fp32; Adam turns that into master differences ~lr x 2^-9 x steps ~ 1e-5, far under
                # one bf16 ulp of the largest weights, so rounding a master to bf16 lands at most one ulp of the
                # tensor's largest |w| away: 2^(floor(log2 max|w|) - 7) (measured on the CPU: 22% of the weights
                # differ, by at most that)
                torch.testing.assert_close(fsdp[name], weight, atol=ulp, rtol=0, msg=name)


def test_convert_under_an_fsdp_launch_writes_the_healed_model_once(student_dir, tmp_path):
    """hf-attn convert through `accelerate launch --config_file scripts/accelerate_fsdp.yaml`: every process converts
    and heals its shards, rank 0 writes OUT, and the result equals one process with both processes' batches."""
    from hf_attn_patch.converters.convert import convert

    from ._training import assert_same_adam_training  # here: the launched processes run this file as a script

    options = [
        "--to",
        "mla",
        "--kv-budget",
        "0.5",
        "--method",
        "mha2mla",
        "--heal-steps",
        "3",
        "--heal-lr",
        "1e-3",
        "--reconstruct-steps",
        "0",
        "--calib-source",
        "text",
        "--heal-layerwise-steps",
        "0",
    ]
    result = _launch(
        True,
        "-m",
        "hf_attn_patch.cli",
        "convert",
        "default",
        str(tmp_path / "fsdp"),
        *options,
        "--heal-batch-size",
        "1",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "1",
    )
    assert result.stdout.count("wrote ") == 1
    assert (tmp_path / "ckpt" / "heal_fsdp" / "step_3" / "__1_0.distcp").exists()  # it healed sharded; the last only
    assert [p.name for p in (tmp_path / "ckpt" / "heal_fsdp").iterdir()] == ["step_3"]
    single = convert(
        "default",
        tmp_path / "single",
        to="mla",
        kv_budget=0.5,
        method="mha2mla",
        heal_steps=3,
        heal_lr=1e-3,
        heal_batch_size=2,
        heal_layerwise_steps=0,
        reconstruct_steps=0,
        calib_source="text",
    )
    report = json.loads((tmp_path / "fsdp" / "conversion_report.json").read_text())
    assert report["heal"]["tokens"] == single["heal"]["tokens"] == 3 * 2 * 256
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp")
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "single")
    assert_same_adam_training(a, b, lr=1e-3, steps=3)


@pytest.mark.parametrize(("env", "message"), [
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed .*distributed_type: DEEPSPEED"),
    ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "fsdp_version=1 .*FSDP2 only"),
    ({"ACCELERATE_USE_FSDP": "true"}, "fsdp_version=1 .*accelerate's default is 1"),
])  # fmt: skip
def test_deepspeed_and_fsdp1_launches_are_refused_before_any_work(env, message, monkeypatch):
    from hf_attn_patch.converters.fitting.heal import heal

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    student = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=message):
        heal(student, student, torch.zeros(2, 4, dtype=torch.long), steps=1)


def test_a_checkpoint_resumes_only_under_the_launch_that_wrote_it(tmp_path):
    from hf_attn_patch.converters.fitting.heal import heal

    (tmp_path / "heal_fsdp" / "step_2").mkdir(parents=True)
    (tmp_path / "step.txt").write_text("2")
    student = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="holds a sharded \\(FSDP\\) healing state: resume it with the launch"):
        heal(student, student, torch.zeros(2, 4, dtype=torch.long), steps=4, checkpoint_dir=tmp_path, resume=True)


def _run(student_dir: str, out: str, *modes: str) -> None:
    """The launched processes: heal the converted student (fp32 and bf16) STEPS steps from the source straight, and /
    or interrupted after step 2 and resumed; rank 0 saves the trainable weights as OUT/<mode>_<dtype>.safetensors."""
    import copy

    from hf_attn_patch.converters.fitting import heal as heal_module
    from hf_attn_patch.converters.io.calibration import calibration_windows, read_calibration_text
    from hf_attn_patch.models import load_default

    source, tokenizer = load_default()
    windows = calibration_windows(read_calibration_text(None)[:20_000], tokenizer, 8, 64)
    windows, held_in = windows[:-2], windows[-2:]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])

    class CrashAfterTwoSteps(list):  # stands in for the progress bar: the run dies after step 2's checkpoint
        def __iter__(self):
            yield from self[:2]
            raise RuntimeError("simulated crash")

        def set_postfix(self, **_):
            pass

    for dtype_name, dtype in DTYPES.items():
        teacher = copy.deepcopy(source).to(dtype)
        for mode in modes:
            student = AutoModelForCausalLM.from_pretrained(student_dir).to(dtype)
            ckpt = out / f"ckpt_{dtype_name}"
            # held-in windows checked every step: the best state is tracked, checkpointed and resumed too
            options = dict(steps=STEPS, lr=LR, held_in=held_in, eval_every=1, progress=False)
            if mode == "shards":
                (out / f"shards_{dtype_name}_{rank}.json").write_text(json.dumps(_shards(student, teacher)))
                continue
            if mode == "auto":  # the range test (fp32: its pick must not hang on a rounding difference)
                if dtype != torch.float32:
                    continue
                options.update(steps=2, lr="auto", probe=1)
            if mode == "resume":
                original = heal_module.tqdm
                heal_module.tqdm = lambda steps, **_: CrashAfterTwoSteps(steps)
                try:
                    heal_module.heal(student, teacher, windows, checkpoint_dir=ckpt, checkpoint_every=2, **options)
                    raise AssertionError("the interrupted run did not stop")
                except RuntimeError as err:
                    assert "simulated crash" in str(err)
                finally:
                    heal_module.tqdm = original
                student = AutoModelForCausalLM.from_pretrained(student_dir).to(dtype)
                result = heal_module.heal(student, teacher, windows, checkpoint_dir=ckpt, resume=True, **options)
                assert len(result.losses) == STEPS - 2 and len(result.held_in) == STEPS + 1  # steps 3..4 only
            else:
                result = heal_module.heal(student, teacher, windows, **options)
            if rank == 0:
                (out / f"{mode}_{dtype_name}.json").write_text(json.dumps(result.held_in))
                if mode == "auto":
                    (out / "auto_lr.json").write_text(json.dumps([result.lr, list(result.range_test.items())]))
                trained = {n: p.detach().cpu().contiguous() for n, p in student.named_parameters() if "self_attn" in n}
                save_file(trained, str(out / f"{mode}_{dtype_name}.safetensors"))


def _shards(student, teacher) -> dict:
    """What one process holds of the sharded copies (heal_fsdp.Sharded), and that the caller's models are untouched."""
    from accelerate import Accelerator

    from hf_attn_patch.converters.fitting.heal import _trainable
    from hf_attn_patch.converters.fitting.heal_fsdp import Sharded

    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in student.named_parameters()}
    for p in student.parameters():
        p.requires_grad_(False)
    for p in _trainable(student, "attention"):
        p.requires_grad_(True)
    sharded = Sharded(student, teacher, Accelerator(cpu=True))
    local = lambda model: sum(p.to_local().numel() for p in model.parameters())  # noqa: E731
    # FSDP2 cuts dim 0 in 2: a process holds at most ceil(rows / 2) rows of each weight
    most = lambda model: sum(-(-p.shape[0] // 2) * p[0].numel() for p in model.parameters())  # noqa: E731
    untouched = all(
        p.data_ptr() == before[n][0] and torch.equal(p, before[n][1]) and p.dtype == student.dtype
        for n, p in student.named_parameters()
    )
    return {
        "student": [local(sharded.student), most(sharded.student), sum(p.numel() for p in student.parameters())],
        "teacher": [local(sharded.teacher), most(sharded.teacher), sum(p.numel() for p in teacher.parameters())],
        "untouched": untouched,
        "trainable": sorted({str(p.dtype) for p in sharded.params}),
        "frozen": sorted({str(p.dtype) for p in sharded.student.parameters() if not p.requires_grad}),
        "layers": sum(type(m).__name__.startswith("FSDP") for m in sharded.student.modules()),
    }


if __name__ == "__main__":
    _run(*sys.argv[1:])
