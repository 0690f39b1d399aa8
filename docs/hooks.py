"""mkdocs hook: replace ``<!-- akv plan ARGS -->`` with the output of ``akv plan ARGS``.

The TP diagrams in the docs are generated from the code at build time, so they cannot drift.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from typing import Any

_MARK = re.compile(r"<!-- akv plan (.*?) -->")


def _plan(args: str) -> str:
    from akv.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", *shlex.split(args)])
    if code:
        raise RuntimeError(f"akv plan {args} exited {code}")
    return f"```text\n$ akv plan {args}\n{out.getvalue().rstrip()}\n```"


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _MARK.sub(lambda m: _plan(m.group(1)), markdown)
