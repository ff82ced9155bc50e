"""Direct preference optimisation: the policy trained on chosen/rejected pairs, no reward model.

DPO (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a
Reward Model"): the KL-regularised reward maximisation that PPO solves by sampling has a closed-form
optimum, pi*(y|x) ∝ pi_ref(y|x) exp(r(x, y) / beta). Solved for r, the reward of a response is
beta log(pi(y|x) / pi_ref(y|x)) up to a term of x alone, which cancels between the two responses of
a pair; the Bradley–Terry loss of train_rm.py on that implicit reward is eq. 7:

    L = -log sigmoid(beta [(log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x))])

The policy and the frozen reference both start from the SFT export; the reference is FSDP2-sharded
like the policy, with no gradients. Pairs have train_rm.py's format; by default the embedded
`task.make_pairs("train")`, one near miss per prompt (train_rm.py's default takes 4). Checkpoints,
preemption, faults and exact resume as in train_sft.py; the final policy is exported as a causal
LM that train_ppo.py, vLLM and transformers load.

    torchrun --nproc_per_node=2 train_dpo.py --model runs/sft/hf --out_dir runs/dpo --resume latest
    torchrun --nproc_per_node=8 train_dpo.py --model my_sft --data pairs.jsonl --beta 0.1

Reading order: `Args`; the math (`encode_pairs`, `collate`, `sequence_logprobs`, `dpo_loss`,
`dpo_statistics`); the phases (`pair_logprobs`, `train_step`); `main` (held-out greedy accuracy:
`common.greedy_accuracy`). The plumbing (process group, sharding, logging) is in common.py.
"""

import dataclasses
import functools
import math
import time
import typing

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers import get_cosine_schedule_with_warmup

import common
import task


@dataclasses.dataclass
class Args(common.RunArgs):
    """train_dpo.py's flags. Those every stage has (resuming, saving, FSDP2, logging) come from
    `common.RunArgs`."""

    model: str = "runs/sft/hf"
    """the SFT export (HF folder or hub id): initialises the policy and the frozen reference"""
    data: str = ""
    """training JSONL, one {"prompt": ..., "chosen": ..., "rejected": ...} per line, the prompt a
    string or a conversation (a list of {"role", "content"} messages) (default: the embedded
    task's pairs)"""
    eval_data: str = ""
    """held-out JSONL of {"prompt": ..., "response": ...} ("completion" for "response", as TRL
    names it, is read too; or {"messages": [...]}, an example per assistant turn) for greedy
    exact-match accuracy (default: the embedded task's held-out split; none with --data)"""
    out_dir: str = "runs/dpo"
    """checkpoints/, metrics.jsonl and the final hf/ export go here"""
    max_steps: int = 200
    """optimizer steps in the whole run (the LR schedule spans them)"""
    save_every: int = 100
    """save a full checkpoint every this many steps (and at the end)"""
    seed: int = 42
    """seeds the data order and every RNG"""
    train_batch_size: int = 64
    """pairs per optimizer step, over all ranks"""
    micro_batch_size: int = 32
    """at most this many pairs per forward/backward on one rank (a rank's share of a
    --train_batch_size smaller than it is one; both responses of a pair in the same one)"""
    lr: float = 1e-4
    """peak learning rate (AdamW), after linear warmup, then cosine decay to 0"""
    warmup_steps: int = 10
    """linear LR warmup steps"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    beta: float = 0.1
    """β of eq. 7: the strength of the implicit KL constraint to the reference (smaller: looser)"""
    label_smoothing: float = 0.0
    """ε of conservative DPO: the labels are taken as flipped with probability ε (sigmoid loss
    only)"""
    loss_type: typing.Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO's eq. 7; ipo: Azar et al. 2023's squared loss (h - 1/(2β))² on the same
    log-ratio difference h"""
    eval_every: int = 50
    """greedy-decode the held-out set every this many steps (0: only at step 0 and the end)"""
    eval_samples: int = 256
    """held-out examples per evaluation"""


# What each number may be, checked when the flags are parsed (`common.check_limits`); every float
# must also be finite; 0 turns the *_every flags off. RunArgs' flags: `common.RUN_LIMITS`.
LIMITS = {
    "max_steps": ">= 1",
    "save_every": ">= 0",
    "train_batch_size": ">= 1",
    "micro_batch_size": ">= 1",
    "lr": ">= 0",
    "warmup_steps": ">= 0",
    "max_grad_norm": "> 0",
    "beta": "> 0",
    "label_smoothing": ">= 0",
    "eval_every": ">= 0",
    "eval_samples": ">= 0",
}


def check_loss_flags(args):
    """The flags that depend on each other, checked before any model loads (one line each)."""
    if args.loss_type == "ipo" and args.label_smoothing:
        raise SystemExit("error: --label_smoothing applies to --loss_type sigmoid only, not ipo")
    # IPO's target 1/(2β) is squared, and the squares of a batch summed, in float32: past its
    # range the first loss is inf, which the step's check would blame on --lr
    most = torch.finfo(torch.float32).max / args.train_batch_size  # one pair's loss at most
    # compared as beta, not as the square: Python's float ** raises OverflowError past 1.8e308
    least = 1 / (2 * math.sqrt(most))
    if args.loss_type == "ipo" and args.beta < least:
        raise SystemExit(
            f"error: --beta {args.beta:g}: IPO's target 1/(2 beta) = {1 / (2 * args.beta):.3g}, "
            f"whose square summed over --train_batch_size {args.train_batch_size} pairs float32 "
            f"cannot hold; expected --beta of at least {least:.3g}"
        )
    if args.label_smoothing >= 0.5:
        raise SystemExit(
            f"error: --label_smoothing {args.label_smoothing}: must be below 0.5 (at 0.5 the "
            f"loss no longer prefers either response)"
        )


# ---- the math ----------------------------------------------------------------------------------
def encode_pairs(tok, rows, max_len):
    """[((chosen ids, n_prompt), (rejected ids, n_prompt))] (a `common.TokenRows`) of
    [(where, {"prompt", "chosen", "rejected"})] rows (`common.encode_pair`: the prompt, the
    response and its end, the end a response token, so DPO also learns where to stop). A prompt
    must have a token: the response's first logprob is predicted from the one before it."""
    encode = functools.partial(encode_row, tok, max_len=max_len)
    # int32 ids (a list of lists of ints takes ~10x more), each rank encoding a share of the rows
    return common.encode_rows(rows, encode)


def encode_row(tok, row, max_len, where):
    """One row's (chosen, rejected) (`encode_pairs`)."""
    chosen, rejected = common.encode_pair(tok, row, max_len, where)
    ids, n_prompt = chosen
    common.check_prompt_ids(ids[:n_prompt], where)
    return chosen, rejected


def collate(sequences, pad_id):
    """Right-padded input_ids, attention_mask and response_mask, each [B, T], from
    [(ids, n_prompt)]. The response mask comes from the lengths, never from the ids (PAD may equal
    EOS, and the response's own EOS must count)."""
    T = max(len(ids) for ids, _ in sequences)
    input_ids = []
    attention_mask = []
    response_mask = []
    for ids, n_prompt in sequences:
        pad = T - len(ids)
        input_ids.append(ids + [pad_id] * pad)
        attention_mask.append([1] * len(ids) + [0] * pad)
        response_mask.append([0] * n_prompt + [1] * (len(ids) - n_prompt) + [0] * pad)
    return torch.tensor(input_ids), torch.tensor(attention_mask), torch.tensor(response_mask)


def sequence_logprobs(logits, input_ids, response_mask):
    """log pi(y|x) = Σ_k log pi(y_k | x, y_<k) over each sequence's response tokens: [B].
    logits [B, T, V] (position t predicts token t+1, hence the shift), input_ids and
    response_mask [B, T]. A sum, not a mean: eq. 7 is about the whole response's probability."""
    logp = logits[:, :-1].float().log_softmax(-1)  # [B, T-1, V]
    targets = input_ids[:, 1:]  # [B, T-1]
    per_token = logp.gather(-1, targets[..., None])[..., 0]  # [B, T-1]
    return (per_token * response_mask[:, 1:]).sum(-1)


def dpo_loss(pi_chosen, pi_rejected, ref_chosen, ref_rejected, n_pairs, beta, loss_type, eps):
    """The DPO loss summed over this micro-batch's pairs and divided by n_pairs, the pairs of the
    whole global batch (so micro-batches and ranks add up to the global mean). All inputs [b]:
    summed response logprobs under the policy (with gradient) and the reference.
    h = (pi_c - ref_c) - (pi_r - ref_r), the difference of log-ratios.
    sigmoid (eq. 7 of Rafailov et al. 2023), with conservative DPO's label smoothing ε:
        (1 - ε)·(-log σ(β h)) + ε·(-log σ(-β h))
    ipo (Azar et al. 2023, eq. 17): (h - 1/(2β))², a regression of h to a finite target.
    beta: β (--beta); loss_type: sigmoid or ipo (--loss_type); eps: ε (--label_smoothing)."""
    h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)  # [b]
    if loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:  # a choice added to --loss_type without its loss here
        raise ValueError(f"dpo_loss: no loss for {loss_type!r}")
    return losses.sum() / n_pairs


def dpo_statistics(pi_chosen, pi_rejected, ref_chosen, ref_rejected, beta):
    """Per-micro-batch sums of TRL's DPO metrics (divided by the global pair count when logged).
    The implicit reward of a response is β·(log pi - log pi_ref) (eq. 5 of the paper, without the
    prompt's term, which cancels within a pair). All inputs [b], detached. Each sum stays a
    float64 tensor on the device (no `.item()`: on a GPU that would wait for the micro-batch's
    backward before the next forward could be queued); summed in float64 as Python floats would."""
    reward_chosen = beta * (pi_chosen - ref_chosen)  # [b]
    reward_rejected = beta * (pi_rejected - ref_rejected)  # [b]
    return {
        "rewards/chosen": reward_chosen.sum().double(),
        "rewards/rejected": reward_rejected.sum().double(),
        # a pair counts as right when its chosen response has the higher implicit reward
        "rewards/accuracies": (reward_chosen > reward_rejected).float().sum().double(),
        "rewards/margins": (reward_chosen - reward_rejected).sum().double(),
        "logps/chosen": pi_chosen.sum().double(),
        "logps/rejected": pi_rejected.sum().double(),
    }


# ---- the phases --------------------------------------------------------------------------------
def load_data(args, tok, max_len):
    """(training pairs [(chosen, rejected)], held-out {"prompt", "response"} rows)."""
    if args.data:
        train = common.load_pairs(args.data)
        note_margins(args.data, train)
    else:
        train = common.numbered("embedded task", task.make_pairs("train"))
    if args.eval_data:
        held_out = common.load_examples(args.eval_data, tok, max_len)
    elif args.data:
        held_out = []  # a user's data has no held-out split unless --eval_data gives one
    else:
        # the prompts of task.make_pairs("test")
        held_out = common.numbered("embedded task", task.make_split("test"))
    source = args.data or "embedded task"
    train = encode_pairs(tok, train, max_len)
    if len(train) < args.train_batch_size:
        raise SystemExit(
            f"error: {source}: too few pairs for --train_batch_size "
            f"{args.train_batch_size} (it has {len(train)})"
        )
    held_out = held_out[: args.eval_samples]
    common.check_held_out(tok, held_out, max_len)
    return train, [row for _, row in held_out]


def note_margins(path, rows):
    """A note where pairs carry a "margin" (TRL's reward data may; `train_rm.py: pair_margin`
    reads it): DPO's loss has no margin of a pair's own, and the field would go unread unsaid."""
    n = sum(1 for _, row in rows if "margin" in row)
    if n:
        common.print0(
            f"note: {path}: {n:,} of its {len(rows):,} pairs have a 'margin' field, which "
            "train_rm.py reads (the Bradley-Terry margin); DPO's loss has none and leaves it unread"
        )


def pair_logprobs(model, pairs, pad_id, device):
    """(log pi(y_c|x) [b], log pi(y_r|x) [b]) of pairs [(chosen, rejected)]: both responses of a
    pair in one forward (a collective: the model is sharded), so a pair is never split."""
    sequences = [c for c, _ in pairs] + [r for _, r in pairs]
    input_ids, attention_mask, response_mask = collate(sequences, pad_id)
    # The LM head only from the shortest prompt's last column on, where the right-padded rows'
    # responses are predicted (as train_sft.py: micro_batch_loss; the same logprobs, tested)
    keep = input_ids.shape[1] - min(n_prompt for _, n_prompt in sequences) + 1
    # use_cache=False: no KV cache in a training forward (cf. common.checkpoint_activations)
    logits = model(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        use_cache=False,
        **common.head_only_at_last(model, keep),
    ).logits  # [2b, keep, V], or [2b, T, V] for a model without logits_to_keep
    K = logits.shape[1]  # the same columns of the ids and the mask, counted from the right
    logps = sequence_logprobs(
        logits, input_ids[:, -K:].to(device), response_mask[:, -K:].to(device)
    )
    return logps[: len(pairs)], logps[len(pairs) :]


def train_step(args, model, reference, optim, sched, mine, pad_id, device):
    """One optimizer step on `mine`, this rank's share of the global batch of pairs, with gradient
    accumulation over micro-batches; the reference's logprobs per micro-batch, without gradient.
    Returns the step's metrics (logged under TRL's names)."""
    world = dist.get_world_size()
    sums = {"loss": 0.0}
    for start in range(0, len(mine), args.micro_batch_size):
        micro = mine[start : start + args.micro_batch_size]
        with torch.no_grad():
            ref_chosen, ref_rejected = pair_logprobs(reference, micro, pad_id, device)
        pi_chosen, pi_rejected = pair_logprobs(model, micro, pad_id, device)
        loss = dpo_loss(
            pi_chosen,
            pi_rejected,
            ref_chosen,
            ref_rejected,
            n_pairs=args.train_batch_size,
            beta=args.beta,
            loss_type=args.loss_type,
            eps=args.label_smoothing,
        )
        # FSDP averages gradients over ranks; the loss is already a global pair mean: undo that
        (loss * world).backward()
        sums["loss"] += loss.detach().double()  # a tensor: no host sync per micro-batch
        statistics = dpo_statistics(
            pi_chosen.detach(), pi_rejected.detach(), ref_chosen, ref_rejected, args.beta
        )
        for name, value in statistics.items():
            sums[name] = sums.get(name, 0.0) + value
    grad_norm = common.clip_grad_norm(model, args.max_grad_norm, "policy")
    optim.step()
    lr = sched.get_last_lr()[0]  # the rate this step trained at (before the schedule moves on)
    sched.step()
    optim.zero_grad(set_to_none=True)
    totals = common.global_sums(sums, device)  # for logging only: the global batch's sums
    metrics = {"train/loss": totals.pop("loss")}
    # rewards/* and logps/*: means over the pairs of the global batch, before this step's update
    metrics.update({name: value / args.train_batch_size for name, value in totals.items()})
    metrics["train/lr"] = lr
    metrics["train/grad_norm"] = grad_norm.item()
    return metrics


def main(args):
    rank, world, device = common.init_distributed(args.seed, args.timeout_minutes)
    common.make_local_dir(args)
    common.check_batch_sizes(args, world)
    check_loss_flags(args)
    per_rank = args.train_batch_size // world
    metrics_log = common.MetricsLog(common.local_dir(args), args.tensorboard, args.out_dir)

    model, tok = common.load_model_and_tokenizer(
        args.model, AutoModelForCausalLM, args.attn_implementation
    )
    common.record_template_kwargs(tok, args.model)  # so the export renders as this run did
    # The policy stays in eval mode (from_pretrained's), dropout off, as in the DPO authors' code
    # (`disable_dropout`) and TRL's (`disable_dropout=True`): the implicit reward
    # β·log(π/π_ref) then compares the two models themselves, not a dropout mask, and at step 1
    # h = 0 and the sigmoid loss is log 2 for any model (ipo: 1/(4β²)), up to the rounding of the
    # two forwards' kernels (exactly, with eager attention: README, train_dpo.py).
    model.eval()
    # The model folder's generation_config goes to the export (with the responses' end among its
    # stop ids); greedy evaluation runs with no decoding defaults of the model's own (cf.
    # common.neutral_generation_config).
    stop_ids = common.stop_token_ids(tok, model.generation_config)
    export_generation_config = common.stopping_at(model.generation_config, stop_ids)
    model.generation_config = common.neutral_generation_config(stop_ids, tok.pad_token_id)
    train, held_out = load_data(args, tok, common.context_length(args.model, model.config))
    common.print_plan(args, "pairs", len(train), len(held_out), args.train_batch_size)
    if args.gradient_checkpointing:
        common.checkpoint_activations(model)
    common.shard_model(model, device, reshard_after_forward=args.reshard_after_forward)
    # The reference: the same export, frozen, in eval mode (no dropout: its logprobs are those of
    # pi_ref itself). Loaded before any RNG draw, so a resumed run builds the same one; once the
    # policy is sharded, so a rank holds one whole model in host memory at a time.
    reference, _ = common.load_model_and_tokenizer(
        args.model, AutoModelForCausalLM, args.attn_implementation
    )
    reference.requires_grad_(False)
    reference.eval()
    common.shard_model(reference, device, reshard_after_forward=args.reshard_after_forward)
    # fused: one kernel for AdamW's element-wise math (README: Benchmarks)
    optim = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True
    )
    sched = get_cosine_schedule_with_warmup(optim, args.warmup_steps, args.max_steps)
    roles = {"model": (model, optim)}  # the reference is the export itself: never saved
    # so a resume checks that --model's folder still holds it (`checkpoint.load`)
    frozen = {"model": common.weights_fingerprint(reference, device)}
    # and that its config.json, generation config and tokenizer are those the run began with
    folders = {"model": common.folder_identity(args.model)}

    # flags a resume may not change: the examples each step sees, and the loss
    must_match = ["model", "data", "seed", "train_batch_size"]
    must_match += ["beta", "label_smoothing", "loss_type"]
    start, final = common.resume(args, roles, sched, must_match, frozen, folders)
    # the rows a killed run logged after the checkpoint go (all of them on a fresh start)
    metrics_log.truncate(start if final else None)
    if held_out and not final:
        # step 0: the starting policy's accuracy, what DPO must not lose (greedy: no RNG drawn)
        accuracy = common.greedy_accuracy(model, tok, held_out, stop_ids, device)
        metrics_log.log({"eval/accuracy": accuracy}, 0)
        common.print0(f"step 0: held-out accuracy {accuracy:.3f}")

    step = start
    pbar = common.progress_bar(args.max_steps, start, "dpo")
    for step in range(start + 1, args.max_steps + 1):
        t0 = time.time()
        idx, epoch = common.batch_indices(step - 1, len(train), args.train_batch_size, args.seed)
        my_idx = idx[rank * per_rank : (rank + 1) * per_rank]  # this rank's share of the batch
        mine = [train[i] for i in my_idx]
        pad_id = tok.pad_token_id
        metrics = train_step(args, model, reference, optim, sched, mine, pad_id, device)
        metrics["train/epoch"] = epoch
        metrics["time/step_s"] = time.time() - t0
        if held_out and common.eval_due(args, step):
            metrics["eval/accuracy"] = common.greedy_accuracy(
                model, tok, held_out, stop_ids, device
            )
            common.print0(f"step {step}: held-out accuracy {metrics['eval/accuracy']:.3f}")
        metrics_log.log(metrics, step)
        pbar.update(1)
        pbar.set_postfix(loss=f"{metrics['train/loss']:.4f}")

        meta = {
            "scheduler": sched.state_dict(),
            "epoch": epoch,
            "consumed_samples": step * args.train_batch_size,
            "frozen": frozen,
            "folders": folders,
        }
        hf_objs = (model.config, tok, export_generation_config)
        saved, stop = common.end_of_step(args, step, device, roles, meta, hf_objs)
        if step == args.max_steps:
            final = saved
        if stop:
            break
    common.close_progress_bar(pbar)

    common.finish(args, step, final)  # the export for PPO, vLLM and transformers; a summary
    dist.barrier()  # nobody tears the group down while rank 0 is still writing
    dist.destroy_process_group()


if __name__ == "__main__":
    common.run(main, Args, LIMITS)
