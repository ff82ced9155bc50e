"""train_ppo.py as it is, with each rank's rollout and update order written down, for
tests/test_ppo_reference.py to redo the iteration the plain way: run under torchrun with
train_ppo.py's flags. It writes OUT_DIR/rollout-rank<r>.json after every iteration's update:

    [{"prompts": [the data row's prompt, one per response], "prompt_ids": [[ids]],
      "response_ids": [[ids]], "finished": [bool], "order": [the shuffled row order of step (3)],
      "steps": [one per optimizer step: [one per micro-batch: [rows of `order`]]],
      "grad_norms": [one per optimizer step: {role: its norm before clipping}]}, ...]

Nothing in the run changes: each phase is wrapped to note its inputs and then called."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch.distributed as dist  # noqa: E402

import common  # noqa: E402
import train_ppo  # noqa: E402

ITERATIONS = []  # this rank's record, one dict per iteration
PHASES = {
    "generate": train_ppo.generate,
    "old_logprobs_and_values": train_ppo.old_logprobs_and_values,
    "ppo_loss": train_ppo.ppo_loss,
    "ppo_update": train_ppo.ppo_update,
    "optimizer_step": train_ppo.optimizer_step,
    "clip_grad_norm": common.clip_grad_norm,
}


def generate(args, engine, prompts, step, positions):
    gen = PHASES["generate"](args, engine, prompts, step, positions)
    n = args.n_samples_per_prompt
    texts = [row["prompt"] for _, row in prompts for _ in range(n)]
    record = {"prompts": texts, "finished": list(gen.finished), "steps": [[]], "grad_norms": []}
    ITERATIONS.append(record)
    return gen


def old_logprobs_and_values(args, models, tok, prompt_ids, responses, order, *rest):
    record = ITERATIONS[-1]
    record["prompt_ids"] = [list(ids) for ids in prompt_ids]
    record["response_ids"] = [list(ids) for ids in responses]
    record["order"] = order.tolist()
    return PHASES["old_logprobs_and_values"](args, models, tok, prompt_ids, responses, order, *rest)


def ppo_loss(args, models, exp, rows, *rest):
    ITERATIONS[-1]["steps"][-1].append(rows.tolist())
    return PHASES["ppo_loss"](args, models, exp, rows, *rest)


def clip_grad_norm(model, max_norm, role):
    norm = PHASES["clip_grad_norm"](model, max_norm, role)
    ITERATIONS[-1]["grad_norms"][-1][role] = norm.item()
    return norm


def optimizer_step(roles, max_grad_norm):
    record = ITERATIONS[-1]
    record["grad_norms"].append({})
    PHASES["optimizer_step"](roles, max_grad_norm)
    record["steps"].append([])  # the next optimizer step's micro-batches


def ppo_update(args, models, roles, exp, kl_coef):
    out = PHASES["ppo_update"](args, models, roles, exp, kl_coef)
    ITERATIONS[-1]["steps"].pop()  # no micro-batch after the last optimizer step
    path = os.path.join(common.local_dir(args), f"rollout-rank{dist.get_rank()}.json")
    with open(path, "w") as f:
        json.dump(ITERATIONS, f)
    return out


def varied(prompt, response):
    """A --reward_fn whose scores differ between a random model's responses (the task's rule and
    tests/learnable.py's '1's give it 0 nearly always): its characters' codes summed, mod 7, / 7."""
    return sum(map(ord, response)) % 7 / 7


if __name__ == "__main__":  # as a script only: train_ppo imports this file for `varied` too
    train_ppo.generate = generate
    train_ppo.old_logprobs_and_values = old_logprobs_and_values
    train_ppo.ppo_loss = ppo_loss
    train_ppo.ppo_update = ppo_update
    train_ppo.optimizer_step = optimizer_step
    common.clip_grad_norm = clip_grad_norm
    common.run(train_ppo.main, train_ppo.Args, train_ppo.LIMITS)
