"""TRL-style tools, an environment class and a reward function, written as for TRL's GRPOTrainer
(`tools=[add]`, `environment_factory=Counter`, `reward_funcs=[counter_reward]`): the agent tests
load them by path, unchanged."""
import threading
import time


def add(a: int, b: int) -> int:
    """
    Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum.
    """
    return a + b


def explode(reason: str) -> str:
    """
    Always fails.

    Args:
        reason: Why.
    """
    raise RuntimeError(f"boom: {reason}")


def sleepy(seconds: float) -> str:
    """
    Sleeps, then answers.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def repeat(text: str, times: int) -> str:
    """
    Repeats a text.

    Args:
        text: What to repeat.
        times: How many times.
    """
    return text * times


class Counter:
    """TRL environment_factory shape: reset(**row) -> first observation; public methods are tools."""

    def __init__(self):
        self.count = 0
        self.target = None

    def reset(self, **kwargs) -> str | None:
        self.count = 0
        self.target = int(kwargs["target"])
        return f" (count to {self.target})"

    def increment(self, step: int) -> str:
        """
        Increment the counter.

        Args:
            step: How much to add.

        Returns:
            The new count.
        """
        self.count += step
        return str(self.count)


def counter_reward(completions, environments, **kwargs) -> list[float]:
    """TRL signature: reads each rollout's environment instance."""
    return [float(env.count == env.target) for env in environments]


# ---- tools and rewards that misbehave in every way the box must classify ------------------------
RELEASE = threading.Event()
"""Set by a test when it is done with `hang`: its abandoned threads then return."""


def quit_now(code: int) -> str:
    """
    Raises SystemExit, as a careless tool may (sys.exit).

    Args:
        code: The exit code.
    """
    raise SystemExit(code)


def returns_a_set(n: int) -> dict:
    """
    Returns what json.dumps cannot write.

    Args:
        n: How many.
    """
    return {"items": set(range(n))}


class Unprintable:
    def __str__(self):
        raise ValueError("no text for this")


def returns_unprintable(n: int):
    """
    Returns an object whose str() raises.

    Args:
        n: Ignored.
    """
    return Unprintable()


def hang(n: int) -> str:
    """
    Never answers (until the test releases it).

    Args:
        n: Ignored.
    """
    RELEASE.wait()
    return "released"


def reward_sleeps(completions, **kwargs) -> list[float]:
    """A reward function that takes a minute per call."""
    time.sleep(60)
    return [1.0] * len(completions)


def reward_hangs(completions, **kwargs) -> list[float]:
    RELEASE.wait()
    return [1.0] * len(completions)


def reward_huge(completions, **kwargs) -> list[float]:
    """A finite value that overflows any sum or variance it enters."""
    return [1e308] * len(completions)


def reward_exits(completions, **kwargs) -> list[float]:
    raise SystemExit(5)


def reward_first_huge(completions, **kwargs) -> list[float]:
    """The first completion's value out of range, the others usable."""
    return [1e308] + [1.0] * (len(completions) - 1)


class NanCounter(Counter):
    """get_reward returns NaN: counted under the environment's name, never added to the reward."""

    def get_reward(self) -> float:
        return float("nan")
