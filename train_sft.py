"""Supervised fine-tuning: next-token cross-entropy on the response tokens only.

Stage 1 of RLHF (Ouyang et al. 2022, "Training language models to follow instructions with human
feedback"): teach the task's format before PPO optimises a reward. FSDP2 (`fully_shard` per
decoder layer, then the root) on one code path for gloo/CPU and NCCL/GPU; checkpoints resume
bitwise exactly.

    torchrun --nproc_per_node=2 train_sft.py --out_dir runs/sft [--resume latest]   # embedded task
    torchrun --nproc_per_node=8 train_sft.py --model Qwen/Qwen2.5-0.5B --data my.jsonl

Reading order: `Args`; the math (`encode`, `collate`, `sft_loss`); the phase `train_step`;
`main` (held-out greedy accuracy: `common.greedy_accuracy`). The plumbing (process group,
sharding, logging) is in common.py.
"""

import dataclasses
import functools
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers import get_cosine_schedule_with_warmup

import common
import task


@dataclasses.dataclass
class Args(common.RunArgs):
    """train_sft.py's flags. Those every stage has (resuming, saving, FSDP2, logging) come from
    `common.RunArgs`."""

    model: str = task.TINY_MODEL
    """HF model folder or hub id (default: the embedded tiny Llama, built on first use)"""
    data: str = ""
    """training JSONL, one {"prompt": ..., "response": ...} per line ("completion" for
    "response", as TRL names it, is read too), the prompt a string or a conversation (a list of
    {"role", "content"} messages); or {"messages": [...]}, an example per assistant turn
    (default: the embedded task)"""
    eval_data: str = ""
    """held-out JSONL in the same format (default: the embedded task's held-out split; none with
    --data)"""
    out_dir: str = "runs/sft"
    """checkpoints/, metrics.jsonl and the final hf/ export go here"""
    max_steps: int = 1000
    """optimizer steps in the whole run (the LR schedule spans them). The defaults of this flag,
    --train_batch_size and --weight_decay are the first setting found to teach the embedded task
    at every seed tried (87.5 to 99.6 percent held-out at seeds 42 and 1-6; README: train_sft.py)"""
    save_every: int = 200
    """save a full checkpoint every this many steps (and at the end)"""
    seed: int = 42
    """seeds the data order and every RNG"""
    train_batch_size: int = 128
    """examples per optimizer step, over all ranks"""
    micro_batch_size: int = 32
    """at most this many examples per forward/backward on one rank (a rank's share of a
    --train_batch_size smaller than it is one); grad accumulation makes up the rest"""
    lr: float = 3e-3
    """peak learning rate (AdamW), after linear warmup, then cosine decay to 0"""
    weight_decay: float = 1.0
    """AdamW's decoupled weight decay (each step shrinks the weights by lr x this). Strong on the
    embedded task on purpose: without it the tiny model's escape from its loss plateau is a lottery
    in the seed"""
    warmup_steps: int = 30
    """linear LR warmup steps"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    eval_every: int = 100
    """greedy-decode the held-out set every this many steps (0: only at the end)"""
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
    "weight_decay": ">= 0",
    "warmup_steps": ">= 0",
    "max_grad_norm": "> 0",
    "eval_every": ">= 0",
    "eval_samples": ">= 0",
}


# ---- the math ----------------------------------------------------------------------------------
def encode(tok, example, max_len, where):
    """(input_ids, n_prompt): the prompt's tokens, then the response and its end (EOS, or the
    chat template's end of turn: `common.response_end_id`), which the loss is taken on. `where`
    names the example in the error if it does not fit the context."""
    text = common.prompt_content(tok, example["prompt"], where) + example["response"]
    common.check_fits(tok, text, max_len, where)
    responses = [("'response'", example["response"])]
    common.check_special_text(tok, where, example["prompt"], responses)
    prompt = common.encode_prompt(tok, example["prompt"], where)
    common.check_prompt_ids(prompt, where)
    common.check_response_start(tok, example["prompt"], example["response"], where)
    response = common.encode_response(tok, example["prompt"], example["response"])
    response = response + [common.response_end_id(tok)]  # EOS, or the template's end of turn
    length = len(prompt) + len(response)
    if length > max_len:
        raise SystemExit(
            f"error: {where}: prompt+response is {length} tokens, longer than the model's "
            f"context (max_position_embeddings {max_len})"
        )
    return prompt + response, len(prompt)


def collate(examples, pad_id):
    """Right-padded input_ids, attention_mask, and labels = -100 except on response tokens.
    examples: [(input_ids, n_prompt)]; returns three [B, T] tensors."""
    T = max(len(ids) for ids, _ in examples)
    input_ids = []
    attention_mask = []
    labels = []
    for ids, n_prompt in examples:
        pad = T - len(ids)
        input_ids.append(ids + [pad_id] * pad)
        attention_mask.append([1] * len(ids) + [0] * pad)
        labels.append([-100] * n_prompt + ids[n_prompt:] + [-100] * pad)
    return torch.tensor(input_ids), torch.tensor(attention_mask), torch.tensor(labels)


def sft_loss(logits, labels, n_tokens):
    """The SFT objective (Ouyang et al. 2022, sec. 3.5: supervised fine-tuning on demonstrations),
    the negative log-likelihood of the response given the prompt: next-token cross-entropy summed
    over response tokens, divided by n_tokens (the response tokens of the whole global batch, so
    micro-batches and ranks add up to the global mean).
    logits [B, T, V], labels [B, T]: position t predicts token t+1, hence the shift by one."""
    logits = logits[:, :-1].flatten(0, 1).float()  # [B*(T-1), V]
    targets = labels[:, 1:].flatten()  # [B*(T-1)]
    loss_sum = F.cross_entropy(logits, targets, reduction="sum", ignore_index=-100)
    return loss_sum / n_tokens


def batch_tokens(examples):
    """The number of response tokens (loss targets) in [(input_ids, n_prompt)]."""
    return sum(len(ids) - n_prompt for ids, n_prompt in examples)


# ---- the phases --------------------------------------------------------------------------------
def load_data(args, tok, max_len):
    """(training examples as (input_ids, n_prompt) in a `common.TokenRows`, held-out {"prompt",
    "response"} rows); the rows come as [(where, row)] (`common.load_examples`: a {"messages"} row
    is one example per assistant turn), so an error names a row's file and line."""
    if args.data:
        train = common.load_examples(args.data, tok, max_len)
    else:
        train = common.numbered("embedded task", task.make_split("train"))
    if args.eval_data:
        held_out = common.load_examples(args.eval_data, tok, max_len)
    elif args.data:
        held_out = []  # a user's data has no held-out split unless --eval_data gives one
    else:
        held_out = common.numbered("embedded task", task.make_split("test"))
    source = args.data or "embedded task"
    # int32 ids (`common.TokenRows`: a list of lists of ints takes ~10x more), each rank
    # encoding a share of the rows (`common.encode_rows`)
    train = common.encode_rows(train, functools.partial(encode, tok, max_len=max_len))
    # a response that renders to nothing (blank, or whitespace the template trims) trains the
    # end of the turn alone: legal, but more often a data bug (a lost answer) than a lesson
    empty = sum(1 for ids, n_prompt in train if len(ids) - n_prompt == 1)
    if empty:
        common.print0(
            f"note: {source}: {empty} of {len(train)} responses are empty as the chat template "
            "renders them: each trains the end of the turn alone"
        )
    if len(train) < args.train_batch_size:
        raise SystemExit(
            f"error: {source}: too few examples for --train_batch_size "
            f"{args.train_batch_size} (it has {len(train)})"
        )
    held_out = held_out[: args.eval_samples]
    common.check_held_out(tok, held_out, max_len)
    return train, [row for _, row in held_out]


def micro_batch_loss(model, micro, n_tokens, pad_id, device):
    """sft_loss of one micro-batch [(input_ids, n_prompt)], its forward through `model`.

    The LM head runs only from the shortest prompt's last column on: rows are right-padded, so
    those columns hold every row's predictions of its response tokens (the columns before them
    predict prompt tokens, which no loss reads). At a real vocabulary the logits [B, T, V] are a
    forward's largest tensor (Qwen2's 151,936 entries: 0.6 MB per token in fp32); the logits kept
    are the same numbers (`common.head_only_at_last`; tested)."""
    input_ids, attention_mask, labels = collate(micro, pad_id)
    keep = input_ids.shape[1] - min(n_prompt for _, n_prompt in micro) + 1
    # use_cache=False: a training forward needs no KV cache (and a checkpointed block's
    # recompute would append to it a second time)
    logits = model(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        use_cache=False,
        **common.head_only_at_last(model, keep),
    ).logits  # [B, keep, V], or [B, T, V] for a model without logits_to_keep
    labels = labels[:, -logits.shape[1] :]  # the same columns, counted from the right
    return sft_loss(logits, labels.to(device), n_tokens)


def train_step(args, model, optim, sched, mine, n_tokens, pad_id, device):
    """One optimizer step on `mine`, this rank's share ([(input_ids, n_prompt)]) of the global
    batch, with gradient accumulation over micro-batches. n_tokens: the response tokens of the
    whole global batch, the loss's denominator. Returns the step's metrics."""
    world = dist.get_world_size()
    loss_sum = torch.zeros(1, device=device)
    t0 = time.time()
    for start in range(0, len(mine), args.micro_batch_size):
        micro = mine[start : start + args.micro_batch_size]
        loss = micro_batch_loss(model, micro, n_tokens, pad_id, device)
        # FSDP averages gradients over ranks; the loss is already a global token mean: undo that
        (loss * world).backward()
        loss_sum += loss.detach()
    t1 = time.time()  # (on a GPU: where the host is; queued kernels count in the next phase)
    grad_norm = common.clip_grad_norm(model, args.max_grad_norm, "policy")
    optim.step()
    lr = sched.get_last_lr()[0]  # the rate this step trained at (before the schedule moves on)
    sched.step()
    optim.zero_grad(set_to_none=True)
    dist.all_reduce(loss_sum)  # for logging only: the global mean loss over response tokens
    return {
        "train/loss": loss_sum.item(),
        "train/lr": lr,
        "train/grad_norm": grad_norm.item(),
        # forward and backward of every micro-batch, FSDP2's all-gathers and reduce-scatters in it
        "time/forward_backward_s": t1 - t0,
        "time/optimizer_s": time.time() - t1,  # clipping, AdamW, the logged loss's all-reduce
    }


def main(args):
    rank, world, device = common.init_distributed(args.seed, args.timeout_minutes)
    common.make_local_dir(args)
    common.check_batch_sizes(args, world)
    per_rank = args.train_batch_size // world
    metrics_log = common.MetricsLog(common.local_dir(args), args.tensorboard, args.out_dir)

    model, tok = common.load_model_and_tokenizer(
        args.model, AutoModelForCausalLM, args.attn_implementation
    )
    common.record_template_kwargs(tok, args.model)  # so the export renders as this run did
    # from_pretrained returns eval mode: without this, dropout would be silently off all run
    # (greedy_accuracy gives the model back the mode it found it in)
    model.train()
    # The model folder's generation_config goes to the exports (with the responses' end among its
    # stop ids); while training, greedy evaluation runs with no decoding defaults of the model's
    # own (a repetition penalty, say).
    stop_ids = common.stop_token_ids(tok, model.generation_config)
    export_generation_config = common.stopping_at(model.generation_config, stop_ids)
    model.generation_config = common.neutral_generation_config(stop_ids, tok.pad_token_id)
    train, held_out = load_data(args, tok, common.context_length(args.model, model.config))
    common.print_plan(args, "examples", len(train), len(held_out), args.train_batch_size)
    if args.gradient_checkpointing:
        common.checkpoint_activations(model)
    common.shard_model(model, device, reshard_after_forward=args.reshard_after_forward)
    # fused: AdamW's element-wise math in one kernel for all parameters, on CPU and CUDA, where
    # the default loops over tensors with ~10 ops each on CPU (on CUDA it is foreach: the same
    # ~10 ops, each over lists of tensors) (34M on CPU: AdamW's step 0.14 -> 0.04 s; README:
    # Benchmarks). The Trainer's default too, so TRL's.
    optim = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=args.weight_decay,
        fused=True,
    )
    sched = get_cosine_schedule_with_warmup(optim, args.warmup_steps, args.max_steps)
    roles = {"model": (model, optim)}

    # a resume builds the model from --model's config.json and tokenises with its tokenizer
    # again: they must be those the run began with (`checkpoint.load`)
    folders = {"model": common.folder_identity(args.model)}
    # flags a resume may not change: they decide which examples each step sees
    must_match = ["model", "data", "seed", "train_batch_size"]
    start, final = common.resume(args, roles, sched, must_match, folders=folders)
    # the rows a killed run logged after the checkpoint go (all of them on a fresh start)
    metrics_log.truncate(start if final else None)

    step = start
    pbar = common.progress_bar(args.max_steps, start, "sft")
    for step in range(start + 1, args.max_steps + 1):
        t0 = time.time()
        idx, epoch = common.batch_indices(step - 1, len(train), args.train_batch_size, args.seed)
        # Every rank knows the whole global batch, so counting its tokens needs no collective.
        n_tokens = batch_tokens([train[i] for i in idx])
        my_idx = idx[rank * per_rank : (rank + 1) * per_rank]  # this rank's share of the batch
        mine = [train[i] for i in my_idx]
        metrics = train_step(args, model, optim, sched, mine, n_tokens, tok.pad_token_id, device)
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
