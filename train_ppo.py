"""PPO for language models: actor, critic, frozen reference, reward; GAE, clipped losses, per-token KL.

Stage 3 of RLHF (Ziegler et al. 2019; Ouyang et al. 2022) with the details of Huang et al. 2023, "The
N Implementation Details of RLHF with PPO" ([N section #item] at each use). PPO: Schulman et al. 2017,
eq. 7; GAE: Schulman et al. 2016, eq. 16. `--advantage_estimator grpo|rloo` drops the critic for group
baselines over each prompt's samples (Shao et al. 2024, DeepSeekMath; Ahmadian et al. 2024, RLOO).

    torchrun --nproc_per_node=2 train_ppo.py --model runs/sft/hf --out_dir runs/ppo [--resume latest]
"""
import argparse, ast, dataclasses, datetime, gc, importlib.util, inspect, json, os, random, signal, sys, time, traceback, typing

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from tqdm import tqdm
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification,
                          AutoTokenizer, get_linear_schedule_with_warmup)

import checkpoint
import rollout
import task


@dataclasses.dataclass
class Args:
    model: str = "runs/sft/hf"
    """the SFT export (HF folder or hub id): initialises actor, critic backbone and frozen reference"""
    data: str = ""
    """prompts JSONL, one {"prompt": ...} per line (default: the embedded addition task's train split)"""
    eval_data: str = ""
    """held-out prompts JSONL (default: the embedded task's held-out split; none with --data)"""
    out_dir: str = "runs/ppo"
    """checkpoints/, metrics.jsonl and the final hf/ export of the actor go here"""
    max_steps: int = 150
    """PPO iterations (rollout + scoring + ppo_epochs of updates + weight sync)"""
    save_every: int = 50
    """save a full checkpoint every this many iterations (and at the end)"""
    keep_last: int = 2
    """keep this many checkpoints; older ones are pruned after a new one is committed"""
    resume: str = ""
    """'latest' (newest checkpoint in out_dir that verifies) or a checkpoint path; empty: start fresh"""
    seed: int = 42
    """seeds prompt order, sampling and every RNG"""
    rollout_batch_size: int = 64
    """prompts per iteration, over all ranks"""
    n_samples_per_prompt: int = 4
    """responses sampled per prompt (the group for grpo/rloo)"""
    train_batch_size: int = 64
    """responses per optimizer step, over all ranks (rollout_batch_size * n / this = updates per epoch)"""
    micro_batch_size: int = 32
    """responses per forward/backward on one rank; grad accumulation makes up the rest"""
    ppo_epochs: int = 2
    """passes over each iteration's rollouts, reshuffled every pass [N policy #7]"""
    lr: float = 1e-4
    """actor learning rate (AdamW, eps 1e-5 [N general #5], linear decay to 0)"""
    critic_lr: float = 1e-3
    """critic learning rate"""
    max_grad_norm: float = 1.0
    """clip each model's global gradient norm to this"""
    advantage_estimator: str = "gae"
    """gae (critic + GAE), grpo (group mean/std baseline, no critic) or rloo (leave-one-out, no critic)"""
    gamma: float = 1.0
    """GAE discount [N policy #6]"""
    lam: float = 0.95
    """GAE lambda [N policy #6]"""
    cliprange: float = 0.2
    """PPO ratio clip epsilon"""
    cliprange_value: float = 0.2
    """value clip around the old values; 0: no value clipping [N policy #10]"""
    kl_coef: float = 0.05
    """beta of the per-token KL penalty (initial value when adaptive)"""
    target_kl: float = 0.0
    """> 0: adaptive KL controller aiming at this KL per response, horizon 10k responses; 0: fixed beta"""
    missing_eos_penalty: float = 1.0
    """subtracted from the score of a response cut at max_new_tokens without EOS [N policy #5]"""
    whiten_rewards: bool = False
    """whiten the per-token rewards (scale only) before GAE [N policy #9]"""
    reward_fn: str = "task:reward_fn"
    """module:function(prompt, response) -> float, the rule reward (used unless --reward_model)"""
    reward_model: str = ""
    """HF AutoModelForSequenceClassification folder; its score at the last real token is the reward"""
    max_new_tokens: int = 8
    """response length limit"""
    temperature: float = 1.0
    """sampling temperature, applied to the logits of every logprob too [N policy #1]"""
    rollout_engine: str = "auto"
    """vllm, hf, or auto (vllm when installed)"""
    gpu_memory_utilization: float = 0.3
    """GPU only: share of GPU memory vLLM may take (the trainer needs the rest)"""
    enforce_eager: bool = False
    """GPU only: no CUDA graphs in vLLM (slower decoding, faster start, less memory)"""
    eval_every: int = 25
    """greedy-decode the held-out prompts (and log sample rows) every this many iterations, and at the ends"""
    eval_samples: int = 256
    """held-out prompts per evaluation"""
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
    """save and exit after this iteration, as a preempted run would (for testing resume); 0: never"""


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


# ---- the math, as in the papers ----------------------------------------------------------------------
def masked_mean(x, mask, n=None):
    """Mean of x over mask == 1; n: the count to divide by, when it spans more than this tensor."""
    return (x * mask).sum() / (mask.sum() if n is None else n)


def masked_whiten(x, mask, shift_mean=True):
    """(x - mean) / std over the masked entries of all ranks [N policy #9]. Collective: all_reduce of
    (sum, sum of squares, count), so every rank whitens with the same global statistics."""
    stats = torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()]).double()
    dist.all_reduce(stats)
    mean, var = stats[0] / stats[2], stats[1] / stats[2] - (stats[0] / stats[2]) ** 2
    white = ((x - mean) * torch.rsqrt(var + 1e-8)).to(x.dtype)
    return (white if shift_mean else white + mean.to(x.dtype)) * mask


def compute_rewards(scores, logprobs, ref_logprobs, mask, kl_coef):
    """Per-token reward r_t = -beta * (log pi(y_t) - log pi_ref(y_t)), plus the score at the last
    response token (Ziegler et al. 2019 eq. 2; [N policy #8]). scores [B]; the rest [B, R]."""
    kl = (logprobs - ref_logprobs) * mask                 # k1 estimator of the per-token KL  [B, R]
    rewards = -kl_coef * kl
    last = mask.sum(1).long() - 1                         # index of each response's last token  [B]
    rewards[torch.arange(len(scores)), last] += scores
    return rewards, kl


def compute_gae(rewards, values, mask, gamma, lam):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16) over response tokens:
    delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1}, with V and A zero past
    the last token. returns = A + V, the value targets. All [B, R]."""
    advantages, next_adv, R = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0]), rewards.shape[1]
    for t in reversed(range(R)):
        alive = mask[:, t + 1] if t + 1 < R else torch.zeros_like(next_adv)  # 0 past the last token
        next_v = values[:, t + 1] * alive if t + 1 < R else alive
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        next_adv = delta + gamma * lam * alive * next_adv
        advantages[:, t] = next_adv
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def group_advantages(scores, kind):
    """Critic-free baselines over each prompt's n samples, scores [G, n] -> advantages [G, n].
    grpo: (s - mean) / std of the group (Shao et al. 2024, eq. 3, outcome supervision);
    rloo: s - mean of the other n-1 samples (Ahmadian et al. 2024, eq. 6)."""
    n = scores.shape[1]
    if kind == "grpo":
        return (scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-4)
    return scores - (scores.sum(1, keepdim=True) - scores) / (n - 1)


def policy_loss(logprobs, old_logprobs, advantages, mask, cliprange, n_tokens):
    """Clipped surrogate (Schulman et al. 2017, eq. 7), as a loss: mean over tokens of
    max(-A ratio, -A clip(ratio, 1-eps, 1+eps)). All [B, R]; n_tokens: the global token count."""
    ratio = torch.exp(logprobs - old_logprobs)
    pg_losses, pg_losses2 = -advantages * ratio, -advantages * ratio.clamp(1 - cliprange, 1 + cliprange)
    pg_loss = masked_mean(torch.max(pg_losses, pg_losses2), mask, n_tokens)
    clipfrac = masked_mean((pg_losses2 > pg_losses).float(), mask, n_tokens)
    approxkl = 0.5 * masked_mean((logprobs - old_logprobs) ** 2, mask, n_tokens)
    return pg_loss, clipfrac, approxkl, ratio


def kl_loss(logprobs, ref_logprobs, mask, n_tokens):
    """GRPO's KL term (Shao et al. 2024, eq. 4), the unbiased, non-negative k3 estimator:
    pi_ref/pi - log(pi_ref/pi) - 1 per token. [B, R]."""
    log_ratio = ref_logprobs - logprobs
    return masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask, n_tokens)


def value_loss(values, old_values, returns, mask, cliprange_value, n_tokens):
    """0.5 (V - returns)^2, optionally clipped around the old values like the policy ([N policy #10];
    Schulman et al.'s baselines code). All [B, R]."""
    vf_losses = (values - returns) ** 2
    if cliprange_value <= 0:
        return 0.5 * masked_mean(vf_losses, mask, n_tokens), torch.zeros(())
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    vf_losses2 = (clipped - returns) ** 2
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses).float(), mask, n_tokens)
    return 0.5 * masked_mean(torch.max(vf_losses, vf_losses2), mask, n_tokens), vf_clipfrac


def eos_penalized(scores, finished, penalty):
    """A response cut at max_new_tokens without EOS loses `penalty` [N policy #5]. scores [B]."""
    return scores - penalty * (1 - torch.tensor(finished, dtype=scores.dtype))


def update_kl_coef(kl_coef, kl, target, n_responses, horizon=10000):
    """Adaptive KL controller (Ziegler et al. 2019, sec. 2.2): proportional error clipped to +-0.2."""
    error = min(max(kl / target - 1, -0.2), 0.2)
    return kl_coef * (1 + error * n_responses / horizon)


# ---- plumbing for one iteration ------------------------------------------------------------------
def values_of(critic, ids, attn, pos, P):
    """V(s_t) for every response token: the critic's output at the position before it. [B, R]"""
    return critic(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, P - 1:-1, 0].float()


@torch.no_grad()
def evaluate(engine, tok, items, scorer, max_new_tokens, device):
    """Mean score of greedy responses to held-out prompts (= accuracy for a 0/1 reward). Collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = items[rank::world][:len(items) // world]  # equal shares: scoring may be collective
    gen = engine.generate([ids for ids, _ in mine], 1, max_new_tokens, 0.0, 1.0, [0] * len(mine))
    total = torch.stack([scorer([ids for ids, _ in mine], [p for _, p in mine], gen.response_ids).sum(),
                         torch.tensor(float(len(mine)))]).to(device)
    dist.all_reduce(total)  # every rank's sum and count
    return (total[0] / total[1]).item()


def main(args):
    rank, world, device = init_distributed(args.seed, args.timeout_minutes)
    os.makedirs(args.out_dir, exist_ok=True)
    n, per_rank, mb_rank = args.n_samples_per_prompt, args.rollout_batch_size // world, args.train_batch_size // world
    if (args.rollout_batch_size % world or args.train_batch_size % (world * args.micro_batch_size)
            or (args.rollout_batch_size * n) % args.train_batch_size):
        raise SystemExit(f"error: batch sizes do not divide: --rollout_batch_size {args.rollout_batch_size} by world size "
                         f"{world}, it x --n_samples_per_prompt {n} by --train_batch_size {args.train_batch_size}, that by "
                         f"--micro_batch_size {args.micro_batch_size} x world size")
    if args.advantage_estimator not in ("gae", "grpo", "rloo") or (args.advantage_estimator != "gae" and n < 2):
        raise SystemExit(f"error: --advantage_estimator {args.advantage_estimator}: expected gae, or grpo/rloo with --n_samples_per_prompt >= 2")
    use_critic = args.advantage_estimator == "gae"

    # Roles. Every model stays in eval mode: dropout off, so the first ratio is exactly 1 and the KL
    # is reproducible [N policy #4]; gradients flow all the same.
    actor, tok = load_model_and_tokenizer(args.model, AutoModelForCausalLM)
    ref = load_model_and_tokenizer(args.model, AutoModelForCausalLM)[0].requires_grad_(False)
    models = [actor, ref]
    if use_critic:  # critic: the SFT backbone and a value head; zero head = zero initial values [N policy #2]
        critic = load_model_and_tokenizer(args.model, AutoModelForTokenClassification, num_labels=1)[0]
        torch.nn.init.zeros_(critic.score.weight), torch.nn.init.zeros_(critic.score.bias)
        models.append(critic)
    if args.reward_model:
        rm = load_model_and_tokenizer(args.reward_model, AutoModelForSequenceClassification, num_labels=1)[0]
        models.append(rm.requires_grad_(False))
    for m in models:
        shard_model(m.eval(), device)
    roles = {"actor": (actor, torch.optim.AdamW(actor.parameters(), lr=args.lr, eps=1e-5))}
    if use_critic:
        roles["critic"] = (critic, torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, eps=1e-5))
    scheds = {k: get_linear_schedule_with_warmup(o, 0, args.max_steps) for k, (_, o) in roles.items()}

    def scorer(p_ids, p_texts, responses):  # raw scores [N]; collective with a reward model
        if not args.reward_model:
            return task.rule_scores(args.reward_fn, p_texts, tok.batch_decode(responses, skip_special_tokens=True))
        ids, attn, pos, _, _ = rollout.make_batch(p_ids, responses, tok.pad_token_id, device)
        with torch.no_grad():  # HF reads the score at the last non-pad token: EOS or the last one [N RM #1]
            return torch.cat([rm(input_ids=ids[c], attention_mask=attn[c], position_ids=pos[c]).logits[:, 0].float().cpu()
                              for c in torch.arange(len(ids)).split(args.micro_batch_size)])

    ctx = actor.config.max_position_embeddings
    def prompt_items(rows, src):  # [(token ids, text)]
        items = [(task.encode_prompt(tok, r["prompt"]), r["prompt"]) for r in rows]
        for i, (ids, _) in enumerate(items):
            if len(ids) + args.max_new_tokens > ctx:
                raise SystemExit(f"error: {src}:{i + 1}: prompt of {len(ids)} tokens + --max_new_tokens "
                                 f"{args.max_new_tokens} exceeds the model's context ({ctx})")
        return items
    train = prompt_items(task.load_jsonl(args.data, ("prompt",)) if args.data else task.make_split("train"),
                         args.data or "embedded task")
    held_out = prompt_items((task.load_jsonl(args.eval_data, ("prompt",)) if args.eval_data else [] if args.data
                             else task.make_split("test"))[:args.eval_samples], args.eval_data or "embedded task")
    if len(train) < args.rollout_batch_size:
        raise SystemExit(f"error: {args.data or 'embedded task'}: {len(train)} prompts, fewer than --rollout_batch_size")

    # The engine before the checkpoint: vLLM seeds the global RNGs while it starts.
    longest = max(len(ids) for ids, _ in train + held_out) + args.max_new_tokens  # sizes vLLM's KV cache
    engine = rollout.build_engine(args.rollout_engine, args.model, longest, args.seed, tok.eos_token_id,
                                  args.gpu_memory_utilization, args.enforce_eager)
    start, kl_coef, path = 0, args.kl_coef, checkpoint.resolve(args.out_dir, args.resume)
    if path:  # RNG restored last, inside load
        meta = checkpoint.load(path, roles, vars(args), must_match=["model", "data", "seed", "rollout_batch_size",
                               "n_samples_per_prompt", "train_batch_size", "micro_batch_size", "advantage_estimator",
                               "reward_fn", "reward_model"])
        for k, s in scheds.items():
            s.load_state_dict(meta["scheduler"][k])
        start, kl_coef = meta["step"], meta["kl_coef"]
        truncate_log(args.out_dir, start)
        rollout.sync_weights(engine, actor)  # the engine started from --model: give it the resumed actor
        print0(f"resumed from {path} at step {start}")
    elif held_out:
        acc = evaluate(engine, tok, held_out, scorer, args.max_new_tokens, device)
        print0(f"step 0: held-out accuracy {acc:.3f}")
        log({"eval/accuracy": acc}, 0, args.out_dir, args.tensorboard)

    step, pbar = start, tqdm(total=args.max_steps, initial=start, disable=rank != 0, desc="ppo")
    for step in range(start + 1, args.max_steps + 1):
        # (1) Rollout: this rank's share of the step's prompts, n samples each, seeded per prompt.
        t0 = time.time()
        idx, epoch = task.batch_indices(step - 1, len(train), args.rollout_batch_size, args.seed)
        mine = range(rank * per_rank, (rank + 1) * per_rank)  # positions in the global batch
        gen = engine.generate([train[idx[j]][0] for j in mine], n, args.max_new_tokens, args.temperature, 1.0,
                              [rollout.prompt_seed(args.seed, step, j) for j in mine])
        engine.sleep()
        p_ids = [train[idx[j]][0] for j in mine for _ in range(n)]
        # (2) Score; a response cut without EOS is penalised [N policy #5].
        t1 = time.time()
        raw = scorer(p_ids, [train[idx[j]][1] for j in mine for _ in range(n)], gen.response_ids)
        scores = eos_penalized(raw, gen.finished, args.missing_eos_penalty)
        # (3) Old logprobs, reference logprobs and values, with the training models, in a random
        # order that the first PPO epoch keeps: its first micro-batch then sees ratio == 1 exactly.
        order = torch.randperm(len(p_ids))
        ids, attn, pos, mask, P = rollout.make_batch([p_ids[i] for i in order], [gen.response_ids[i] for i in order],
                                             tok.pad_token_id, device)
        chunks = [slice(i, i + args.micro_batch_size) for i in range(0, len(order), args.micro_batch_size)]

        def fwd(model, c):  # [mb, R]: logprobs, temperature applied [N policy #1]
            return rollout.logprobs_of(model, ids[c], attn[c], args.temperature, pos[c])[:, P - 1:]
        with torch.no_grad():
            old_logprobs = torch.cat([fwd(actor, c) for c in chunks]) * mask
            ref_logprobs = torch.cat([fwd(ref, c) for c in chunks]) * mask
            old_values = torch.cat([values_of(critic, ids[c], attn[c], pos[c], P) for c in chunks]) * mask if use_critic else None
        # (4) Rewards: per-token KL penalty, the score at the last token; advantages by GAE or groups.
        scores = scores[order].to(device)
        if use_critic:
            rewards, kl = compute_rewards(scores, old_logprobs, ref_logprobs, mask, kl_coef)
            rewards = masked_whiten(rewards, mask, shift_mean=False) if args.whiten_rewards else rewards
            advantages, returns = compute_gae(rewards, old_values, mask, args.gamma, args.lam)
            advantages = masked_whiten(advantages, mask)  # [N policy #9]
        else:  # groups need the rollout's order back. rloo folds the KL into the sequence reward
            kl = (old_logprobs - ref_logprobs) * mask  # (Ahmadian et al.); grpo keeps it a loss term, as
            seq = torch.empty_like(scores)            # dividing by a group's std would blow up KL noise
            seq[order.to(device)] = scores - (kl_coef * kl.sum(1) if args.advantage_estimator == "rloo" else 0)
            advantages = group_advantages(seq.view(-1, n), args.advantage_estimator).flatten()[order.to(device)]
            advantages = advantages[:, None] * mask
        # (5) PPO epochs over shuffled minibatches, with gradient accumulation over micro-batches.
        t2 = time.time()
        stats, updates, ratio0 = torch.zeros(5, device=device), 0, None  # sums of pg_loss ... vf_clipfrac
        for ppo_epoch in range(args.ppo_epochs):
            perm = torch.arange(len(order)) if ppo_epoch == 0 else torch.randperm(len(order))
            for b in range(0, len(order), mb_rank):
                rows = perm[b:b + mb_rank].to(device)
                n_tok = mask[rows].sum()
                dist.all_reduce(n_tok)  # token-mean over the global minibatch, as in SFT
                for c in range(0, len(rows), args.micro_batch_size):
                    r = rows[c:c + args.micro_batch_size]
                    logprobs = rollout.logprobs_of(actor, ids[r], attn[r], args.temperature, pos[r])[:, P - 1:]
                    pg_loss, clipfrac, approxkl, ratio = policy_loss(logprobs, old_logprobs[r], advantages[r], mask[r],
                                                                     args.cliprange, n_tok)
                    if args.advantage_estimator == "grpo":
                        pg_loss = pg_loss + kl_coef * kl_loss(logprobs, ref_logprobs[r], mask[r], n_tok)
                    (pg_loss * world).backward()  # FSDP averages over ranks; n_tok already counts all ranks
                    ratio0 = ((ratio - 1).abs() * mask[r]).max().item() if ratio0 is None else ratio0
                    vf = (torch.zeros(()), torch.zeros(()))
                    if use_critic:
                        vf = value_loss(values_of(critic, ids[r], attn[r], pos[r], P), old_values[r], returns[r], mask[r],
                                        args.cliprange_value, n_tok)
                        (vf[0] * world).backward()
                    stats += torch.stack([pg_loss.detach(), clipfrac, approxkl.detach(), *(x.detach().to(device) for x in vf)])
                for model, optim in roles.values():
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optim.step()
                    optim.zero_grad(set_to_none=True)
                updates += 1
        for s in scheds.values():
            s.step()
        # (6) Push the new actor weights into the engine.
        t3 = time.time()
        rollout.sync_weights(engine, actor)
        t4 = time.time()

        # Logging: one all_reduce of every per-rank sum. The losses were normalised by global token
        # counts, so their sums over ranks are the minibatch values; divide by the update count.
        sums = torch.cat([stats / updates, torch.tensor([raw.sum().item(), float(sum(gen.finished)), len(raw),
                          kl.sum().item(), (-old_logprobs * mask).sum().item(), mask.sum().item()], device=device)])
        dist.all_reduce(sums)
        (pg, cf, akl, vl, vcf, score, fin, n_resp, kl_sum, nll, n_tokens) = sums.tolist()
        metrics = {"objective/score": score / n_resp, "objective/kl": kl_sum / n_resp, "objective/entropy": nll / n_tokens,
                   "objective/kl_coef": kl_coef, "objective/no_eos_frac": 1 - fin / n_resp,
                   "objective/response_len": n_tokens / n_resp, "policy/pg_loss": pg, "policy/clipfrac": cf,
                   "policy/approxkl": akl, "policy/first_ratio_dev": ratio0, "val/loss": vl, "val/clipfrac": vcf,
                   "time/rollout_s": t1 - t0, "time/score_s": t2 - t1, "time/train_s": t3 - t2, "time/sync_s": t4 - t3,
                   "train/epoch": epoch, "train/lr": scheds["actor"].get_last_lr()[0]}
        if args.target_kl > 0:
            kl_coef = update_kl_coef(kl_coef, metrics["objective/kl"], args.target_kl, n_resp)
        metrics["rollout/responses_sha"] = rollout.hash_responses(gen.response_ids)  # rank 0's, to check resumes
        if held_out and (step == args.max_steps or (args.eval_every and step % args.eval_every == 0)):
            metrics["eval/accuracy"] = evaluate(engine, tok, held_out, scorer, args.max_new_tokens, device)
            print0(f"step {step}: held-out accuracy {metrics['eval/accuracy']:.3f}")
        log(metrics, step, args.out_dir, args.tensorboard)
        if rank == 0 and "eval/accuracy" in metrics:  # a few rows to read, in samples.jsonl
            with open(os.path.join(args.out_dir, "samples.jsonl"), "a") as f:
                f.writelines(json.dumps({"step": step, "prompt": train[idx[i // n]][1], "score": raw[i].item(), "response":
                             tok.decode(gen.response_ids[i], skip_special_tokens=True)}) + "\n" for i in range(min(4, len(raw))))
        pbar.update(1)
        pbar.set_postfix(score=f"{metrics['objective/score']:.3f}", kl=f"{metrics['objective/kl']:.3f}")
        save, stop = checkpoint.boundary(step, args.save_every, args.save_every_minutes, bool(SIGNALS), device)
        if (last := stop or step in (args.max_steps, args.stop_at_step)) or save:  # last: blocking, we exit next
            meta = {"scheduler": {k: s.state_dict() for k, s in scheds.items()}, "kl_coef": kl_coef, "epoch": epoch,
                    "consumed_prompts": step * args.rollout_batch_size, "args": vars(args)}
            path = checkpoint.save(args.out_dir, step, roles, meta, (actor.config, tok, actor.generation_config),
                                   args.keep_last, args.async_save and not last, args.on_save_error)
        if stop or step == args.stop_at_step:
            print0(f"stopping after step {step} ({'signal' if stop else '--stop_at_step'}); go on with --resume latest")
            break
    pbar.close()

    if step == args.max_steps and path and rank == 0:  # the final actor as an HF folder
        rollout.export(path, os.path.join(args.out_dir, "hf"), "actor")
    dist.barrier()  # every rank is done before the engine shuts down (vLLM's shutdown ends the group)
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    run(main, Args)
