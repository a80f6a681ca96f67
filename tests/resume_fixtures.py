"""The arithmetic env recording which prompt each group got, for the resume tests: every
`start_group` appends `group_id<TAB>prompt` to the file `$COLOCATE_TEST_RECORD` names (one line
per group, written before the group plays, so a kill -9 leaves every line written so far)."""
import os

from colocate.envs import arithmetic
from colocate.envs.arithmetic import ArithmeticEnv


class RecordingArithmeticEnv(ArithmeticEnv):
    @classmethod
    def corpus(cls, cfg) -> list[str]:
        return arithmetic.corpus(cfg.env.max_operand)

    def start_group(self, group_id: int) -> None:
        super().start_group(group_id)
        ids = self._pending[(group_id, 0)][0]
        with open(os.environ["COLOCATE_TEST_RECORD"], "a") as f:
            f.write(f"{group_id}\t{self.tokenizer.decode(ids)}\n")


def read_record(path) -> list[tuple[int, str]]:
    """[(group id, prompt)] in the order the groups started."""
    with open(path) as f:
        return [(int(g), p) for g, p in (line.rstrip("\n").split("\t", 1) for line in f)]
