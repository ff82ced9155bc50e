"""Supervised fine-tuning: next-token cross-entropy on the response tokens only.

Stage 1 of RLHF (Ouyang et al. 2022, "Training language models to follow instructions with human
feedback"): teach the task's format before PPO optimises a reward. FSDP2 (`fully_shard` per decoder
layer, then the root) on one code path for gloo/CPU and NCCL/GPU; checkpoints resume bitwise exactly.

    torchrun --nproc_per_node=2 train_sft.py --out_dir runs/sft [--resume latest]   # embedded task
    torchrun --nproc_per_node=8 train_sft.py --model Qwen/Qwen2.5-0.5B --data my.jsonl
"""
import argparse, ast, dataclasses, datetime, gc, importlib.util, inspect, json, os, random, signal, sys, time, traceback, typing

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

import checkpoint
import rollout
import task


@dataclasses.dataclass
class Args:
    model: str = task.TINY_MODEL
    """HF model folder or hub id (default: the embedded tiny Llama, built on first use)"""
    data: str = ""
    """training JSONL, one {"prompt": ..., "response": ...} per line (default: the embedded addition task)"""
    eval_data: str = ""
    """held-out JSONL in the same format (default: the embedded task's held-out split; none with --data)"""
    out_dir: str = "runs/sft"
    """checkpoints/, metrics.jsonl and the final hf/ export go here"""
    max_steps: int = 600
    """optimizer steps in the whole run (the LR schedule spans them)"""
    save_every: int = 200
    """save a full checkpoint every this many steps (and at the end)"""
    keep_last: int = 2
    """keep this many checkpoints; older ones are pruned after a new one is committed"""
    resume: str = ""
    """'latest' (newest checkpoint in out_dir that verifies) or a checkpoint path; empty: start fresh"""
    seed: int = 42
    """seeds the data order and every RNG"""
    train_batch_size: int = 64
    """examples per optimizer step, over all ranks"""
    micro_batch_size: int = 32
    """examples per forward/backward on one rank; grad accumulation makes up the rest"""
    lr: float = 3e-3
    """peak learning rate (AdamW), after linear warmup, then cosine decay to 0"""
    warmup_steps: int = 30
    """linear LR warmup steps"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    eval_every: int = 100
    """greedy-decode the held-out set every this many steps (0: only at the end)"""
    eval_samples: int = 256
    """held-out examples per evaluation"""
    save_every_minutes: float = 0.0
    """also save when this many minutes of wall time have passed since the last save (0: off)"""
    async_save: bool = False
    """write checkpoints in a background thread while training goes on (published once complete)"""
    on_save_error: typing.Literal["stop", "warn"] = "stop"
    """a failed save (disk full, I/O error) stops the run, or warns and trains on; the last good one stays latest"""
    timeout_minutes: float = 30.0
    """a collective waiting longer than this (a peer dead or stuck) fails with an error, not a hang"""
    tensorboard: bool = False
    """also write TensorBoard event files to <out_dir>/tensorboard/ (needs `pip install tensorboard`)"""
    stop_at_step: int = 0
    """save and exit after this step, as a preempted run would (for testing resume); 0: never"""


# ==== shared boilerplate: copied verbatim in train_sft.py and train_ppo.py (tests/test_style.py) ====
def parse_args(cls):
    """argparse from a dataclass; each field's docstring is its --help."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {a.target.id: b.value.value for a, b in zip(body, body[1:]) if isinstance(a, ast.AnnAssign)
            and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}
    p = argparse.ArgumentParser(description=sys.modules[cls.__module__].__doc__.split("\n")[0])
    for f in dataclasses.fields(cls):
        kind = (lambda s: bool(("false", "true").index(s.lower()))) if f.type is bool else f.type  # strict
        p.add_argument(f"--{f.name}", type=str if typing.get_args(f.type) else kind, choices=typing.get_args(f.type)
                       or None, default=f.default, help=f"{docs[f.name]} (default: {f.default!r})")
    args = cls(**vars(p.parse_args()))
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise SystemExit("error: --tensorboard needs the tensorboard package: pip install tensorboard")
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and not args.resume:
        args.resume = "latest"  # torchrun --max-restarts restarted the group: carry on where it stopped
    return args


def init_distributed(seed, timeout_minutes=30.0):
    """One process group for all: NCCL on GPUs, gloo on CPUs; plain `python` gets a 1-rank group.
    Seeds every RNG per rank (dropout masks must differ across ranks); a resume restores them.
    Collectives fail after timeout_minutes (a peer dead or stuck), where they would hang forever."""
    store, rank, world = next(dist.rendezvous("env://")) if "RANK" in os.environ else (dist.HashStore(), 0, 1)
    # torchrun restarts reuse its store; unprefixed, a new group read dead peers' addresses here (gloo)
    kw = dict(store=dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/", store), rank=rank,
              world_size=world, timeout=datetime.timedelta(minutes=timeout_minutes))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **kw)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **kw)
    rank = dist.get_rank()
    random.seed(seed + rank), np.random.seed(seed + rank), torch.manual_seed(seed + rank)
    watch_signals()
    return rank, dist.get_world_size(), device


SIGNALS = []  # SIGTERM/SIGUSR1 received: the step ends with a checkpoint, then the run exits 0


def watch_signals():
    """Schedulers send SIGTERM before a kill (SLURM: --signal=USR1@secs earlier): note it, finish the step."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda num, frame: SIGNALS.append(num))


def print0(*a):
    if dist.get_rank() == 0:
        tqdm.write(" ".join(str(x) for x in a))


TENSORBOARD = []  # the SummaryWriter, made by the first log() of a --tensorboard run


def log(metrics, step, out_dir, tensorboard=False):
    """Append {"step": ..., "<group>/<name>": ...} to <out_dir>/metrics.jsonl (rank 0); with tensorboard,
    the numbers go to TensorBoard event files in <out_dir>/tensorboard/ as well."""
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (checked at start)
            # purge_step: TensorBoard hides what a killed predecessor logged from this step on (we redo it)
            TENSORBOARD[:] = TENSORBOARD or [SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=step)]
            for k, v in metrics.items():
                if isinstance(v, (int, float)):  # not e.g. rollout/responses_sha
                    TENSORBOARD[0].add_scalar(k, v, step)
            TENSORBOARD[0].flush()


def truncate_log(out_dir, step):
    """A resumed run redoes the steps its predecessor logged after the checkpoint: drop those lines."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if dist.get_rank() == 0 and os.path.exists(path):
        rows = [r for r in open(path) if r.endswith("}\n") and json.loads(r)["step"] <= step]  # (a kill cuts lines)
        with open(path, "w") as f:
            f.writelines(rows)


def shard_model(model, device):
    """FSDP2: fully_shard every transformer block (HF names them in _no_split_modules), then the root.
    bf16 compute with fp32 gradient reduction and fp32 master weights on GPU; plain fp32 on CPU."""
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if device.type == "cuda" else MixedPrecisionPolicy()
    for block in [m for m in model.modules() if type(m).__name__ in (model._no_split_modules or [])]:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def load_model_and_tokenizer(path, cls, **kw):
    if path == task.TINY_MODEL:
        task.ensure_tiny_model(path)  # every rank: atomic and deterministic, so no barrier needed
    try:
        tok = AutoTokenizer.from_pretrained(path)
        model = cls.from_pretrained(path, dtype=torch.float32, **kw)  # fp32 master weights, always
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: --model {path}: cannot load ({str(e).splitlines()[0]})")
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        raise SystemExit(f"error: --model {path}: tokenizer needs a PAD token distinct from EOS")
    return model, tok


def run(main, cls):
    """main(parse_args(cls)); a bad checkpoint or a failed collective ends in one line naming them."""
    try:
        main(parse_args(cls))
        # FSDP modules sit in reference cycles: free them (and the gloo work objects they hold) now, not
        # while the interpreter shuts down: that aborted a rank twice in ~150 runs here (cf. pytorch#179291)
        gc.collect()
    except checkpoint.CheckpointError as e:
        raise SystemExit(f"error: {e}")
    except (RuntimeError, dist.DistError) as e:  # gloo/NCCL failures name neither the op nor the rank
        frames, here = traceback.extract_tb(e.__traceback__), os.path.dirname(os.path.abspath(__file__))
        i = [i for i, f in enumerate(frames) if f.filename.startswith(here) and "-packages" not in f.filename][-1]
        op = [f for f in frames[i + 1:] if f"torch{os.sep}distributed" in f.filename and f.name != "wrapper"]
        if not op or not isinstance(e, dist.DistError) and not any(s in str(e) for s in ("gloo", "NCCL", "Timed out")):
            raise
        c10d = [f.name for f in op if f.filename.endswith("distributed_c10d.py")] or [op[-1].name]  # the collective
        raise SystemExit(f"error: rank {os.environ.get('RANK', 0)}: collective {c10d[-1]} (in {op[0].name}, called at "
                         f"{os.path.basename(frames[i].filename)}:{frames[i].lineno}) failed: {str(e).splitlines()[0]} (peer dead or hung?)")
# ==== end shared boilerplate ====


def encode(tok, ex, max_len, where):
    """(input_ids, n_prompt): the prompt, then the response and EOS, which the loss is taken on."""
    prompt = task.encode_prompt(tok, ex["prompt"])
    response = tok(ex["response"], add_special_tokens=False).input_ids + [tok.eos_token_id]
    if len(prompt) + len(response) > max_len:
        raise SystemExit(f"error: {where}: prompt+response is {len(prompt) + len(response)} tokens, longer "
                         f"than the model's context (max_position_embeddings {max_len})")
    return prompt + response, len(prompt)


def collate(examples, pad_id):
    """Right-padded input_ids, attention_mask, and labels = -100 except on response tokens. [B, T]"""
    T = max(len(x) for x, _ in examples)
    ids = torch.tensor([x + [pad_id] * (T - len(x)) for x, _ in examples])
    mask = torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x, _ in examples])
    labels = torch.tensor([[-100] * n + x[n:] + [-100] * (T - len(x)) for x, n in examples])
    return ids, mask, labels


def sft_loss(logits, labels, n_tokens):
    """Summed next-token cross-entropy over response tokens / n_tokens. logits [B,T,V], labels [B,T]."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="sum",
                           ignore_index=-100) / n_tokens


def main(args):
    rank, world, device = init_distributed(args.seed, args.timeout_minutes)
    os.makedirs(args.out_dir, exist_ok=True)
    per_rank, rem = divmod(args.train_batch_size, world)
    if rem or per_rank % args.micro_batch_size:
        raise SystemExit(f"error: --train_batch_size {args.train_batch_size} must be divisible by "
                         f"--micro_batch_size {args.micro_batch_size} x world size {world}")

    model, tok = load_model_and_tokenizer(args.model, AutoModelForCausalLM)
    model.train()  # from_pretrained returns eval mode: dropout would be silently off until the first eval
    train = task.load_jsonl(args.data, ("prompt", "response")) if args.data else task.make_split("train")
    held_out = (task.load_jsonl(args.eval_data, ("prompt", "response")) if args.eval_data
                else [] if args.data else task.make_split("test"))[:args.eval_samples]
    src, max_len = args.data or "embedded task", model.config.max_position_embeddings
    train = [encode(tok, ex, max_len, f"{src}:{i + 1}") for i, ex in enumerate(train)]
    if len(train) < args.train_batch_size:
        raise SystemExit(f"error: {src}: {len(train)} examples, fewer than --train_batch_size {args.train_batch_size}")
    shard_model(model, device)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(optim, args.warmup_steps, args.max_steps)

    start, path = 0, checkpoint.resolve(args.out_dir, args.resume)
    if path:  # RNG restored last: nothing may draw from it between here and step 1
        meta = checkpoint.load(path, {"model": (model, optim)}, vars(args),
                               must_match=["model", "data", "seed", "train_batch_size", "micro_batch_size"])
        sched.load_state_dict(meta["scheduler"])
        truncate_log(args.out_dir, start := meta["step"])
        print0(f"resumed from {path} at step {start}")

    step, pbar = start, tqdm(total=args.max_steps, initial=start, disable=rank != 0, desc="sft")
    for step in range(start + 1, args.max_steps + 1):
        t0 = time.time()
        idx, epoch = task.batch_indices(step - 1, len(train), args.train_batch_size, args.seed)
        n_tokens = sum(len(train[i][0]) - train[i][1] for i in idx)  # response tokens, all ranks: no collective
        mine = idx[rank * per_rank:(rank + 1) * per_rank]
        loss_sum = torch.zeros(1, device=device)
        for m in range(per_rank // args.micro_batch_size):  # gradient accumulation
            ids, mask, labels = (t.to(device) for t in collate(
                [train[i] for i in mine[m * args.micro_batch_size:(m + 1) * args.micro_batch_size]], tok.pad_token_id))
            loss = sft_loss(model(input_ids=ids, attention_mask=mask).logits, labels, n_tokens)
            (loss * world).backward()  # FSDP averages over ranks; the loss is already a global token mean
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).full_tensor()  # DTensor
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)  # for logging only: the global mean loss over response tokens
        metrics = {"train/loss": loss_sum.item(), "train/lr": sched.get_last_lr()[0], "train/epoch": epoch,
                   "train/grad_norm": grad_norm.item(), "time/step_s": time.time() - t0}
        if held_out and (step == args.max_steps or (args.eval_every and step % args.eval_every == 0)):
            metrics["eval/accuracy"] = rollout.greedy_accuracy(model, tok, held_out, device)
            print0(f"step {step}: held-out accuracy {metrics['eval/accuracy']:.3f}")
        log(metrics, step, args.out_dir, args.tensorboard)
        pbar.update(1)
        pbar.set_postfix(loss=f"{metrics['train/loss']:.4f}")
        save, stop = checkpoint.boundary(step, args.save_every, args.save_every_minutes, bool(SIGNALS), device)
        if (last := stop or step in (args.max_steps, args.stop_at_step)) or save:  # last: blocking, we exit next
            meta = {"scheduler": sched.state_dict(), "epoch": epoch, "consumed_samples": step * args.train_batch_size}
            path = checkpoint.save(args.out_dir, step, {"model": (model, optim)}, {**meta, "args": vars(args)},
                                   (model.config, tok, model.generation_config), args.keep_last,
                                   args.async_save and not last, args.on_save_error)
        if stop or step == args.stop_at_step:
            print0(f"stopping after step {step} ({'signal' if stop else '--stop_at_step'}); go on with --resume latest")
            break
    pbar.close()

    if step == args.max_steps and path and rank == 0:  # the final checkpoint, as an HF folder for PPO and vLLM
        rollout.export(path, os.path.join(args.out_dir, "hf"))
    dist.barrier()  # nobody tears the group down while rank 0 is still writing
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main, Args)
