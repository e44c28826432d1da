"""SFT warm-up and the `tiny-arith` model recipe used by the demo and tests.

The warm-up deliberately trains on *noisy* answers (right only `CORRECT_SHARE` of the time, sometimes
malformed): the model learns the answer format and puts real but not dominant probability on the right
sum, so sampling reaches reward often enough for GRPO to have a signal, and RL has room to climb.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch

from generator_fleet.tasks.arith import ALPHABET, ArithTask
from trainer import tiny_model
from trainer.logprobs import pad_batch

log = logging.getLogger(__name__)

CORRECT_SHARE = 0.35
MALFORMED_SHARE = 0.15
WRONG_OFFSETS = (-10, -2, -1, 1, 2, 10)


def noisy_answer(answer: int, rng: random.Random) -> str:
    u = rng.random()
    if u < CORRECT_SHARE:
        return str(answer)
    if u < CORRECT_SHARE + MALFORMED_SHARE:
        return f"{answer}=" if rng.random() < 0.5 else f"{answer}+{rng.randint(0, 9)}"
    return str(max(0, answer + rng.choice(WRONG_OFFSETS)))


def sft(
    model,
    tokenizer,
    examples: list[tuple[str, str]],
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Train on (prompt, answer) pairs with loss on the answer + EOS only; returns the loss per step."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    losses, t0 = [], time.monotonic()
    for step in range(steps):
        batch = [rng.choice(examples) for _ in range(batch_size)]
        seqs, starts = [], []
        for prompt, answer in batch:
            p = [tokenizer.bos_token_id] + tokenizer.encode(prompt)
            seqs.append(p + tokenizer.encode(answer) + [tokenizer.eos_token_id])
            starts.append(len(p))
        ids, mask = pad_batch(seqs, tokenizer.pad_token_id)
        labels = ids.clone()
        labels[mask == 0] = -100
        for i, s in enumerate(starts):
            labels[i, :s] = -100
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss))
        if (step + 1) % 100 == 0 or step + 1 == steps:
            log.info("sft step %d/%d loss %.3f (%.0fs)", step + 1, steps, loss, time.monotonic() - t0)
    model.eval()
    return losses


def build_tiny_arith(path: str | Path, max_operand: int = 19, warmup_steps: int = 300, seed: int = 0):
    """Tokenizer + tiny Qwen2 + noisy SFT warm-up on the arithmetic task, saved to `path`."""
    task = ArithTask(max_operand=max_operand, seed=seed)
    corpus = [p.prompt + str(p.answer) for p in task.problems]
    model, tokenizer = tiny_model.build(path, ALPHABET, corpus, seed=seed)
    rng = random.Random(seed)
    # A fixed noisy dataset (several noisy answers per problem) rather than fresh noise each step, so
    # the warm-up converges to the noise distribution instead of averaging it away.
    examples = [(p.prompt, noisy_answer(p.answer, rng)) for p in task.problems for _ in range(8)]
    if warmup_steps:
        sft(model, tokenizer, examples, warmup_steps, seed=seed)
    tiny_model.save(path, model, tokenizer)
    return model, tokenizer
