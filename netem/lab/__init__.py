"""The kernel lab: real tc-netem inside Debian's User-Mode Linux kernel, for hosts without it.

`run_in_lab(argv)` boots a fresh UML guest whose root is this host's file system, runs argv
there (this checkout, this Python), and returns its exit code and output (`LabResult`);
`find_kernel()` finds or fetches the kernel (`LabUnavailable` says what is missing). The CLI is
`moemesh lab probe|run|bench-links` (also `python -m netem.lab probe|run`, which CI calls;
`bench-links` is registered by `bench.commands`).
"""

from __future__ import annotations

from netem.lab.kernel import LabUnavailable, UmlKernel, find_kernel
from netem.lab.runner import LabResult, run_in_lab

__all__ = ["LabResult", "LabUnavailable", "UmlKernel", "find_kernel", "run_in_lab"]
