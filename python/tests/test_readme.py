"""python/README.md's store snippet ("The four jobs") runs as printed, in a fresh namespace
(issue 35: it raised NameError: ids), and leaves what it promises."""
import os
import re

import numpy as np

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_store_snippet_runs():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## The four jobs"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "s.put(" in code and "get_view" in code
    names = {}
    exec(compile(code, README + ": the four jobs", "exec"), names)  # noqa: S102
    assert np.array_equal(names["a"], names["ids"])
    assert names["total"] == int(np.asarray(names["ids"]).sum())
