"""train_dpo.py's math by hand: summed response logprobs under padding, the DPO loss (eq. 7) with
its implicit rewards and accuracy, label smoothing, IPO; and the encoding PPO and the RM share."""

import math

import pytest
import torch

import task
import train_dpo
import train_ppo
from conftest import NoKeep
from conftest import tiny_llama


def flags(beta=0.5, label_smoothing=0.0, loss_type="sigmoid"):
    """dpo_loss's settings, as keywords."""
    return {"beta": beta, "eps": label_smoothing, "loss_type": loss_type}


def test_collate_masks_the_response_from_the_lengths_not_the_ids():
    # a pair of unequal lengths; PAD equal to EOS (2): the response's own EOS still counts
    chosen = ([1, 5, 6, 2], 2)  # prompt [1, 5], response [6] + EOS
    rejected = ([1, 5, 6, 7, 8, 2], 2)
    input_ids, attention_mask, response_mask = train_dpo.collate([chosen, rejected], pad_id=2)
    assert input_ids.tolist() == [[1, 5, 6, 2, 2, 2], [1, 5, 6, 7, 8, 2]]
    assert attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert response_mask.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]


def test_sequence_logprobs_sum_the_response_tokens_only():
    torch.manual_seed(0)
    sequences = [([1, 5, 6, 2], 2), ([3, 1, 5, 6, 7, 8, 2], 3)]  # unequal prompts and responses
    input_ids, _, response_mask = train_dpo.collate(sequences, pad_id=0)
    logits = torch.randn(2, input_ids.shape[1], 10)
    got = train_dpo.sequence_logprobs(logits, input_ids, response_mask)
    logp = logits.log_softmax(-1)
    want = []
    for row, (ids, n_prompt) in enumerate(sequences):
        # token k is predicted at position k - 1
        want.append(sum(logp[row, k - 1, ids[k]].item() for k in range(n_prompt, len(ids))))
    assert got.tolist() == pytest.approx(want, rel=1e-6)
    # what sits in the padding cannot change the result
    noisy = logits.clone()
    noisy[0, 4:] = 100.0
    assert torch.allclose(train_dpo.sequence_logprobs(noisy, input_ids, response_mask), got)


def test_pair_logprobs_need_the_head_only_from_the_shortest_prompt_on():
    """`pair_logprobs` asks for the head's logits from the shortest prompt's last column on: the
    same logprobs as over the full [2b, T, V] logits, and from a model without
    `logits_to_keep`."""
    model = tiny_llama(vocab_size=300)
    pairs = [
        (([5, 6, 7, 8, 1, 2], 4), ([5, 6, 7, 8, 3], 4)),
        (([9, 10, 4, 4, 2], 2), ([9, 10, 2], 2)),
    ]
    head_columns = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: head_columns.append(i[0].shape[1]))
    with torch.no_grad():
        chosen, rejected = train_dpo.pair_logprobs(model, pairs, pad_id=0, device="cpu")
        sequences = [c for c, _ in pairs] + [r for _, r in pairs]
        input_ids, attention_mask, response_mask = train_dpo.collate(sequences, pad_id=0)
        full = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [4, 6, V]
    hook.remove()
    assert head_columns == [5, 6]  # T - 2 + 1 (the shortest prompt: 2 tokens), then T
    want = train_dpo.sequence_logprobs(full, input_ids, response_mask)  # [4]
    assert torch.equal(torch.cat([chosen, rejected]), want)
    with torch.no_grad():
        nokeep = train_dpo.pair_logprobs(NoKeep(model), pairs, pad_id=0, device="cpu")
    assert torch.equal(torch.cat(nokeep), want)


def test_dpo_loss_rewards_and_accuracy_by_hand():
    pi_c = torch.tensor([-3.0, -5.0])
    pi_r = torch.tensor([-4.0, -2.0])
    ref_c = torch.tensor([-3.5, -4.0])
    ref_r = torch.tensor([-3.5, -3.0])
    # h = (pi_c - ref_c) - (pi_r - ref_r): (0.5 - -0.5) = 1 and (-1 - 1) = -2; beta 0.5
    want = (math.log(1 + math.exp(-0.5)) + math.log(1 + math.exp(1.0))) / 4  # 4 global pairs
    got = train_dpo.dpo_loss(pi_c, pi_r, ref_c, ref_r, 4, **flags())
    assert got.item() == pytest.approx(want, rel=1e-6)
    stats = train_dpo.dpo_statistics(pi_c, pi_r, ref_c, ref_r, 0.5)
    # implicit rewards 0.5 * (pi - ref): chosen 0.25, -0.5; rejected -0.25, 0.5
    assert stats["rewards/chosen"] == pytest.approx(-0.25)
    assert stats["rewards/rejected"] == pytest.approx(0.25)
    assert stats["rewards/margins"] == pytest.approx(0.5 - 1.0)
    assert stats["rewards/accuracies"] == 1.0  # the first pair is right, the second wrong
    assert stats["logps/chosen"] == -8.0 and stats["logps/rejected"] == -6.0


def test_the_loss_is_log_2_when_the_policy_is_the_reference():
    logps = torch.tensor([-3.0, -7.5, -1.25])
    got = train_dpo.dpo_loss(logps, logps + 1, logps, logps + 1, 3, **flags(beta=0.1))
    assert got.item() == pytest.approx(math.log(2), rel=1e-7)


def test_label_smoothing_by_hand():
    h = 2.0
    pi_c = torch.tensor([h])
    zero = torch.zeros(1)
    eps = 0.1
    x = 0.5 * h
    want = (1 - eps) * math.log(1 + math.exp(-x)) + eps * math.log(1 + math.exp(x))
    got = train_dpo.dpo_loss(pi_c, zero, zero, zero, 1, **flags(label_smoothing=eps))
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_ipo_by_hand():
    pi_c = torch.tensor([3.0, 0.0])
    zero = torch.zeros(2)
    # target 1 / (2 beta) = 1 with beta 0.5: (3 - 1)^2 and (0 - 1)^2, over 2 pairs
    got = train_dpo.dpo_loss(pi_c, zero, zero, zero, 2, **flags(loss_type="ipo"))
    assert got.item() == pytest.approx((4 + 1) / 2)


def test_micro_batches_add_up_to_the_global_mean():
    pi_c = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    pi_r = torch.tensor([-2.0, -1.0, -5.0, -3.0])
    ref = torch.full((4,), -2.5)
    whole = train_dpo.dpo_loss(pi_c, pi_r, ref, ref, 4, **flags())
    halves = train_dpo.dpo_loss(pi_c[:2], pi_r[:2], ref[:2], ref[:2], 4, **flags())
    halves = halves + train_dpo.dpo_loss(pi_c[2:], pi_r[2:], ref[2:], ref[2:], 4, **flags())
    assert halves.item() == pytest.approx(whole.item(), rel=1e-6)


def test_pairs_are_encoded_as_ppo_encodes_a_finished_response():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    row = {"prompt": "37+45=", "chosen": "82", "rejected": "712"}
    [((chosen, n_c), (rejected, n_r))] = train_dpo.encode_pairs(tok, [("data:1", row)], 64)
    want = train_ppo.reward_model_inputs(tok, ["37+45="] * 2, ["82", "712"], [True, True])
    assert [chosen, rejected] == want
    assert n_c == n_r == len(chosen) - 3  # "8", "2", EOS are the response


def test_a_loss_type_without_its_loss_is_an_error():
    """A fork's new --loss_type choice without its loss in dpo_loss was the sigmoid's, silently."""
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="no loss for 'simpo'"):
        train_dpo.dpo_loss(x, x, x, x, 2, 0.1, "simpo", 0.0)
