"""A reward the tiny SFT model can learn in a dozen PPO iterations, for
tests/test_ppo.py::test_each_estimator_raises_the_score_it_is_given (`--reward_fn
tests.learnable:ones`): the embedded task's rule gives a model that rarely adds right almost no
signal, and a test of the optimisation needs a score that moves within seconds."""


def ones(prompt, response):
    """The share of the response's characters that are '1' (0 for an empty response)."""
    return response.count("1") / max(len(response), 1)
