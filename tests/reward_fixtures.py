"""Reward functions with TRL's signature that fail, for the failure-reporting tests (loaded by path
as `tests.reward_fixtures:NAME`, as a user's would be)."""


def exact_but_raises_on_sevens(prompts, completions, answer, **columns):
    """1.0 for the right answer; raises on the rows whose answer is 7 (2 of the 25 addition rows)."""
    if answer[0] == "7":
        raise ValueError("no rule for sevens")
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


CALLS = [0]


def breaks_after_its_first_call(prompts, completions, **columns):
    """Scores the pre-launch check's call, then raises on every later one in this process."""
    CALLS[0] += 1
    if CALLS[0] > 1:
        raise ConnectionError("reward service unreachable")
    return [0.0] * len(completions)


def counts_its_checks(prompts, completions, answer, **columns):
    """`exact`; the pre-launch check's call (the row's answer, then "I do not know.": one per check)
    also appends a line to the file $COLOCATE_TEST_CHECKS names, so a test counts the checks."""
    import os
    if len(completions) == 2 and completions[1] == "I do not know.":
        with open(os.environ["COLOCATE_TEST_CHECKS"], "a") as f:
            f.write(f"{os.getpid()}\n")
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
