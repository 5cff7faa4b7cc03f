"""Print the run file reference, or rewrite it between a document's markers:

python -m eagleops.pipeline.config                   # print
python -m eagleops.pipeline.config docs/run-file.md  # update the reference in place
"""

from __future__ import annotations

import sys
from pathlib import Path

from .run import RunConfig
from .schema import reference_markdown

START, END = "<!-- run-file-reference:start -->", "<!-- run-file-reference:end -->"


def document_with_reference(text: str) -> str:
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    if not rest:
        raise SystemExit(f"no {START} marker in the document")
    return f"{head}{START}\n{reference_markdown(RunConfig)}{END}{tail}"


def main(argv: list[str]) -> int:
    if not argv:
        sys.stdout.write(reference_markdown(RunConfig))
        return 0
    path = Path(argv[0])
    path.write_text(document_with_reference(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
