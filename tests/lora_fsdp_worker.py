"""A LoRA run under FSDP2, and what became of its frozen base: a run of tests/train_runs_worker.py
(``--lora-report RECIPE.yaml REPORT.json``), in a process group it has joined.

Every rank trains the recipe (parallel.mode=fsdp) through the Trainer; then the ranks gather the whole
model, and rank 0 writes as JSON which frozen parameters were not sharded, had a gradient, were in the
optimizer or its state, or differ from the base checkpoint the run adapted.
"""

import json

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from flashformer.checkpoint import from_pretrained
from flashformer.parallel import full_state_dicts, shutdown_distributed
from flashformer.train import Trainer, load_train_config


def frozen_base_report(trainer: Trainer) -> dict:
    """What the run did to its frozen parameters (a collective: every rank calls it; rank 0's is complete)."""
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    frozen = {name: p for name, p in trainer.model.named_parameters() if not p.requires_grad}
    optimized = [names[id(p)] for group in trainer.optimizer.param_groups for p in group["params"]]
    whole, _ = full_state_dicts(trainer.model, trainer.optimizer)
    report = {
        "frozen": sorted(frozen),
        "not_sharded": sorted(name for name, p in frozen.items()
                              if not isinstance(p, DTensor) or p.to_local().numel() >= p.numel()),
        "with_grad": sorted(name for name, p in frozen.items() if p.grad is not None),
        "optimized": sorted(optimized),
        "optimizer_state": sorted(names[id(p)] for p in trainer.optimizer.state),
    }
    if trainer.env.is_main:
        base = from_pretrained(trainer.init_dir).state_dict()
        report["changed"] = sorted(name for name in frozen if not torch.equal(whole[name], base[name]))
    return report


def train_and_report(recipe_path: str, report_path: str) -> None:
    torch.set_num_threads(1)
    trainer = Trainer(load_train_config(recipe_path))
    try:
        trainer.fit()
        report = frozen_base_report(trainer)
        if trainer.env.is_main:
            with open(report_path, "w") as f:
                json.dump(report, f)
        dist.barrier()  # leave together: a rank that tears its gloo pairs down early can abort the other
    finally:
        trainer.close()
        shutdown_distributed()

