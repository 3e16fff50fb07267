"""The README's usage example runs as written."""

import os
import re

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_usage_example_runs():
    text = open(README).read()
    section = text[text.index("## The Python package"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["o"].shape == (9, 4, 16) and scope["logp"].shape == (5, 64)
