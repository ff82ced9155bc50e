"""PPO's logged iterations against a plain single-process reference: train_ppo.py's docstring's
equations written out one sequence at a time, on the rollout the 2-rank run sampled
(tests/ppo_recorder.py writes it down), the whole global minibatch in one backward."""

import json
import os

import pytest
import torch
from ppo_recorder import varied
from transformers import AutoModelForCausalLM
from transformers import AutoModelForTokenClassification

import common
import task
import train_ppo
from conftest import latest
from conftest import metrics
from conftest import read_tensors
from conftest import run
from conftest import stage_args

pytestmark = pytest.mark.slow

# 2 ranks, 2 iterations of 2 PPO epochs of 2 minibatches: 8 optimizer steps. GAE's micro-batches
# are smaller than a rank's share of a minibatch (1 of 2); GRPO's --micro_batch_size is larger
# than it (8 against 4: the share is one micro-batch). The learning rate is high enough that
# ratios reach the clip.
SHAPES = {
    "gae": ("--rollout_batch_size", 4, "--n_samples_per_prompt", 2, "--train_batch_size", 4),
    "grpo": ("--rollout_batch_size", 4, "--n_samples_per_prompt", 4, "--train_batch_size", 8),
}
MICRO = {"gae": 1, "grpo": 8}


def ppo(out, estimator):
    args = ("--model", task.TINY_MODEL, "--out_dir", out, "--max_steps", 2)
    args += ("--advantage_estimator", estimator, *SHAPES[estimator])
    args += ("--micro_batch_size", MICRO[estimator])
    args += ("--ppo_epochs", 2, "--lr", 1e-3, "--temperature", 0.7)
    args += ("--reward_fn", "tests.ppo_recorder:varied", "--rollout_engine", "hf")
    return args + ("--save_every", 0, "--eval_every", 0, "--eval_samples", 0)


@pytest.fixture(scope="module", params=["gae", "grpo"])
def recorded(tmp_path_factory, request):
    task.ensure_tiny_model()
    out = str(tmp_path_factory.mktemp(f"ppo-{request.param}"))
    run("tests/ppo_recorder.py", *ppo(out, request.param))
    return out, request.param


def logprobs(model, prompt, response, temperature):
    """log pi(y_k | x, y_<k) of each response token, the logits over the temperature: [R]."""
    x = torch.tensor([prompt + response])
    logits = model(input_ids=x).logits[0, len(prompt) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(1, x[0, len(prompt) :, None])[:, 0]


def values(critic, prompt, response):
    """V(s_k) of each response token: the critic's output where y_k is predicted. [R]"""
    x = torch.tensor([prompt + response])
    return critic(input_ids=x).logits[0, len(prompt) - 1 : -1, 0].float()


def k3(logprob, ref_logprob):
    """r - 1 - log r, r = pi_ref / pi, per token (Schulman 2020)."""
    log_r = ref_logprob - logprob
    return torch.exp(log_r) - log_r - 1


def gae(rewards, values, gamma, lam):
    """A_t = delta_t + gamma lam A_{t+1}, delta_t = r_t + gamma V_{t+1} - V_t, V and A 0 past the
    end (Schulman et al. 2016, eq. 16). [R]"""
    advantages = torch.zeros_like(rewards)
    after = 0.0
    for t in reversed(range(len(rewards))):
        next_value = 0.0
        if t + 1 < len(rewards):
            next_value = values[t + 1]
        after = rewards[t] + gamma * next_value - values[t] + gamma * lam * after
        advantages[t] = after
    return advantages


def the_global_batch(args, out, tok, world=2):
    """Each iteration's responses over all ranks, [{"prompt", "response" (ids), "score" (before
    the EOS penalty), "finished", "group"}], and each of its optimizer steps' minibatch over all
    ranks (places in that list), as tests/ppo_recorder.py wrote them down."""
    ranks = [json.load(open(os.path.join(out, f"rollout-rank{r}.json"))) for r in range(world)]
    iterations = []
    for records in zip(*ranks):  # one iteration: each rank's record
        samples = []
        steps = [[] for _ in records[0]["steps"]]
        for rank, record in enumerate(records):
            first = len(samples)  # this rank's responses' place in the global batch
            for i, response in enumerate(record["response_ids"]):
                text = tok.decode(response, skip_special_tokens=True)
                sample = {"prompt": record["prompt_ids"][i], "response": response}
                sample["score"] = varied(record["prompts"][i], text)
                sample["finished"] = record["finished"][i]
                sample["group"] = (rank, i // args.n_samples_per_prompt)  # its prompt's samples
                samples.append(sample)
            for k, micro_batches in enumerate(record["steps"]):
                for rows in micro_batches:  # rows of the shuffled order `order`
                    steps[k].extend(first + record["order"][row] for row in rows)
        iterations.append((samples, steps))
    return iterations


def advantages(args, samples):
    """Each sample's "advantage" (and with a critic its "return") per token, [R]."""
    if args.advantage_estimator == "gae":
        for s in samples:  # r_t = -beta KL_t, the score less the EOS penalty at the last token
            rewards = -args.kl_coef * (s["old"] - s["ref"])
            rewards[-1] += s["score"] - args.missing_eos_penalty * (not s["finished"])
            s["advantage"] = gae(rewards, s["old_values"], args.gamma, args.lam)
            s["return"] = s["advantage"] + s["old_values"]
        every = torch.cat([s["advantage"] for s in samples]).double()  # the global batch's
        mean = every.mean()
        std = torch.sqrt(((every - mean) ** 2).mean() + 1e-8)
        for s in samples:
            s["advantage"] = ((s["advantage"] - mean) / std).float()
        return
    groups = {}
    for s in samples:
        groups.setdefault(s["group"], []).append(s)
    for group in groups.values():  # grpo: (R - mean) / (std + 1e-4) over the prompt's samples
        scores = torch.tensor(
            [s["score"] - args.missing_eos_penalty * (not s["finished"]) for s in group]
        )
        for s, score in zip(group, scores):
            advantage = (score - scores.mean()) / (scores.std() + 1e-4)
            s["advantage"] = advantage.expand(len(s["response"]))


def losses(args, actor, critic, minibatch):
    """The minibatch's loss, each term a mean over all its tokens, and its logged terms."""
    n_tokens = sum(len(s["response"]) for s in minibatch)
    sums = {"policy/pg_loss": 0.0, "policy/clipfrac": 0.0, "policy/approxkl": 0.0}
    if critic is not None:
        sums.update({"val/loss": 0.0, "val/clipfrac": 0.0})
    else:
        sums["policy/kl_loss"] = 0.0
    for s in minibatch:  # one unpadded sequence at a time
        logprob = logprobs(actor, s["prompt"], s["response"], args.temperature)
        ratio = torch.exp(logprob - s["old"])
        clipped = ratio.clamp(1 - args.cliprange, 1 + args.cliprange)
        unclipped_loss = -s["advantage"] * ratio
        clipped_loss = -s["advantage"] * clipped
        sums["policy/pg_loss"] += torch.max(unclipped_loss, clipped_loss).sum()
        sums["policy/clipfrac"] += (clipped_loss > unclipped_loss).sum()
        sums["policy/approxkl"] += 0.5 * ((logprob - s["old"]) ** 2).sum()
        if critic is None:  # grpo: the KL to the reference a loss term, k3
            sums["policy/kl_loss"] += k3(logprob, s["ref"]).sum()
            continue
        value = values(critic, s["prompt"], s["response"])
        near = s["old_values"] + (value - s["old_values"]).clamp(
            -args.cliprange_value, args.cliprange_value
        )
        squared = (value - s["return"]) ** 2
        squared_near = (near - s["return"]) ** 2
        sums["val/loss"] += 0.5 * torch.max(squared, squared_near).sum()
        sums["val/clipfrac"] += (squared_near > squared).sum()
    terms = {name: total / n_tokens for name, total in sums.items()}
    loss = terms["policy/pg_loss"] + args.kl_coef * terms.get("policy/kl_loss", 0.0)
    loss = loss + terms.get("val/loss", 0.0)
    return loss, {name: term.detach().item() for name, term in terms.items()}


def plain_ppo(args, out):
    """The run's iterations redone: (each iteration's metrics, each optimizer step's gradient
    norms {role: norm}, the trained models {role: model})."""
    attention = args.attn_implementation
    actor, tok = common.load_model_and_tokenizer(args.model, AutoModelForCausalLM, attention)
    ref, _ = common.load_model_and_tokenizer(args.model, AutoModelForCausalLM, attention)
    models = {"actor": actor}
    if args.advantage_estimator == "gae":  # the critic: the backbone and a zero value head
        critic, _ = common.load_model_and_tokenizer(
            args.model, AutoModelForTokenClassification, attention, new_head=True, num_labels=1
        )
        torch.nn.init.zeros_(critic.score.weight)
        torch.nn.init.zeros_(critic.score.bias)
        models["critic"] = critic
    rates = {"actor": args.lr, "critic": args.critic_lr}
    optims = {}
    for role, model in models.items():  # torch's loop over tensors; the run's kernel is fused
        optims[role] = torch.optim.AdamW(
            model.parameters(), eps=1e-5, weight_decay=args.weight_decay, foreach=False
        )
    logged = []
    norms = []
    for step, (samples, steps) in enumerate(the_global_batch(args, out, tok)):
        with torch.no_grad():
            for s in samples:
                s["old"] = logprobs(actor, s["prompt"], s["response"], args.temperature)
                s["ref"] = logprobs(ref, s["prompt"], s["response"], args.temperature)
                if "critic" in models:
                    s["old_values"] = values(models["critic"], s["prompt"], s["response"])
        advantages(args, samples)
        decay = 1 - step / args.max_steps  # linear to 0, no warmup
        for role, optim in optims.items():
            optim.param_groups[0]["lr"] = rates[role] * decay
        sums = {}
        for minibatch in steps:
            loss, terms = losses(args, actor, models.get("critic"), [samples[i] for i in minibatch])
            loss.backward()
            norms.append({})
            for role, model in models.items():
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                norms[-1][role] = norm.item()
                optims[role].step()
                optims[role].zero_grad()
            for name, term in terms.items():
                sums[name] = sums.get(name, 0.0) + term
        n_tokens = sum(len(s["response"]) for s in samples)
        row = {name: total / len(steps) for name, total in sums.items()}
        row["objective/score"] = sum(s["score"] for s in samples) / len(samples)
        row["objective/kl"] = sum((s["old"] - s["ref"]).sum().item() for s in samples)
        row["objective/kl"] /= len(samples)
        row["objective/entropy"] = -sum(s["old"].sum().item() for s in samples) / n_tokens
        row["objective/response_len"] = n_tokens / len(samples)
        row["objective/no_eos_frac"] = sum(not s["finished"] for s in samples) / len(samples)
        row["train/lr"] = args.lr * decay
        logged.append(row)
    return logged, norms, models


def test_the_iterations_are_the_papers_over_the_whole_batch(recorded, one_rank):
    """Two ranks, micro-batches, FSDP2 and fused AdamW log, iteration by iteration, what one
    process computes from the same rollout the plain way: old and reference logprobs and values
    one sequence at a time; the KL-penalised rewards, GAE (Schulman et al. 2016, eq. 16) and its
    advantages whitened over the global batch, or GRPO's group baseline (Shao et al. 2024); the
    clipped surrogate (Schulman et al. 2017, eq. 7), the clipped value loss, GRPO's k3 KL term,
    each a mean over the minibatch's tokens, in one backward; each model's norm clipped on its
    own, torch's AdamW loop. The metrics, every optimizer step's gradient norms and the trained
    weights agree to fp32 rounding."""
    out, estimator = recorded
    args = stage_args(train_ppo, *ppo(out, estimator))
    logged, norms, models = plain_ppo(args, out)
    rows = metrics(out)
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["policy/clipfrac"] > 0 for row in logged)  # the clip is reached
    assert logged[1]["objective/kl"] != 0  # the trained policy has left the reference
    for row, want in zip(rows, logged):
        for key, value in want.items():
            assert row[key] == pytest.approx(value, rel=2e-5, abs=1e-7), (row["step"], key)
    recorded_norms = json.load(open(os.path.join(out, "rollout-rank0.json")))
    run_norms = [norm for record in recorded_norms for norm in record["grad_norms"]]
    assert len(run_norms) == len(norms) == 8
    for k, (got, want) in enumerate(zip(run_norms, norms)):
        for role, value in want.items():
            assert got[role] == pytest.approx(value, rel=2e-5), (k, role)
    # Adam divides each gradient by its own running size, so a rounding in a small one moves its
    # weight by a share of the rate: each tensor to 2e-5 of its largest entry (measured: 4e-6)
    trained = read_tensors(latest(out))
    for role, model in models.items():
        for name, want in model.state_dict().items():
            error = (trained[f"{role}.model.{name}"] - want).abs().max()
            assert error <= 2e-5 * want.abs().max(), (role, name, error.item())
