"""A reward the tiny SFT model can learn in a dozen PPO iterations, for
tests/test_ppo.py::test_each_estimator_raises_the_score_it_is_given (`--reward_fn
tests.learnable:ones`): the embedded task's rule gives a model that rarely adds right almost no
signal, and a test of the optimisation needs a score that moves within seconds."""


def ones(prompt, response):
    """The share of the response's characters that are '1' (0 for an empty response)."""
    return response.count("1") / max(len(response), 1)


def ones_after_a_conversation(prompt, response, answer):
    """`ones`, for a run whose prompts are conversations opening with a system turn and whose
    rows carry the sum's `answer` beside them
    (tests/test_families.py::test_conversations_as_prompts_through_sft_dpo_and_ppo): a prompt
    that reaches the function as anything else, or an answer not its own row's, is an error,
    so the run fails."""
    if not isinstance(prompt, list) or prompt[0]["role"] != "system":
        raise ValueError(f"expected the data's conversation, got {prompt!r:.100}")
    a, b = prompt[-1]["content"].rstrip("=").split("+")
    if answer != str(int(a) + int(b)):
        raise ValueError(f"expected the row's answer to {prompt[-1]['content']}, got {answer!r}")
    return ones(prompt, response)
