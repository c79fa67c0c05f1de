"""Built-in SFT warm-up on a verifiable task, plus greedy evaluation.

Single process (it runs before the RL processes start). Teacher forcing on ``answer + <eos>``, AdamW with
linear warm-up, gradient clip 1.0, stopped by a held-out greedy pass-rate trigger
(on a 2-core CPU, 2-digit addition reached a 0.2-0.3 pass rate in about 300-400 steps).

An environment without the addition task's ``target_ids`` but with demonstrations
(:meth:`moe_rl.envs.protocol.Environment.demonstration`, e.g. the calculator environment) trains on its expert
episodes (loss on the model's turns only) and is evaluated by playing greedy episodes with its tools
(:class:`GreedyEngine` behind :func:`moe_rl.envs.runner.run_group`); the pass rate counts episodes with reward 1.0.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from moe_rl.envs.addition import AdditionTask, Problem
from moe_rl.runtime.trainer.config import SftConfig

__all__ = ["GreedyEngine", "evaluate_episodes", "greedy_generate", "evaluate_greedy", "run_sft", "sft_cache_key", "sft_optimizer", "sft_step"]


@torch.no_grad()
def greedy_generate(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int,
                    eos_id: int | Sequence[int]) -> list[list[int]]:
    """Greedy decoding without a KV cache (prompts are bucketed by length, so no padding is needed).

    Args:
        model: maps ``[B, T]`` int64 ids to ``[B, T, V]`` logits.
        prompts: token ids per prompt.
        max_new_tokens: generation budget.
        eos_id: stop token, or several (kept in the output).

    Returns:
        Generated ids per prompt, in input order, each ending at its first stop token (inclusive) or at the
        budget.
    """
    stops = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), dtype=torch.int64)
    buckets: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        buckets[len(p)].append(i)
    out: list[list[int]] = [[] for _ in prompts]
    for idx in buckets.values():
        ids = torch.tensor([prompts[i] for i in idx], dtype=torch.int64)
        done = torch.zeros(len(idx), dtype=torch.bool)
        for _ in range(max_new_tokens):
            nxt = model(ids)[:, -1].argmax(-1)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            for j, t in enumerate(nxt.tolist()):
                if not done[j]:
                    out[idx[j]].append(t)
            done |= torch.isin(nxt, stops)
            if bool(done.all()):
                break
    return out


def evaluate_greedy(model: torch.nn.Module, task: AdditionTask, problems: list[Problem]) -> dict[str, float]:
    """Greedy exact-match pass rate and mean reward over ``problems``."""
    was_training = model.training
    model.eval()
    gens = greedy_generate(model, [task.prompt_ids(p) for p in problems], task.cfg.max_new_tokens, task.tok.eos_id)
    model.train(was_training)
    rewards = [task.reward(p, g) for p, g in zip(problems, gens, strict=True)]
    return {"pass_rate": sum(r == 1.0 for r in rewards) / len(rewards), "reward_mean": sum(rewards) / len(rewards)}


class GreedyEngine:
    """An engine client over a local model for evaluation episodes: greedy completions (the temperature, salt and
    seed are ignored), ended by ``eos_id`` or a request's ``stop_token_ids``; log-probs are not computed (0.0).

    Args:
        model: maps ``[B, T]`` int64 ids to ``[B, T, V]`` logits.
        eos_id: the end-of-sequence token.
    """

    def __init__(self, model: torch.nn.Module, eos_id: int) -> None:
        self.model = model
        self.eos_id = eos_id

    async def generate(self, prompt_ids: list[int], n: int, max_tokens: int, temperature: float,
                       cache_salt: str | None = None, seed: int | None = None,
                       stop_token_ids: list[int] | None = None) -> tuple[list[SimpleNamespace], int]:
        stops = [self.eos_id, *(stop_token_ids or [])]
        (ids,) = greedy_generate(self.model, [list(prompt_ids)], max_tokens, stops)
        finish = "stop" if ids and ids[-1] in stops else "length"
        comp = SimpleNamespace(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish)
        return [comp] * n, 0


def evaluate_episodes(model: torch.nn.Module, env: Any, problems: list[Any]) -> dict[str, float]:
    """Greedy episodes of ``env`` (an :class:`moe_rl.envs.protocol.Environment`) on ``problems``: the pass rate
    (reward 1.0) and the mean reward; an episode that fails counts as reward 0."""
    from moe_rl.envs.runner import run_group

    was_training = model.training
    model.eval()
    engine = GreedyEngine(model, env.tok.eos_id)

    async def play() -> list[float]:
        out = []
        for p in problems:  # one at a time: the model runs synchronously anyway
            (ep,) = await run_group(env, p, 1, engine)
            out.append(ep.result.reward if ep.error is None and ep.result is not None else 0.0)
        return out

    rewards = asyncio.run(play())
    model.train(was_training)
    return {"pass_rate": sum(r == 1.0 for r in rewards) / len(rewards), "reward_mean": sum(rewards) / len(rewards)}


def _uses_demonstrations(task: Any) -> bool:
    return not hasattr(task, "target_ids") and hasattr(task, "demonstration")


def _sft_batch(task: AdditionTask, rng: random.Random, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, masks = [], []
    misses = 0
    while len(rows) < batch_size:
        p = task.sample(rng)
        if _uses_demonstrations(task):
            demo = task.demonstration(p)
            if demo is None:  # no demonstration of this problem: draw another
                misses += 1
                if misses > 100 * batch_size:
                    raise ValueError(f"{type(task).__name__}.demonstration returned None for {misses} problems in a "
                                     "row: the environment has no expert episodes for the SFT warm-up; set "
                                     "sft.enabled = false")
                continue
            rows.append(list(demo.token_ids))
            masks.append(list(demo.loss_mask[1:]))  # position j predicts token j + 1
            continue
        prompt, target = task.prompt_ids(p), task.target_ids(p)
        rows.append(prompt + target)
        masks.append([False] * (len(prompt) - 1) + [True] * len(target))
    length = max(len(r) for r in rows)
    ids = torch.full((batch_size, length), task.tok.pad_id, dtype=torch.int64)
    mask = torch.zeros((batch_size, length - 1), dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(m)] = torch.tensor(m)
    return ids, mask


def sft_cache_key(*parts: object) -> str:
    """Hash of the JSON of everything that determines the SFT result."""
    blob = json.dumps([p.model_dump(mode="json") if hasattr(p, "model_dump") else p for p in parts], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def sft_optimizer(
    model: torch.nn.Module, lr: float, warmup_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """The SFT optimiser: AdamW (betas 0.9 / 0.98, weight decay 0.01) at ``lr`` with a linear warm-up over
    ``warmup_steps`` steps (``min(1, (s + 1) / warmup_steps)``, no warm-up when ``warmup_steps <= 1``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))
    return opt, sched


def sft_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    bf16_autocast: bool = False,
) -> torch.Tensor:
    """One SFT step on a batch of :func:`_sft_batch`: next-token cross entropy (token mean over the ``mask``ed
    answer positions, fp32 logits), backward, gradient-norm clip at 1.0, optimiser and scheduler step.

    Args:
        model: the policy (``model(ids) -> logits [B, S, V]``).
        opt, sched: from :func:`sft_optimizer`.
        ids: ``[B, S]`` int64 token ids; mask: ``[B, S - 1]`` bool, True where position ``t`` predicts an answer
            token ``ids[:, t + 1]``.
        bf16_autocast: run the forward under CPU bf16 autocast.

    Returns:
        The loss (a 0-dim tensor, nats; already backpropagated).
    """
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16_autocast else contextlib.nullcontext():
        logits = model(ids)[:, :-1]
    loss = F.cross_entropy(logits[mask].float(), ids[:, 1:][mask])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss


def run_sft(
    model: torch.nn.Module, task: AdditionTask, cfg: SftConfig, seed: int, log=None
) -> dict[str, float | int | list]:
    """Train ``model`` in place until the held-out greedy pass rate reaches ``cfg.pass_trigger``.

    Args:
        model: the policy (trained in place).
        task: a task with the addition task's SFT interface (``prompt_ids``, ``target_ids``, ``reward``), or an
            environment with demonstrations (module docstring).
        cfg: the SFT config.
        seed: seed of the sampler and of torch.
        log: called with one progress line per evaluation.

    Returns:
        Stats: ``steps``, ``pass_rate``, ``reward_mean``, ``seconds``, ``history`` (per evaluation).
        If ``max_steps`` passes without reaching the trigger, training stops there and ``reached`` is False.
    """
    torch.manual_seed(seed)
    rng = random.Random(seed)
    heldout = task.heldout_set(cfg.eval_prompts, seed=10_000 + seed)
    opt, sched = sft_optimizer(model, cfg.lr, cfg.warmup_steps)
    t0 = time.perf_counter()
    history = []
    ev = {"pass_rate": 0.0, "reward_mean": 0.0}
    step = 0
    reached = False
    model.train()
    for step in range(1, cfg.max_steps + 1):
        loss = sft_step(model, opt, sched, *_sft_batch(task, rng, cfg.batch_size))
        if step % cfg.eval_every == 0:
            ev = evaluate_episodes(model, task, heldout) if _uses_demonstrations(task) else evaluate_greedy(
                model, task, heldout)
            history.append({"step": step, "loss": loss.item(), **ev})
            if log:
                log(f"sft step {step}: loss {loss.item():.3f} greedy pass {ev['pass_rate']:.3f}")
            if ev["pass_rate"] >= cfg.pass_trigger:
                reached = True
                break
    return {
        "steps": step,
        "reached": reached,
        "pass_rate": ev["pass_rate"],
        "reward_mean": ev["reward_mean"],
        "seconds": time.perf_counter() - t0,
        "history": history,
    }


def save_sft_stats(path: Path, key: str, stats: dict) -> None:
    path.write_text(json.dumps({"key": key, **stats}, indent=2))
