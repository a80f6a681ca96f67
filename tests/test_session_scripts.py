"""The GPU session scripts: the chain runs detached in a fresh `bash -c`, which sees only the
functions the script exported."""
import re
from pathlib import Path

from tests.conftest import REPO


def test_the_detached_chain_sees_every_function_defined_before_it_is_started():
    text = Path(REPO, "scripts", "gpu_one_gpu_session.sh").read_text()
    head, _, _ = text.partition("\nexport -f ")
    defined = set(re.findall(r"^([A-Za-z0-9_]+)\(\) *\{", head, flags=re.M))
    exported = set(re.search(r"^export -f (.+)$", text, flags=re.M).group(1).split())
    assert defined and defined <= exported, f"not exported: {sorted(defined - exported)}"
