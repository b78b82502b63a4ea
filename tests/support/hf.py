"""Hugging Face ``Trainer.train()`` on a tiny GPT-2 built from a local config (nothing is downloaded)."""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, List, Optional

import pytest
import torch


def hf_dataset(n: int = 32, seq: int = 64) -> torch.utils.data.Dataset:
    """``n`` seeded sequences of ``seq`` token ids, each its own labels."""

    class RandomIds(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, 128, (n, seq), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    return RandomIds()


def hf_train(ctx: ContextManager, tmp_path, step_ctx: Optional[Callable[[], ContextManager]] = None,
             max_steps: int = 3, **extra) -> Dict:
    """Trainer.train() on a tiny GPT-2 inside ``ctx``; returns the model, optimizer, scheduler and losses.

    Args:
        ctx: entered around the whole of ``train()``.
        tmp_path: the Trainer's output folder.
        step_ctx: called for a context entered around each ``training_step`` (forward and backward of one
            micro-batch; the optimizer's step runs outside it): how a loop gives each step a block of its own.
        max_steps: optimizer steps.
        extra: more ``TrainingArguments``.
    """
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=128,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    losses: List[float] = []
    each_step = step_ctx or contextlib.nullcontext

    class RecordingTrainer(transformers.Trainer):
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            losses.append(float(loss.detach()))  # what a logging callback would read
            return loss

        def training_step(self, *args, **kwargs):
            with each_step():
                return super().training_step(*args, **kwargs)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=8, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", seed=0, dataloader_num_workers=0,
        disable_tqdm=True, **extra)
    trainer = RecordingTrainer(model=model, args=args, train_dataset=hf_dataset())
    with ctx:
        result = trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper holds the real one
    return dict(model=model, opt=opt, sched=trainer.lr_scheduler.state_dict(), losses=losses,
                train_loss=result.training_loss, global_step=trainer.state.global_step)
