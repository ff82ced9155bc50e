"""Reward-model training: a Bradley–Terry loss on pairs of a chosen and a rejected response.

Stage 2 of RLHF (Stiennon et al. 2020, "Learning to summarize from human feedback", eq. 1; Ouyang
et al. 2022, eq. 1; the reward-model details of Huang et al. 2023, "The N Implementation Details
of RLHF with PPO", [N RM #item] at each use): a scalar score r(x, y), trained so that the chosen
response of a pair scores above the rejected one, which PPO (`train_ppo.py --reward_model`) then
maximises. The model is the SFT export (or any causal LM folder) as an
`AutoModelForSequenceClassification` with one output; its score is the head's output at the last
real token of the sequence. FSDP2 and checkpoints as in train_sft.py: bitwise-exact resume,
preemption, faults.

A response is encoded exactly as `train_ppo.py: reward_model_inputs` encodes a finished one: the
prompt's tokens (through the chat template when the tokenizer has one), the response's tokens
(as they continue the prompt: `common.encode_response`), then the response's end (the tokenizer's
EOS, or the template's end of turn: `common.response_end_id`). PPO thus scores its responses in
the format the reward model was trained on. At the end, the reward's mean and std over chosen
responses of the training data go into the export's config.json (`reward_mean`, `reward_std`);
PPO normalises the score with them.

    torchrun --nproc_per_node=2 train_rm.py --model runs/sft/hf --out_dir runs/rm [--resume latest]
    torchrun --nproc_per_node=8 train_rm.py --model my_sft --data pairs.jsonl --eval_data held.jsonl

Reading order: `Args`; the math (`encode_pairs`, `bradley_terry_loss`; the score, which PPO reads
the same way, is `common.sequence_scores`, at the last real token: `common.last_token_scores`);
the phases (`pair_scores`, `train_step`, `evaluate`, `reward_stats`); setup and the last step
(`build_reward_model`, `record_reward_scale`); `main`. The plumbing (process group, sharding,
logging) is in common.py.
"""

import copy
import dataclasses
import functools
import math
import time
import typing

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification
from transformers import get_cosine_schedule_with_warmup

import common
import task


@dataclasses.dataclass
class Args(common.RunArgs):
    """train_rm.py's flags. Those every stage has (resuming, saving, FSDP2, logging) come from
    `common.RunArgs`."""

    model: str = "runs/sft/hf"
    """the SFT export, or any causal LM or sequence-classification folder or hub id: the reward
    model's backbone"""
    data: str = ""
    """training JSONL, one {"prompt": ..., "chosen": ..., "rejected": ...} per line, the prompt a
    string or a conversation (a list of {"role", "content"} messages) (default: the embedded
    task's pairs)"""
    eval_data: str = ""
    """held-out JSONL in the same format (default: the embedded task's held-out pairs; none with
    --data)"""
    out_dir: str = "runs/rm"
    """checkpoints/, metrics.jsonl and the final hf/ export go here"""
    max_steps: int = 2000
    """optimizer steps in the whole run (the LR schedule spans them)"""
    save_every: int = 250
    """save a full checkpoint every this many steps (and at the end)"""
    seed: int = 42
    """seeds the data order, the reward head's initialisation and every RNG"""
    train_batch_size: int = 64
    """pairs per optimizer step, over all ranks"""
    micro_batch_size: int = 32
    """at most this many pairs per forward/backward on one rank (a rank's share of a
    --train_batch_size smaller than it is one; both responses of a pair in the same one)"""
    lr: float = 3e-4
    """peak learning rate (AdamW), after linear warmup, then cosine decay to 0"""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay"""
    warmup_steps: int = 10
    """linear LR warmup steps"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    pairs_per_prompt: int = 4
    """embedded task only: near misses per training prompt (more pairs with a digit off by one,
    which the model must add to judge; the held-out pairs keep one each, so eval/accuracy means the
    same at every setting)"""
    margin: float = 0.0
    """the chosen response must beat the rejected one by this much: -logsigmoid(r_c - r_r - m);
    a pair's own "margin" field, where the data gives one (TRL's margin column), is its margin
    instead (the two are not given together)"""
    norm_samples: int = 1024
    """distinct chosen responses of the training data scored at the end for the reward's mean and
    std (config.json's reward_mean and reward_std, which PPO normalises with)"""
    eval_every: int = 250
    """score the held-out pairs every this many steps (0: only at the end)"""
    eval_samples: int = 1000
    """held-out pairs per evaluation"""


# What each number may be, checked when the flags are parsed (`common.check_limits`); every float
# must also be finite; 0 turns the *_every flags off. RunArgs' flags: `common.RUN_LIMITS`.
LIMITS = {
    "max_steps": ">= 1",
    "save_every": ">= 0",
    "train_batch_size": ">= 1",
    "micro_batch_size": ">= 1",
    "lr": ">= 0",
    "weight_decay": ">= 0",
    "warmup_steps": ">= 0",
    "pairs_per_prompt": ">= 1",
    "max_grad_norm": "> 0",
    "margin": ">= 0",
    "norm_samples": ">= 2",
    "eval_every": ">= 0",
    "eval_samples": ">= 0",
}

# What a checkpoint written before a must-match flag existed ran with, where that is not the
# flag's default (`common.arg_defaults`): one pair per prompt (`task.make_pairs`), before
# --pairs_per_prompt
BEFORE_FLAGS = {"pairs_per_prompt": 1}


# ---- the math ----------------------------------------------------------------------------------
class Pair(typing.NamedTuple):
    chosen: list  # token ids: the prompt, the chosen response and its end
    rejected: list  # the same with the rejected response
    margin: float  # by how much r(chosen) must beat r(rejected) (`bradley_terry_loss`)


def encode_pairs(tok, rows, max_len, margin=0.0):
    """[Pair] (a `common.TokenRows`) of [(where, {"prompt", "chosen", "rejected"})] rows, each
    sequence the prompt, the response and its end (`common.encode_pair`, as PPO scores a finished
    response). The reward model reads the whole sequence, so the prompt's length is not kept. A
    pair's margin is its row's "margin" field (`pair_margin`), else `margin` (--margin)."""
    given = "margin" in common.given_flags()  # --margin 0 spelt out is a margin given too
    encode = functools.partial(encode_row, tok, max_len=max_len, margin=margin, given=given)
    # int32 ids (a list of lists of ints takes ~10x more), each rank encoding a share of the rows
    return common.encode_rows(rows, encode)


def encode_row(tok, row, max_len, where, margin, given):
    """One row's Pair (`encode_pairs`)."""
    (chosen, _), (rejected, _) = common.encode_pair(tok, row, max_len, where)
    return Pair(chosen, rejected, pair_margin(where, row, margin, given))


def pair_margin(where, row, margin, given=False):
    """A row's own "margin" (TRL's reward data may carry one per pair, as Llama 2's margin by
    preference strength), a number float32 holds (negative too, as TRL takes it); else
    --margin's. Both at once (`given`: --margin on the command line, 0 too) is one line: which
    one was meant cannot be told."""
    if "margin" not in row:
        return margin
    value = common.finite_number(row["margin"])
    if value is None:
        raise SystemExit(
            f"error: {where}: field 'margin': expected a number finite in float32, got "
            f"{row['margin']!r:.100}"
        )
    if margin != 0 or given:
        raise SystemExit(f"error: {where}: a 'margin' field beside --margin {margin}; give one")
    return value


def bradley_terry_loss(r_chosen, r_rejected, margin, n_pairs):
    """-log sigmoid(r(x, y_c) - r(x, y_r) - margin), summed over this micro-batch's pairs and
    divided by n_pairs, the pairs of the whole global batch (Stiennon et al. 2020, eq. 1; Ouyang
    et al. 2022, eq. 1, without its per-prompt 1/C(K,2) weight and batching: each pair weighs the
    same, and a prompt's pairs are shuffled apart, which InstructGPT reports overfit its reward
    model; the margin as in Llama 2, Touvron et al. 2023, eq. 2). r_* [b]; margin a number or
    one per pair [b]."""
    return -F.logsigmoid(r_chosen - r_rejected - margin).sum() / n_pairs


def init_reward_head(head, seed):
    """A fresh reward head: weights N(0, 1/sqrt(d_model + 1)), bias 0 [N RM #2], drawn from a
    generator of its own, so every rank (and a resumed run) starts from the same head."""
    generator = torch.Generator().manual_seed(seed)
    d_model = head.weight.shape[1]
    with torch.no_grad():
        head.weight.normal_(0.0, 1 / math.sqrt(d_model + 1), generator=generator)
        if head.bias is not None:
            head.bias.zero_()


# ---- the phases --------------------------------------------------------------------------------
def check_pairs_flag(args):
    """--pairs_per_prompt makes the embedded task's pairs; a --data file's are its own. Given with
    --data (spelt out at its default too) it did nothing, silently, yet a resume without it was
    refused as another run's."""
    if args.data and common.flag_given(args, "pairs_per_prompt"):
        raise SystemExit(
            f"error: --pairs_per_prompt {args.pairs_per_prompt}: makes the embedded task's pairs; "
            f"--data {args.data} gives its own"
        )


def load_data(args, tok, max_len):
    """(training pairs, held-out pairs), each [Pair]."""
    if args.data:
        train = common.load_pairs(args.data)
    else:
        train = common.numbered("embedded task", task.make_pairs("train", args.pairs_per_prompt))
    if args.eval_data:
        held_out = common.load_pairs(args.eval_data)
    elif args.data:
        held_out = []  # a user's data has no held-out split unless --eval_data gives one
    else:
        # prompts of the held-out split only
        held_out = common.numbered("embedded task", task.make_pairs("test"))
    source = args.data or "embedded task"
    train = encode_pairs(tok, train, max_len, args.margin)
    held_out = encode_pairs(tok, held_out[: args.eval_samples], max_len, args.margin)
    if len(train) < args.train_batch_size:
        raise SystemExit(
            f"error: {source}: too few pairs for --train_batch_size "
            f"{args.train_batch_size} (it has {len(train)})"
        )
    return train, held_out


def pair_scores(model, pairs, pad_id, device):
    """(r_chosen [b], r_rejected [b]) of pairs [Pair]: both responses of a pair in one forward, so
    a pair is never split across micro-batches or ranks."""
    chosen = [pair.chosen for pair in pairs]
    rejected = [pair.rejected for pair in pairs]
    scores = common.sequence_scores(model, chosen + rejected, pad_id, device)  # [2b]
    return scores[: len(pairs)], scores[len(pairs) :]


def train_step(args, model, optim, sched, mine, pad_id, device):
    """One optimizer step on `mine`, this rank's share of the global batch of pairs, with gradient
    accumulation over micro-batches. Returns the step's metrics."""
    world = dist.get_world_size()
    sums = {"loss": 0.0, "correct": 0.0}
    for start in range(0, len(mine), args.micro_batch_size):
        micro = mine[start : start + args.micro_batch_size]
        r_chosen, r_rejected = pair_scores(model, micro, pad_id, device)
        margins = torch.tensor([pair.margin for pair in micro], device=r_chosen.device)  # [b]
        loss = bradley_terry_loss(r_chosen, r_rejected, margins, args.train_batch_size)
        # FSDP averages gradients over ranks; the loss is already a global pair mean: undo that
        (loss * world).backward()
        # float64 tensors on the device, summed as Python floats would be: an `.item()` here
        # would make the host wait for each micro-batch's backward on a GPU
        sums["loss"] += loss.detach().double()
        sums["correct"] += (r_chosen > r_rejected).sum().double()
    grad_norm = common.clip_grad_norm(model, args.max_grad_norm, "reward model")
    optim.step()
    lr = sched.get_last_lr()[0]  # the rate this step trained at (before the schedule moves on)
    sched.step()
    optim.zero_grad(set_to_none=True)
    totals = common.global_sums(sums, device)  # for logging only: the global batch's sums
    return {
        "train/loss": totals["loss"],
        "train/accuracy": totals["correct"] / args.train_batch_size,
        "train/lr": lr,
        "train/grad_norm": grad_norm.item(),
    }


@torch.no_grad()
def evaluate(model, pairs, pad_id, batch_size, device):
    """How the held-out pairs are ranked: the share with r_chosen > r_rejected, the mean margin
    r_chosen - r_rejected, and the mean of each reward. Collective: every rank scores an equal
    share (`common.eval_share`)."""
    mine, counted = common.eval_share(pairs)  # equal shares: every forward is a collective
    chosen = []
    rejected = []
    for start in range(0, len(mine), batch_size):
        r_chosen, r_rejected = pair_scores(model, mine[start : start + batch_size], pad_id, device)
        chosen.append(r_chosen)
        rejected.append(r_rejected)
    r_chosen = torch.cat(chosen)[:counted]  # [counted]
    r_rejected = torch.cat(rejected)[:counted]
    local = {
        "correct": (r_chosen > r_rejected).sum(),
        "margin": (r_chosen - r_rejected).sum(),
        "chosen": r_chosen.sum(),
        "rejected": r_rejected.sum(),
        "pairs": counted,
    }
    totals = common.global_sums(local, device)  # every rank's share, one collective
    n = totals["pairs"]
    return {
        "eval/accuracy": totals["correct"] / n,
        "eval/margin": totals["margin"] / n,
        "eval/reward_chosen": totals["chosen"] / n,
        "eval/reward_rejected": totals["rejected"] / n,
    }


@torch.no_grad()
def reward_stats(model, sequences, pad_id, batch_size, device):
    """(mean, std) of r over `sequences` (chosen responses of the training data): what PPO
    subtracts and divides by, so that a --kl_coef means the same for any reward model: mean 0
    and std 1 as Ziegler et al. 2019 [N RM #3], who take them over samples of the initial
    policy; here over chosen training responses, the analogue of the reference summaries on
    which Stiennon et al. 2020 (sec. 3.4) set the mean alone to 0. Two passes, like
    train_ppo.py's whitening, and like it the biased std (over n; OpenRLHF's is over n - 1, a
    relative difference of 1/(2n) at --norm_samples n). Collective: every rank scores an equal
    share."""
    mine, counted = common.eval_share(sequences)
    scores = []
    for start in range(0, len(mine), batch_size):
        scores.append(
            common.sequence_scores(model, mine[start : start + batch_size], pad_id, device)
        )
    r = torch.cat(scores)[:counted].double()  # [counted]
    totals = common.global_sums({"sum": r.sum(), "n": counted}, device)  # the global mean first
    mean = totals["sum"] / totals["n"]
    squares = common.global_sums({"sq": ((r - mean) ** 2).sum()}, device)  # then the spread
    return mean, math.sqrt(squares["sq"] / totals["n"])


def build_reward_model(args):
    """(model, tok): --model as a sequence classifier with one output, its head fresh (from a
    causal LM) or its own (a reward model trained further), in eval mode."""
    model, tok = common.load_model_and_tokenizer(
        args.model,
        AutoModelForSequenceClassification,
        args.attn_implementation,
        new_head=True,  # from a causal LM; a reward model's own head is kept (below)
        num_labels=1,
    )
    common.record_template_kwargs(tok, args.model)  # so the export renders as this run did
    # A causal LM folder has no reward head: transformers made one from the global RNG, which
    # differs per rank. A sequence classifier's own head (a reward model trained on) is kept.
    if model.fresh_head:
        init_reward_head(common.value_head(model), args.seed)
    # transformers' forward refuses a batch without a pad id; ours reads the score's position
    # from the mask. The checkpoints and the export save it where it is safe (`SavedConfig`).
    common.set_pad_token_id(model.config, tok.pad_token_id)
    # A reward model trained further carries the statistics of its old scores: dropped, so that
    # nothing saved carries another model's (each save records this model's: `main`).
    for key in ("reward_mean", "reward_std"):
        if hasattr(model.config, key):
            delattr(model.config, key)
    # The model stays in eval mode (from_pretrained's): dropout off while training too, as TRL's
    # RewardTrainer (`disable_dropout=True`). PPO reads the score in eval mode, and the mean and
    # std recorded for its normalisation are taken so; a loss under dropout would fit the scores
    # of thinned networks instead, whose scale differs (a model of a family without dropout, as
    # Llama and Qwen ship, trains the same either way).
    model.eval()
    return model, tok


class SavedConfig:
    """The reward model's config as its checkpoints and export save it: the model's own (its
    reward_mean and reward_std as last recorded), with no `pad_token_id` where PAD is a token
    every scored sequence ends with (EOS standing in for a missing PAD: Llama 3 base, GPT-2;
    PAD == EOS: Qwen2.5 base; Llama 3 tuned with <|eot_id|> as PAD). Plain transformers scores
    a sequence at its last token that is not PAD, there the token before the end this model
    learned to score at; with none it takes the last token (and refuses a batch: pad it and read
    the position from the mask, as plainrlhf does). Training keeps the id on the model, whose
    forward refuses batches without one; PPO sets it again when it loads the export."""

    def __init__(self, config, tok):
        self.config = config
        self.pad_token_id = tok.pad_token_id
        if tok.pad_token_id in (tok.eos_token_id, common.response_end_id(tok)):
            self.pad_token_id = None

    def save_pretrained(self, path):
        config = copy.deepcopy(self.config)
        common.set_pad_token_id(config, self.pad_token_id)
        config.save_pretrained(path)


def distinct_chosen(train, n):
    """The first n distinct chosen sequences of the training pairs, in order: a prompt's pairs
    share its chosen response (`--pairs_per_prompt 4`: the first 1024 pairs hold 257 distinct
    ones), and a repeated one would weigh four times in the statistics."""
    chosen = {}
    for pair in train:
        chosen.setdefault(tuple(pair.chosen), pair.chosen)  # dicts keep the order of insertion
        if len(chosen) == n:
            break
    return list(chosen.values())


@torch.no_grad()
def record_reward_scale(args, model, train, pad_id, device):
    """The reward's mean and std over --norm_samples distinct chosen responses of the training
    pairs (`distinct_chosen`, `reward_stats`), written into the model's config for PPO's
    normalisation: in every checkpoint's config (main records them before each save), and so in
    the export. Returns them as metrics."""
    chosen = distinct_chosen(train, args.norm_samples)
    mean, std = reward_stats(model, chosen, pad_id, args.micro_batch_size, device)
    model.config.reward_mean = mean
    model.config.reward_std = std
    return {"train/reward_mean": mean, "train/reward_std": std}


def main(args):
    rank, world, device = common.init_distributed(args.seed, args.timeout_minutes)
    common.make_local_dir(args)
    common.check_batch_sizes(args, world)
    check_pairs_flag(args)
    per_rank = args.train_batch_size // world
    metrics_log = common.MetricsLog(common.local_dir(args), args.tensorboard, args.out_dir)

    model, tok = build_reward_model(args)
    train, held_out = load_data(args, tok, common.context_length(args.model, model.config))
    common.print_plan(args, "pairs", len(train), len(held_out), args.train_batch_size)
    if args.gradient_checkpointing:
        common.checkpoint_activations(model)
    common.shard_model(model, device, reshard_after_forward=args.reshard_after_forward)
    # fused: one kernel for AdamW's element-wise math (README: Benchmarks)
    optim = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=args.weight_decay,
        fused=True,
    )
    sched = get_cosine_schedule_with_warmup(optim, args.warmup_steps, args.max_steps)
    roles = {"reward_model": (model, optim)}

    # a resume builds the model from --model's config.json and tokenises with its tokenizer
    # again: they must be those the run began with (`checkpoint.load`)
    folders = {"model": common.folder_identity(args.model)}
    # flags a resume may not change: the examples each step sees (--pairs_per_prompt makes the
    # embedded training set, whose size orders the batches) and the loss
    must_match = ["model", "data", "seed", "train_batch_size", "margin"]
    must_match += ["pairs_per_prompt"]
    start, final = common.resume(
        args, roles, sched, must_match, folders=folders, before=BEFORE_FLAGS
    )
    # the rows a killed run logged after the checkpoint go (all of them on a fresh start)
    metrics_log.truncate(start if final else None)

    step = start
    pbar = common.progress_bar(args.max_steps, start, "rm")
    for step in range(start + 1, args.max_steps + 1):
        t0 = time.time()
        idx, epoch = common.batch_indices(step - 1, len(train), args.train_batch_size, args.seed)
        my_idx = idx[rank * per_rank : (rank + 1) * per_rank]  # this rank's share of the batch
        mine = [train[i] for i in my_idx]
        metrics = train_step(args, model, optim, sched, mine, tok.pad_token_id, device)
        metrics["train/epoch"] = epoch
        metrics["time/step_s"] = time.time() - t0
        batch = args.micro_batch_size
        if held_out and common.eval_due(args, step):
            metrics.update(evaluate(model, held_out, tok.pad_token_id, batch, device))
            common.print0(f"step {step}: held-out pair accuracy {metrics['eval/accuracy']:.3f}")
        if step == args.max_steps:
            metrics.update(record_reward_scale(args, model, train, tok.pad_token_id, device))
        metrics_log.log(metrics, step)
        pbar.update(1)
        pbar.set_postfix(loss=f"{metrics['train/loss']:.4f}")

        meta = {
            "scheduler": sched.state_dict(),
            "epoch": epoch,
            "consumed_samples": step * args.train_batch_size,
            "folders": folders,
        }
        # every checkpoint's config holds its own weights' statistics (the last step's are
        # recorded above), so a resume that ends at its step, or its export, is PPO's as is
        record = None
        if step != args.max_steps:
            record = functools.partial(
                record_reward_scale, args, model, train, tok.pad_token_id, device
            )
        hf_objs = (SavedConfig(model.config, tok), tok)
        saved, stop = common.end_of_step(args, step, device, roles, meta, hf_objs, record)
        if step == args.max_steps:
            final = saved
        if stop:
            break
    common.close_progress_bar(pbar)

    common.finish(args, step, final, "reward_model")  # the export for PPO and transformers
    dist.barrier()  # nobody tears the group down while rank 0 is still writing
    dist.destroy_process_group()


if __name__ == "__main__":
    common.run(main, Args, LIMITS)
