"""Sharded healing: the student and the teacher split over the processes with FSDP2 (`fully_shard`).

Started with `accelerate launch --config_file <an FSDP config with fsdp_version: 2>` (or any launcher that sets
accelerate's FSDP environment: ACCELERATE_USE_FSDP=true, FSDP_VERSION=2). Each process keeps 1/N of every weight;
a decoder layer's weights are gathered for its forward and backward and freed after (fsdp_reshard_after_forward), so
a device holds about (student + teacher) / N plus one layer, not two whole models. Only the trainable weights
(attention) have gradients and optimizer state, both sharded; for a bf16 / fp16 student the sharded trainable weights
are kept in fp32 and cast to the student's dtype when gathered (MixedPrecisionPolicy), so they are the fp32 master
weights of the data-parallel path, sharded, and gradients are reduced in fp32.

The caller's models are not changed while training: `Sharded` shards a copy whose weights alias theirs (no second
copy of the weights), where they are (the CPU, for a model no device holds). At the end every process copies the
trained weights back, one gathered tensor at a time, so rank 0 writes the healed model as the data-parallel path does.
Checkpoints are torch.distributed.checkpoint folders: each process writes its own shards of the trainable weights,
of the optimizer state and of the best state; nothing is gathered.

The accelerate config is read for fsdp_auto_wrap_policy (default here: each decoder layer, `_no_split_modules`),
fsdp_transformer_layer_cls_to_wrap, fsdp_reshard_after_forward and fsdp_offload_params (GPU launches: the shards,
their gradients and the optimizer state on the CPU; on CPU processes they are there already); the compute dtype is the
models' own (and accelerate's autocast on a GPU), as in the data-parallel path. FSDP1 (fsdp_version 1, accelerate's
default) and DeepSpeed are refused (launch_mode).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FSDP_DIR = "heal_fsdp"  # the sharded checkpoints (step_<n> folders), inside checkpoint_dir
STATE_FILE = "heal_state.json"  # step, schedule and best-state bookkeeping, in each step_<n> folder
LOW_PRECISION = (torch.bfloat16, torch.float16)


def launch_mode(accelerator=None) -> str:
    """ "fsdp" (sharded) or "data_parallel" (DDP, or one process), from accelerate's launch environment (and the
    accelerator's state when given); raises for launches healing does not support."""
    env = lambda name, default="false": os.environ.get(name, default).lower()  # noqa: E731
    kind = getattr(getattr(accelerator, "distributed_type", None), "name", None)
    if env("ACCELERATE_USE_DEEPSPEED") == "true" or kind == "DEEPSPEED":
        raise ValueError(
            "healing under DeepSpeed (accelerate config distributed_type: DEEPSPEED, e.g. ZeRO-3) is not "
            "supported: launch with an FSDP config (distributed_type: FSDP, fsdp_version: 2) to shard, or "
            "data parallel (accelerate launch --multi_gpu, or torchrun)"
        )
    if env("ACCELERATE_USE_FSDP") != "true" and kind != "FSDP":
        return "data_parallel"
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    version = str(plugin.fsdp_version if plugin is not None else env("FSDP_VERSION", "1"))
    if version != "2":
        raise ValueError(
            f"fsdp_version={version} in the accelerate config: healing shards with FSDP2 only; set "
            "fsdp_version: 2 (accelerate's default is 1)"
        )
    return "fsdp"


class Sharded:
    """FSDP2-sharded copies of `student` and `teacher` for training on `accelerator`'s processes.

    .student / .teacher: the sharded copies (call them as the models); .params: the student's trainable weights,
    sharded DTensors (fp32 where the student is bf16 / fp16: the masters), the tensors the optimizer steps."""

    def __init__(self, student, teacher, accelerator):
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.device_mesh import init_device_mesh

        state = accelerator.state
        # accelerate builds its plugin only for GPU launches; on the CPU (gloo) it reads the same environment here
        self.plugin = getattr(state, "fsdp_plugin", None) or FullyShardedDataParallelPlugin()
        self.accelerator = accelerator
        self.mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
        dtypes = {p.dtype for p in student.parameters() if p.requires_grad}
        low = next(iter(dtypes)) if len(dtypes) == 1 and next(iter(dtypes)) in LOW_PRECISION else None
        self.student = self._shard(_aliasing_copy(student, upcast=low is not None), low)
        self.teacher = self._shard(_aliasing_copy(teacher), None)
        self.names = [n for n, p in self.student.named_parameters() if p.requires_grad]
        self.params = [self.student.get_parameter(n) for n in self.names]
        logger.info(
            "healing sharded over %d processes (FSDP2): %d trainable tensors%s",
            accelerator.num_processes,
            len(self.params),
            f", fp32 masters of {low}" if low else "",
        )

    def _shard(self, model, low: torch.dtype | None):
        """fully_shard every unit the config's wrap policy picks (default: the decoder layers), then the root."""
        from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy, get_module_children_bottom_up
        from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if self.plugin.auto_wrap_policy is None and os.environ.get("FSDP_AUTO_WRAP_POLICY") is None:
            from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

            self.plugin.auto_wrap_policy = transformer_auto_wrap_policy  # not set: one unit per decoder layer
        policy = fsdp2_prepare_auto_wrap_policy(self.plugin, model)
        kwargs = {
            "mesh": self.mesh,
            "reshard_after_forward": self.plugin.reshard_after_forward,
            "offload_policy": self.plugin.cpu_offload if self.mesh.device_type != "cpu" else OffloadPolicy(),
            "mp_policy": MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None),
        }
        units = [m for m in get_module_children_bottom_up(model)[:-1] if policy is not None and policy(m)]
        for module in units:
            fully_shard(module, **kwargs)
        if not units:
            logger.warning(
                "FSDP wrap policy picked no layer of %s: one unit, gathered whole for every forward",
                type(model).__name__,
            )
        return fully_shard(model, **kwargs)

    def gathered(self):
        """(name, full tensor) of every trainable weight, gathered one at a time on every process."""
        from torch.distributed.tensor import DTensor

        device = self.accelerator.device
        for name, p in zip(self.names, self.params):  # offloaded shards are on the CPU: gathered on the device
            local = DTensor.from_local(
                p.to_local().to(device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
            yield name, local.full_tensor()

    @torch.no_grad()
    def copy_into(self, student) -> None:
        """The trained weights into `student` (the caller's model, unsharded), in its dtype, on every process."""
        for name, full in self.gathered():
            target = student.get_parameter(name)
            target.copy_(full.to(target.device))

    def _state(self, optimizer) -> dict:
        """The sharded trainable weights and optimizer state (DTensors, by name), as DCP saves and loads them."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        optim = get_optimizer_state_dict(self.student, optimizer)
        return {"params": dict(zip(self.names, self.params)), "optim": optim}

    def save(self, ckpt: Path, optimizer, step: int, schedule, best: list | None, meta: dict | None) -> None:
        """The sharded state of `step` as a torch.distributed.checkpoint folder, FSDP_DIR/step_<step>: the trainable
        weights, the optimizer state, the best state, and STATE_FILE; then step.txt names it, and older ones go."""
        import torch.distributed.checkpoint as dcp

        accelerator = self.accelerator
        folder = ckpt / FSDP_DIR / f"step_{step}"
        state = self._state(optimizer)
        if best is not None:
            state["best"] = {f"p{i}": t for i, t in enumerate(best)}
        dcp.save(state, checkpoint_id=str(folder))
        if accelerator.is_main_process:
            (folder / STATE_FILE).write_text(
                json.dumps({"step": step, "schedule": schedule.state_dict(), "best": meta})
            )
            (ckpt / "step.txt.partial").write_text(str(step))
            (ckpt / "step.txt.partial").replace(ckpt / "step.txt")  # the switch to the new state: one rename
            for old in (ckpt / FSDP_DIR).glob("step_*"):
                if old != folder:
                    shutil.rmtree(old)
        accelerator.wait_for_everyone()

    def load(self, ckpt: Path, optimizer, schedule, best_template: list) -> tuple[int, dict | None, list | None]:
        """Restore what save() wrote last (the weights in place); (step, best-state bookkeeping, best state)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        folder = ckpt / FSDP_DIR / f"step_{int((ckpt / 'step.txt').read_text())}"
        saved = json.loads((folder / STATE_FILE).read_text())
        state = self._state(optimizer)
        if saved["best"] is not None:
            state["best"] = {f"p{i}": t.detach().clone() for i, t in enumerate(best_template)}
        dcp.load(state, checkpoint_id=str(folder))
        set_optimizer_state_dict(self.student, optimizer, state["optim"])
        schedule.load_state_dict(saved["schedule"])
        best = None if saved["best"] is None else [state["best"][f"p{i}"] for i in range(len(best_template))]
        return saved["step"], saved["best"], best


def _aliasing_copy(model, upcast: bool = False):
    """A copy of `model` whose parameters are new Parameter objects on the same storage (no weight is copied), so
    fully_shard may replace them without touching `model`; upcast: trainable bf16 / fp16 ones become fp32 copies."""
    memo = {}
    for p in model.parameters():
        data = p.detach().float() if upcast and p.requires_grad and p.dtype in LOW_PRECISION else p.detach()
        memo[id(p)] = torch.nn.Parameter(data, requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)
