"""PPO math against hand-computed values (Tier 1, in-process; whitening uses a 1-rank group)."""

import hashlib
import math
import types

import pytest
import torch
import torch.distributed as dist

import train_ppo as ppo
from conftest import NoKeep
from conftest import tiny_llama


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


def t(x):
    return torch.tensor(x, dtype=torch.float)


def test_rewards_put_kl_on_every_token_and_the_score_on_the_last():
    logp = t([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]])
    ref = t([[-1.5, -2.0, -2.0], [-2.0, -1.0, -1.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])  # the second response has 2 tokens; position 2 is padding
    rewards, kl = ppo.compute_rewards(t([1.0, 2.0]), logp, ref, mask, kl_coef=0.1)
    assert torch.allclose(kl, t([[0.5, 0.0, -1.0], [1.0, 0.0, 0.0]]))
    assert torch.allclose(rewards, t([[-0.05, 0.0, 0.1 + 1.0], [-0.1, 0.0 + 2.0, 0.0]]))


def test_rewards_with_the_k3_kl():
    """--kl_estimator k3: per token r - 1 - log r, r = pi_ref / pi. Where pi_ref is the likelier
    (log r = 0.5 > 0) k1 is a negative penalty, -0.5; k3 is e^0.5 - 1.5 = 0.1487 > 0; where pi is
    the likelier (log r = -0.5), e^-0.5 - 0.5 = 0.1065; a padded column of logprob -1e4 is 0,
    not NaN."""
    logp = t([[-1.0, -2.0, -1e4], [-2.0, -1.0, -1.0]])
    ref = t([[-0.5, -2.5, -2.0], [-2.0, -1.0, -1.0]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    rewards, kl = ppo.compute_rewards(t([1.0, 2.0]), logp, ref, mask, 0.1, "k3")
    k3 = [math.exp(0.5) - 1.5, math.exp(-0.5) - 0.5]
    assert torch.allclose(kl, t([[k3[0], k3[1], 0.0], [0.0, 0.0, 0.0]]))
    assert torch.allclose(rewards, t([[-0.1 * k3[0], -0.1 * k3[1] + 1.0, 0.0], [0, 0, 2.0]]))
    # the same as GRPO's loss term per token (`kl_loss`, eq. 4)
    assert ppo.kl_loss(logp, ref, mask, n_tokens=2).item() == pytest.approx(sum(k3) / 2)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_rloo_penalises_its_sequence_reward_by_the_kl_estimator(estimator):
    """--kl_estimator reaches rloo's sequence reward (`compute_advantages`): one group of two, the
    first sample's two tokens 0.5 nats from the reference one way, the second's the other."""
    logp = t([[-1.0, -1.0], [-1.5, -1.5]])
    ref = t([[-1.5, -1.5], [-1.0, -1.0]])
    mask = t([[1, 1], [1, 1]])
    exp = types.SimpleNamespace(old_logprobs=logp, ref_logprobs=ref)
    exp.batch = types.SimpleNamespace(response_mask=mask)
    args = ppo.Args(advantage_estimator="rloo", n_samples_per_prompt=2, kl_estimator=estimator)
    ppo.compute_advantages(args, exp, t([1.0, 1.0]), torch.arange(2), 0.1)
    kl = {"k1": [1.0, -1.0], "k3": [2 * (math.exp(-0.5) - 0.5), 2 * (math.exp(0.5) - 1.5)]}
    rewards = [1.0 - 0.1 * kl[estimator][0], 1.0 - 0.1 * kl[estimator][1]]
    want = t([rewards[0] - rewards[1], rewards[1] - rewards[0]])
    assert torch.allclose(exp.advantages, want[:, None] * mask)


def test_gae_penalises_its_rewards_by_the_kl_estimator():
    """--kl_estimator reaches GAE's per-token rewards (`compute_advantages`): its advantages are
    those of `compute_rewards` with k3, and not those with k1."""
    logp = t([[-1.0, -1.0], [-1.5, -1.5]])
    ref = t([[-1.5, -1.5], [-1.0, -1.0]])
    mask = t([[1, 1], [1, 1]])
    values = t([[0.1, 0.2], [0.3, 0.4]])
    scores = t([1.0, 0.0])
    exp = types.SimpleNamespace(old_logprobs=logp, ref_logprobs=ref, old_values=values)
    exp.batch = types.SimpleNamespace(response_mask=mask)
    ppo.compute_advantages(ppo.Args(kl_estimator="k3"), exp, scores, torch.arange(2), 0.5)
    for estimator, same in (("k3", True), ("k1", False)):
        rewards, _ = ppo.compute_rewards(scores, logp, ref, mask, 0.5, estimator)
        advantages, _ = ppo.compute_gae(rewards, values, mask, 1.0, 0.95)
        want = ppo.masked_whiten(advantages, mask)
        assert torch.allclose(exp.advantages, want) == same


def test_gae_by_hand():
    rewards = t([[0.0, 0.0, 1.0]])
    values = t([[0.5, 0.6, 0.7]])
    adv, ret = ppo.compute_gae(rewards, values, t([[1, 1, 1]]), gamma=1.0, lam=0.9)
    # delta_2 = 1 - 0.7 = 0.3; delta_1 = 0.7 - 0.6 = 0.1; delta_0 = 0.6 - 0.5 = 0.1
    assert torch.allclose(adv, t([[0.1 + 0.9 * (0.1 + 0.9 * 0.3), 0.1 + 0.9 * 0.3, 0.3]]))
    assert torch.allclose(ret, adv + t([[0.5, 0.6, 0.7]]))
    # Padding: the value at a padded position (9.0) must not leak into the last real token's target.
    rewards = t([[0.0, 1.0, 0.0]])
    values = t([[0.2, 0.4, 9.0]])
    adv, ret = ppo.compute_gae(rewards, values, t([[1, 1, 0]]), gamma=0.5, lam=1.0)
    # delta_0 = 0.5*0.4 - 0.2 = 0
    assert torch.allclose(adv, t([[0.0 + 0.5 * 0.6, 1.0 - 0.4, 0.0]]))
    assert torch.allclose(ret, t([[0.5, 1.0, 0.0]]))


def test_masked_whiten():
    x = t([[1.0, 2.0, 3.0], [4.0, 50.0, 60.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    sd = math.sqrt(1.25)  # of 1, 2, 3, 4 (the population variance; padding ignored)
    want = t([[-1.5 / sd, -0.5 / sd, 0.5 / sd], [1.5 / sd, 0.0, 0.0]])
    assert torch.allclose(ppo.masked_whiten(x, mask), want, atol=1e-6)
    unshifted = ppo.masked_whiten(x, mask, shift_mean=False)
    assert torch.allclose(unshifted, (want + 2.5) * mask, atol=1e-6)


def test_masked_whiten_with_a_large_offset():
    """float32 values around 1e4 with a spread of about 1: the one-pass E[x^2] - E[x]^2 in float32
    lost the variance entirely; two passes in float64 keep it."""
    torch.manual_seed(0)
    x = 10_000.0 + torch.randn(4, 64)
    mask = torch.ones(4, 64)
    mask[:, 48:] = 0
    kept = x[:, :48].double()
    want = (kept - kept.mean()) / torch.sqrt(kept.var(unbiased=False) + 1e-8)
    got = ppo.masked_whiten(x, mask)
    assert torch.isfinite(got).all()
    assert torch.allclose(got[:, :48].double(), want, atol=1e-3)
    assert (got[:, 48:] == 0).all()


def test_k3_kl_loss_is_finite_with_very_unlikely_padding():
    """At padding columns the current logprobs can be anything (here -200): exp(200) overflows,
    and the masked mean must not turn inf * 0 into NaN."""
    logp = t([[math.log(0.5), -200.0]])
    ref = t([[math.log(0.25), 0.0]])
    loss = ppo.kl_loss(logp, ref, t([[1, 0]]), n_tokens=1)
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(0.5 - math.log(0.5) - 1)


def test_clipped_policy_loss_by_hand():
    ratio = t([[1.5, 0.5, 0.5, 1.5]])
    old = t([[-1.0, -1.0, -1.0, -1.0]])
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    logp = old + ratio.log()
    mask = torch.ones(1, 4)
    loss, clipfrac, approxkl, r = ppo.policy_loss(logp, old, adv, mask, 0.2, n_tokens=4)
    # max(-A r, -A clip(r)): -1.2 (clipped), -0.5, 0.8 (clipped), 1.5
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5) / 4)
    assert clipfrac.item() == pytest.approx(0.5)
    want_approxkl = 0.5 * (2 * math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2) / 4
    assert approxkl.item() == pytest.approx(want_approxkl)
    assert torch.allclose(r, ratio)
    # A padded token contributes nothing, whatever its values.
    logp = t([[0.0, 5.0]])
    old = t([[0.0, -5.0]])
    adv = t([[1.0, 100.0]])
    loss2, *_ = ppo.policy_loss(logp, old, adv, t([[1, 0]]), 0.2, n_tokens=1)
    assert loss2.item() == pytest.approx(-1.0)


def test_clip_higher_by_hand():
    """DAPO's clip-higher (Yu et al. 2025, eq. 10): the upper clip at 1 + 0.28, the lower at
    1 - 0.2. A positive advantage's ratio may now rise to 1.28; a negative one's falls to 0.8 as
    before."""
    ratio = t([[1.25, 1.3, 0.7, 1.25]])
    old = t([[-1.0, -1.0, -1.0, -1.0]])
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    logp = old + ratio.log()
    mask = torch.ones(1, 4)
    loss, clipfrac, *_ = ppo.policy_loss(logp, old, adv, mask, 0.2, 4, cliprange_high=0.28)
    # max(-A r, -A clip(r, 0.8, 1.28)): -1.25 (inside now), -1.28 (clipped), 0.8 (clipped), 1.25
    # (a negative advantage's ratio above 1 is never clipped: the unclipped term is the max)
    assert loss.item() == pytest.approx((-1.25 - 1.28 + 0.8 + 1.25) / 4)
    assert clipfrac.item() == pytest.approx(0.5)
    symmetric, *_ = ppo.policy_loss(logp, old, adv, mask, 0.2, 4)
    assert symmetric.item() == pytest.approx((-1.2 - 1.2 + 0.8 + 1.25) / 4)


def test_value_loss_clipped_and_not():
    v = t([[1.0, 0.0]])
    old = t([[0.5, 0.0]])
    ret = t([[0.0, 0.3]])
    m = t([[1, 1]])
    loss, frac = ppo.value_loss(v, old, ret, m, 0.0, n_tokens=2)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.09) / 2) and frac.item() == 0
    # clipped: v 1.0 -> 0.7 (old 0.5 + 0.2): max(1.0, 0.49) = 1.0; second token unchanged 0.09
    loss, frac = ppo.value_loss(v, old, ret, m, 0.2, n_tokens=2)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.09) / 2) and frac.item() == 0
    v = t([[0.0, 0.0]])  # now clipping raises the loss: 0.5 - 0.2 = 0.3 -> (0.3)^2 > 0
    loss, frac = ppo.value_loss(v, old, ret, m, 0.2, n_tokens=2)
    assert loss.item() == pytest.approx(0.5 * (0.09 + 0.09) / 2)
    assert frac.item() == pytest.approx(0.5)


def test_group_baselines():
    s = t([[1.0, 0.0, 0.0, 1.0]])
    grpo = ppo.group_advantages(s, "grpo")
    std = math.sqrt(1 / 3)  # unbiased std of 1, 0, 0, 1
    assert torch.allclose(grpo, t([[0.5, -0.5, -0.5, 0.5]]) / (std + 1e-4))
    assert torch.allclose(ppo.group_advantages(s, "rloo"), t([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))
    # no signal, no NaN
    assert torch.allclose(ppo.group_advantages(t([[1.0, 1.0]]), "grpo"), t([[0.0, 0.0]]))
    # a fork's new --advantage_estimator choice without its baseline was grpo's, silently
    with pytest.raises(ValueError, match="no baseline for 'dr_grpo'"):
        ppo.group_advantages(s, "dr_grpo")


def test_group_baselines_scaled_by_the_batch_or_not_at_all():
    """--scale_rewards: the group's mean always; the group's std (sec. 4.1.2), the whole batch's, or
    none (Dr. GRPO). Two groups, 1 0 0 1 and 1 1 1 0: centred 0.5 -0.5 -0.5 0.5 and 0.25 0.25
    0.25 -0.75; the batch's five 1s and three 0s have the unbiased variance
    (5 (3/8)^2 + 3 (5/8)^2) / 7 = 120 / 448."""
    s = t([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    centred = t([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]])
    assert torch.allclose(ppo.group_advantages(s, "grpo", "none"), centred)
    batch = ppo.group_advantages(s, "grpo", "batch")
    assert torch.allclose(batch, centred / (math.sqrt(120 / 448) + 1e-4))
    # the std of every rank's scores, given (`batch_std`): it alone divides
    given = ppo.group_advantages(s, "grpo", "batch", batch_std=2.0)
    assert torch.allclose(given, centred / 2.0001)
    group = ppo.group_advantages(s, "grpo", "group")
    stds = t([[math.sqrt(1 / 3)], [0.5]])  # unbiased: 1 0 0 1, and 1 1 1 0
    assert torch.allclose(group, centred / (stds + 1e-4))
    # in one rank's process, batch_std is that std too (a 1-rank group)
    assert ppo.batch_std(s.flatten()) == pytest.approx(math.sqrt(120 / 448))
    # a batch whose scores all agree: no advantage, no NaN
    same = t([[2.0, 2.0], [2.0, 2.0]])
    assert torch.equal(ppo.group_advantages(same, "grpo", "batch"), torch.zeros(2, 2))
    assert ppo.batch_std(same.flatten()) == 0.0


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_compute_advantages_divides_as_scale_rewards_says(scale):
    """The flag reaches the advantages: one group of 1 0 0 1 and one of 1 1 1 0, its rows in a
    shuffled order as the phase gets them, each row's advantage on each of its tokens."""
    scores = t([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])  # prompt-major
    order = torch.tensor([3, 0, 7, 5, 1, 6, 2, 4])  # row i holds sample order[i]
    mask = t([[1, 1]] * 8)
    exp = types.SimpleNamespace(old_logprobs=None, ref_logprobs=None)
    exp.batch = types.SimpleNamespace(response_mask=mask)
    args = ppo.Args(advantage_estimator="grpo", n_samples_per_prompt=4, scale_rewards=scale)
    ppo.compute_advantages(args, exp, scores[order], order, 0.0)
    want = ppo.group_advantages(scores.view(2, 4), "grpo", scale).flatten()[order]
    assert torch.allclose(exp.advantages, want[:, None] * mask)
    centred = t([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])[order]
    # only Dr. GRPO leaves them undivided (group: stds 0.58 and 0.5; batch: 0.52)
    assert torch.allclose(exp.advantages[:, 0], centred) == (scale == "none")


def test_eos_penalty():
    got = ppo.eos_penalized(t([1.0, 1.0, 0.0]), [True, False, False], penalty=1.0)
    assert torch.allclose(got, t([1.0, 0.0, -1.0]))


def test_adaptive_kl_controller():
    def coef(kl):
        return ppo.update_kl_coef(0.1, kl=kl, target=6.0, n_responses=100, horizon=1000)

    assert coef(12.0) == pytest.approx(0.1 * 1.02)
    assert coef(6.6) == pytest.approx(0.1 * 1.01)
    assert coef(0.0) == pytest.approx(0.1 * 0.98)


def test_make_batch_layout():
    batch = ppo.make_batch([[5, 6], [7]], [[8, 2], [9, 10, 2]], pad_id=0)
    assert batch.response_start == 2
    assert batch.input_ids.tolist() == [[5, 6, 8, 2, 0], [0, 7, 9, 10, 2]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 3], [0, 0, 1, 2, 3]]
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    # the shift: the output at column P - 1 + k is the one that predicts response token k
    outputs = torch.arange(5)[None].expand(2, 5)
    assert ppo.at_responses(outputs, batch).tolist() == [[1, 2, 3], [1, 2, 3]]


def test_k3_kl_loss():
    logp = t([[math.log(0.5), math.log(0.2)]])
    ref = t([[math.log(0.25), math.log(0.2)]])
    # k3 = r - log r - 1 with r = pi_ref/pi: 0.5 - log 0.5 - 1 on token 0, 0 on token 1
    want = (0.5 - math.log(0.5) - 1) / 2
    assert ppo.kl_loss(logp, ref, t([[1, 1]]), n_tokens=2).item() == pytest.approx(want)


def test_reward_model_reads_its_own_tokens_at_the_last_real_token(tmp_path):
    """A reward model of another family (GPT-2: other ids, no PAD, so PAD == EOS) scores its own
    tokenisation of the text, at the last real token: EOS when the response ended, whatever the
    padding, and the same in a batch as alone."""
    from test_families import build_gpt2
    from transformers import AutoModelForSequenceClassification

    import common

    build_gpt2(str(tmp_path))
    model, tok = common.load_model_and_tokenizer(
        str(tmp_path), AutoModelForSequenceClassification, new_head=True, num_labels=1
    )
    assert tok.pad_token_id == tok.eos_token_id  # no PAD: EOS stands in
    model.config.pad_token_id = tok.pad_token_id
    sequences = ppo.reward_model_inputs(
        tok, ["1+2=", "10+20="], ["3", "30 and more"], [True, False]
    )
    assert sequences[0] == tok("1+2=3").input_ids + [tok.eos_token_id]
    assert sequences[1] == tok("10+20=30 and more").input_ids  # cut: no EOS
    with torch.no_grad():
        want = []
        for ids in sequences:  # unpadded, one at a time, by hand: the head at the last position
            hidden = model.transformer(input_ids=torch.tensor([ids])).last_hidden_state
            want.append(model.score(hidden)[0, -1, 0].item())
        common.shard_model(model.eval(), torch.device("cpu"))
        batched = ppo.reward_model_scores(model, sequences, tok.pad_token_id, 8, "cpu")
        alone = [
            ppo.reward_model_scores(model, [ids], tok.pad_token_id, 8, "cpu") for ids in sequences
        ]
    assert torch.allclose(batched, torch.tensor(want), atol=1e-5)
    assert torch.allclose(batched, torch.cat(alone), atol=1e-5)
    # phase (2), `score`, wires them up: these scores, normalised with the config's statistics
    # unless --reward_norm false (the unit tests of normalised_scores alone did not see it)
    args = types.SimpleNamespace(reward_model=str(tmp_path), micro_batch_size=8)
    models = types.SimpleNamespace(reward_model=model, reward_tokenizer=tok, reward_context=1024)
    rows = [{"prompt": "1+2="}, {"prompt": "10+20="}]
    # as the engines give them: a finished response ends with its stop id (`written_texts`)
    responses = [tok("3").input_ids + [tok.eos_token_id], tok("30 and more").input_ids]
    prompts = [tok("1+2=").input_ids, tok("10+20=").input_ids]  # the ids they answer
    with torch.no_grad():
        models.reward_norm = None
        raw, _ = ppo.score(args, tok, models, rows, prompts, responses, [True, False], "cpu")
        models.reward_norm = (0.5, 2.0)
        normalised, _ = ppo.score(args, tok, models, rows, prompts, responses, [True, False], "cpu")
    assert torch.allclose(raw, batched, atol=1e-6), (raw, batched)
    assert torch.allclose(normalised, (batched - 0.5) / 2.0, atol=1e-6), normalised


def test_old_logprobs_from_the_update_change_nothing():
    """A GRPO iteration of one optimizer step (--ppo_epochs 1, --train_batch_size = every
    response) with and without step (3)'s actor forward: when the update's own forward fills
    the old logprobs (`old_logprobs_from_update`), the old logprobs, the losses and the updated
    weights are bitwise those of the path that computes them first."""
    import copy

    actor = tiny_llama(vocab_size=16)
    args = ppo.Args(model="unused", out_dir="unused")
    args.advantage_estimator = "grpo"
    args.kl_coef = 0.0
    args.ppo_epochs = 1
    args.rollout_batch_size = 3
    args.n_samples_per_prompt = 2
    args.train_batch_size = 6
    args.micro_batch_size = 4  # two micro-batches, the second short
    assert ppo.old_logprobs_from_update(args)
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9], [3], [3]]
    responses = [[1, 2], [3, 4, 5, 2], [6], [7, 8, 2], [9, 9, 9, 9], [4, 2]]
    scores = t([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    order = torch.tensor([3, 0, 5, 1, 4, 2])

    class Tok:
        pad_token_id = 0

    results = []
    for from_update in [False, True]:
        model = copy.deepcopy(actor)
        models = ppo.Models(actor=model, ref=None, critic=None, reward_model=None)
        roles = {"actor": (model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5))}
        exp = ppo.old_logprobs_and_values(
            args, models, Tok(), prompts, responses, order, "cpu", from_update
        )
        assert (exp.old_logprobs is None) == from_update
        ppo.compute_advantages(args, exp, scores[order], order, 0.0)
        stats, maxima = ppo.ppo_update(args, models, roles, exp, 0.0)
        assert maxima == {"policy/first_ratio_dev": 0.0}
        results.append((exp.old_logprobs, stats, list(model.parameters())))
    (old_a, stats_a, params_a), (old_b, stats_b, params_b) = results
    assert torch.equal(old_a, old_b)
    assert stats_a.keys() == stats_b.keys()
    for name in stats_a:
        assert torch.equal(torch.as_tensor(stats_a[name]), torch.as_tensor(stats_b[name])), name
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    assert not torch.equal(params_a[0], actor.model.embed_tokens.weight)  # it did train


def test_old_logprobs_from_the_update_only_when_one_step_and_no_kl_reward():
    args = ppo.Args(model="unused", out_dir="unused")
    args.rollout_batch_size = 8
    args.n_samples_per_prompt = 4
    args.train_batch_size = 32
    args.ppo_epochs = 1
    args.advantage_estimator = "grpo"
    args.kl_coef = 0.05
    assert ppo.old_logprobs_from_update(args)  # grpo's KL is a loss term
    args.advantage_estimator = "rloo"
    assert not ppo.old_logprobs_from_update(args)  # a KL reward needs them first
    args.kl_coef = 0.0
    assert ppo.old_logprobs_from_update(args)  # no reference, no KL reward
    args.target_kl = 0.1
    assert not ppo.old_logprobs_from_update(args)  # adaptive: a reference after all
    args.target_kl = 0.0
    args.ppo_epochs = 2
    assert not ppo.old_logprobs_from_update(args)  # the second epoch needs the first's weights
    args.ppo_epochs = 1
    args.train_batch_size = 16
    assert not ppo.old_logprobs_from_update(args)  # two steps: the second ran on new weights


def test_logprobs_need_the_head_only_where_a_response_token_is_predicted():
    """`logprobs_of` asks the model for its head's logits at the last R + 1 columns only
    (`common.head_only_at_last`): the logprobs are bitwise those of the full [B, P + R, V]
    logits, the head sees R + 1 columns, and a model whose forward takes no `logits_to_keep`
    gets the same logprobs from its full logits."""
    model = tiny_llama(vocab_size=300)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12]]
    responses = [[1, 2], [3, 4, 5, 2], [6]]
    batch = ppo.make_batch(prompts, responses, pad_id=0)  # P = 5, R = 4
    head_columns = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: head_columns.append(i[0].shape[1]))
    with torch.no_grad():
        logprobs = ppo.logprobs_of(model, batch, temperature=0.7)  # [3, 4]
        full = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
        ).logits  # [3, 9, V]
    hook.remove()
    assert head_columns == [5, 9]  # R + 1 for logprobs_of, P + R for the full forward
    expected = (full[:, 4:-1].float() / 0.7).log_softmax(-1)  # columns P - 1 .. P + R - 2
    expected = expected.gather(-1, batch.input_ids[:, 5:, None])[..., 0]
    assert torch.equal(logprobs, expected)

    with torch.no_grad():
        assert torch.equal(ppo.logprobs_of(NoKeep(model), batch, temperature=0.7), expected)


def test_adamw_takes_weight_decay_from_its_flag():
    """The actor's and critic's AdamW decay as --weight_decay says; its default, 0.01, is torch's
    own, which every run measured here used (it was torch's default, unsaid, and the docs said
    the 37 details' Adam)."""
    assert ppo.Args().weight_decay == 0.01
    layer = torch.nn.Linear(2, 2)
    for decay in (0.0, 0.5):
        group = ppo.adamw(layer, 1e-4, decay).param_groups[0]
        assert (group["weight_decay"], group["eps"], group["lr"]) == (decay, 1e-5, 1e-4)


def test_the_evaluation_line_says_accuracy_only_of_the_right_or_wrong_rule():
    """eval/accuracy is the greedy answers' mean score: an accuracy under the embedded task's
    rule only. A shaped rule printed "held-out accuracy -0.097", a reward model's score too."""
    metrics = {"eval/accuracy": -0.097}
    assert ppo.eval_line(ppo.Args(), 3, metrics) == "step 3: held-out accuracy -0.097"
    shaped = ppo.Args(reward_fn="shaping:shaped")
    assert ppo.eval_line(shaped, 3, metrics) == "step 3: held-out score -0.097"
    learned = ppo.Args(reward_model="rm", gold_reward_fn="task:reward_fn")
    line = ppo.eval_line(learned, 3, {**metrics, "eval/gold_accuracy": 0.5})
    assert line == "step 3: held-out reward-model score -0.097, gold accuracy 0.500"


def test_a_resume_notes_a_rule_whose_file_changed(one_rank, capsys):
    """A reward rule's module edited between a run's start and its resume scored the rest of the
    run by other arithmetic, silently (a fork's helper changed a penalty's coefficient: the score
    jumped). meta.json keeps each rule's file digest; a resume notes the ones that changed."""
    import task

    args = ppo.Args()
    digests = ppo.rule_digests(args)
    with open(task.__file__, "rb") as f:
        assert digests == {"task:reward_fn": hashlib.sha256(f.read()).hexdigest()}
    ppo.note_changed_rules({"rules": digests}, digests, "ckpt")
    ppo.note_changed_rules({}, digests, "ckpt")  # a checkpoint from before: nothing to say
    assert capsys.readouterr().out == ""
    ppo.note_changed_rules({"rules": {"task:reward_fn": "0" * 64}}, digests, "ckpt")
    out = capsys.readouterr().out
    assert out.startswith("note: task:reward_fn: its module's file changed since ckpt was saved")


def test_step_3_chunks_the_rows_as_the_update_does(monkeypatch):
    """A --micro_batch_size above a rank's share of a minibatch makes the share one micro-batch
    in the update; step (3) computes the old logprobs, reference logprobs and values in the same
    row groups, so the first epoch's micro-batches see the shapes their old numbers came from
    (a GPU's kernels are not batch-invariant: first_ratio_dev was no longer 0 there, and on the
    CPU a critic's values moved by 3e-8 against --micro_batch_size = the share)."""
    actor = tiny_llama(vocab_size=16)
    args = ppo.Args(model="unused", out_dir="unused")
    args.rollout_batch_size = 4
    args.n_samples_per_prompt = 2
    args.train_batch_size = 4  # 2 minibatches of 4 over this one rank's 8 responses
    args.micro_batch_size = 32  # above the share of 4: one micro-batch of 4
    sizes = []
    logprobs_of = ppo.logprobs_of

    def recorded(model, batch, temperature):
        sizes.append(len(batch.input_ids))
        return logprobs_of(model, batch, temperature)

    monkeypatch.setattr(ppo, "logprobs_of", recorded)
    models = ppo.Models(actor=actor, ref=None, critic=None, reward_model=None)

    class Tok:
        pad_token_id = 0

    prompts = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9], [3], [3], [4, 4], [4, 4]]
    responses = [[1, 2], [3, 4, 5, 2], [6], [7, 8, 2], [9, 9, 9, 9], [4, 2], [5], [6, 7]]
    with torch.no_grad():
        ppo.old_logprobs_and_values(
            args, models, Tok(), prompts, responses, torch.arange(8), "cpu", False
        )
    assert sizes == [4, 4]
