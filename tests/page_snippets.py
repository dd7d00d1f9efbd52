"""The code blocks of the notes' pages, found as a reader finds them: on a page, under a heading, the ```python block
after a marker comment that names the test running it. A test extracts a block with code_block and runs it as
written, so the page cannot drift from what the library does."""

import os
import re

from conftest import ROOT


def section(page, heading):
    """The text of `page` (a path from the repository root) under its one `## heading`, up to the next one."""
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    title = f"\n## {heading}\n"
    assert text.count(title) == 1, (page, heading)
    return text.split(title, 1)[1].split("\n## ", 1)[0]


def code_block(page, heading, marker):
    """The code of the ```python block right after `marker` (an HTML comment, once in the section) in `page`'s
    section `heading`."""
    text = section(page, heading)
    assert text.count(marker) == 1, (page, heading, marker)
    return re.match(r"\s*```python\n(.*?)```", text.split(marker, 1)[1], re.S).group(1)
