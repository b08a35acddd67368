"""The README's Python API example runs as written (on a tiny checkpoint and the reach task)."""

import re
from pathlib import Path

from tests.test_finetune_cli import checkpoints  # noqa: F401  (a module fixture)

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_python_api_example_runs(checkpoints, capsys):  # noqa: F811
    section = README.read_text().split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 'load_agent("runs/.../4_finetune"' in code and 'envs.make("push_t"' in code
    # the example's task and run directory, swapped for the tiny reach checkpoint of the tests
    code = code.replace('"runs/.../4_finetune"', repr(str(checkpoints / "flow"))).replace('"push_t"', '"reach"')
    exec(compile(code, "README.md", "exec"), {})
    rate, interval = capsys.readouterr().out.split(" ", 1)
    assert 0.0 <= float(rate) <= 1.0 and interval.startswith("[")
