"""The front door: the ``eagleops`` script, ``python -m eagleops``, and torchrun's entry
(``torchrun --nproc_per_node N -m eagleops train RUN.toml``). Its signals first, then the rest."""

from __future__ import annotations

import os
import sys


def main() -> int:
    from eagleops.signals import install_headless_signals

    install_headless_signals(sys.argv[1:])  # before anything heavy is imported
    from eagleops.cli import main as cli_main

    return cli_main()


def _leave(code: int) -> None:
    from eagleops.ranks import under_torchrun

    if under_torchrun():
        # a rank leaves without finalizing the interpreter: gloo's worker threads can still be
        # dropping the last collective's tensors, and one that takes the GIL of a finalizing
        # interpreter aborts the rank ("terminate called without an active exception", SIGABRT,
        # about one exit in 20 here; pytorch/pytorch#179291). Everything is written and closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def script() -> None:
    """The ``eagleops`` console script."""
    _leave(main())


if __name__ == "__main__":
    script()
