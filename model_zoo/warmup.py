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
from model_zoo import tiny as tiny_model
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
    examples: list[tuple[list[int], list[int]]],
    steps: int,
    pad_id: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    warmup: int = 20,
    max_grad_norm: float | None = None,
    seed: int = 0,
    name: str = "sft",
) -> list[float]:
    """Supervised warm-up on (token ids, loss mask) examples: next-token loss only where the mask is 1.
    Linear LR warm-up over `warmup` steps; returns the loss per step."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    model.train()
    losses, t0 = [], time.monotonic()
    for step in range(steps):
        batch = [rng.choice(examples) for _ in range(batch_size)]
        ids, attn = pad_batch([seq for seq, _ in batch], pad_id)
        labels = torch.full_like(ids, -100)
        for i, (seq, mask) in enumerate(batch):
            m = torch.tensor(mask, dtype=torch.bool)
            labels[i, : len(seq)][m] = ids[i, : len(seq)][m]
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % 100 == 0 or step + 1 == steps:
            log.info("%s step %d/%d loss %.3f (%.0fs)", name, step + 1, steps, loss, time.monotonic() - t0)
    model.eval()
    return losses


def answer_example(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """<bos> prompt answer <eos>, trained on the answer and <eos> only."""
    p = [tokenizer.bos_token_id] + tokenizer.encode(prompt)
    a = tokenizer.encode(answer) + [tokenizer.eos_token_id]
    return p + a, [0] * len(p) + [1] * len(a)


def build_tiny_arith(path: str | Path, max_operand: int = 19, warmup_steps: int = 300, seed: int = 0):
    """Tokenizer + tiny Qwen2 + noisy SFT warm-up on the arithmetic task, saved to `path`."""
    task = ArithTask(max_operand=max_operand, seed=seed)
    corpus = [p.prompt + str(p.answer) for p in task.problems]
    model, tokenizer = tiny_model.build(path, ALPHABET, corpus, seed=seed)
    rng = random.Random(seed)
    # A fixed noisy dataset (several noisy answers per problem) rather than fresh noise each step, so
    # the warm-up converges to the noise distribution instead of averaging it away.
    examples = [
        answer_example(tokenizer, p.prompt, noisy_answer(p.answer, rng))
        for p in task.problems
        for _ in range(8)
    ]
    if warmup_steps:
        sft(model, examples, warmup_steps, tokenizer.pad_token_id, seed=seed)
    tiny_model.save(path, model, tokenizer)
    return model, tokenizer
