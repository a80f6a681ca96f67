"""TRL-style tools, an environment class and a reward function, written as for TRL's GRPOTrainer
(`tools=[add]`, `environment_factory=Counter`, `reward_funcs=[counter_reward]`): the agent tests
load them by path, unchanged."""
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
